"""Held-out bits per byte: a figure that compares models with different tokenizers.

    bits/byte = (sum over content tokens of -ln p(token | earlier tokens of its window)) / (UTF-8 bytes
                of the windows' text) / ln 2

Content tokens are the tokens of non-`SPECIAL` chunks: the zero-width context token (BOS or
document separator) is never a target, it only predicts the first content token. The student side
reads `student_ids`, teacher i reads `teacher{i}_ids` with its own chunks, so the same aligned
directory scores both on exactly the same bytes. Windows are packed as in training (positions
restart per window) and the log-probabilities come from the chunked LM-head gather, so memory
stays bounded by the chunk size.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from trainer.packing import check_window_length, pack, plan_rows


def _side_columns(side) -> tuple[str, str, str]:
    """(ids column, chunk-length column of that side, status column) for "student" or a teacher index."""
    from schemas.aligned import teacher_columns

    if side == "student":
        ids, student_len, _, status = teacher_columns(0)
        return "student_ids", student_len, status
    index = int(side)
    ids, _, teacher_len, status = teacher_columns(index)
    return ids, teacher_len, status


def content_targets(chunk_len: np.ndarray, status: np.ndarray, n_tokens: int) -> np.ndarray:
    """Indices of the tokens covered by non-SPECIAL chunks, excluding token 0 (it has no predictor)."""
    from schemas.aligned import ChunkStatus

    covered = np.repeat(np.asarray(status) != ChunkStatus.SPECIAL, np.asarray(chunk_len, dtype=np.int64))
    if covered.shape[0] != n_tokens:
        raise CsdError(f"chunk lengths cover {covered.shape[0]} tokens but the row has {n_tokens}; "
                       "the aligned shard is corrupted, re-run `csd-pipeline align`")
    covered[:1] = False
    return np.flatnonzero(covered)


def _eval_rows(aligned_dir: Path, side, max_rows: int, fingerprint: str | None):
    """(ids, target indices, text bytes) of the held-out rows, in manifest order."""
    import pyarrow.parquet as pq

    from csd_pipeline.runtime.manifest import read_manifest, require_fingerprint, shard_paths
    from schemas.aligned import SCHEMA_VERSION, STAGE

    manifest = read_manifest(aligned_dir, stage=STAGE, schema_versions=[SCHEMA_VERSION])
    if manifest.get("config", {}).get("mode", "text") != "text":
        raise CsdError(f"{aligned_dir} was aligned in {manifest['config']['mode']} mode; bits per byte scores "
                       "whole texts: pass a held-out directory aligned with `csd-pipeline align --mode text`")
    if not manifest.get("config", {}).get("context_token", True):
        raise CsdError(f"{aligned_dir} was aligned with --no-context-token: its first token has no predictor, "
                       "so bits per byte would leave bytes unscored; re-run `csd-pipeline align` with context tokens")
    if fingerprint is not None:
        tokenizers = manifest.get("tokenizers", {})
        recorded = (tokenizers.get("student", {}) if side == "student"
                    else (tokenizers.get("teachers") or [{}] * (int(side) + 1))[int(side)]).get("fingerprint")
        what = "student tokenizer" if side == "student" else f"teacher tokenizer {side}"
        require_fingerprint(manifest, aligned_dir, what, recorded, fingerprint)
    ids_col, len_col, status_col = _side_columns(side)
    count = 0
    for path in shard_paths(manifest, aligned_dir):
        try:
            table = pq.read_table(path, columns=["text", ids_col, len_col, status_col])
        except KeyError:
            raise CsdError(f"{path} has no column {ids_col}: {aligned_dir} aligns fewer teachers than asked; "
                           "pick an existing teacher index") from None
        columns = table.to_pydict()
        for text, ids, lens, status in zip(columns["text"], columns[ids_col], columns[len_col], columns[status_col],
                                           strict=True):
            if max_rows and count >= max_rows:
                return
            ids = np.asarray(ids, dtype=np.int64)
            yield ids, content_targets(np.asarray(lens), np.asarray(status), len(ids)), len(text.encode("utf-8"))
            count += 1


def eval_batches(aligned_dir, side="student", *, seq_len: int, batch_size: int, max_rows: int = 0,
                 rank: int = 0, world: int = 1, fingerprint: str | None = None):
    """Packed held-out batches of this rank: (packed, target positions, target tokens, text bytes)."""
    rows = [r for i, r in enumerate(_eval_rows(Path(aligned_dir), side, max_rows, fingerprint)) if i % world == rank]
    start = 0
    while start < len(rows):
        for ids, _, _ in rows[start:start + batch_size * seq_len]:
            check_window_length(len(ids), seq_len, "held-out row")
        placements, used = plan_rows([len(r[0]) for r in rows[start:]], seq_len, batch_size)
        chosen = rows[start:start + used]
        packed = pack([r[0] for r in chosen], placements, seq_len, batch_size)
        offsets = packed.flat_offsets
        positions = np.concatenate([off + t - 1 for off, (_, t, _) in zip(offsets, chosen, strict=True)])
        tokens = np.concatenate([ids[t] for ids, t, _ in chosen])
        yield packed, positions, tokens, sum(r[2] for r in chosen)
        start += used


def bits_per_byte(model, aligned_dir, side="student", *, seq_len: int = 2048, batch_size: int = 1,
                  max_rows: int = 0, chunk_size: int = 1024, fingerprint: str | None = None) -> dict:
    """Bits per byte of any HF causal LM on an aligned directory (single process, no grad).

    side: "student" (reads `student_ids`) or a teacher index i (reads `teacher{i}_ids`: use it to
    score the teacher). fingerprint: when given, the tokenizer fingerprint the directory must
    record for that side. Returns {"bits_per_byte", "nats", "bytes", "tokens", "rows"}. Raises
    `CsdError` for a missing/mismatched directory or a window longer than `seq_len`.
    """
    import torch

    from csd_pipeline.loss.csd import chunked_token_logprobs
    from csd_pipeline.runtime import progress
    from csd_pipeline.runtime.manifest import read_manifest

    device = next(model.parameters()).device
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    rows = int(read_manifest(aligned_dir)["totals"]["rows"])
    with torch.no_grad(), progress.bar(min(rows, max_rows or rows), "bits per byte", "row") as shown:
        for packed, positions, tokens, text_bytes in eval_batches(
                aligned_dir, side, seq_len=seq_len, batch_size=batch_size, max_rows=max_rows,
                fingerprint=fingerprint):
            hidden = decoder(input_ids=torch.as_tensor(packed.input_ids, device=device),
                             position_ids=torch.as_tensor(packed.position_ids, device=device),
                             use_cache=False).last_hidden_state
            logprobs = chunked_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                              torch.as_tensor(positions, device=device),
                                              torch.as_tensor(tokens, device=device), chunk_size)
            nats -= float(logprobs.double().sum())
            n_bytes += text_bytes
            n_tokens += len(tokens)
            n_rows += len(packed.placements)
            shown.update(len(packed.placements))
    return _summary(nats, n_bytes, n_tokens, n_rows)


def bits_per_byte_fsdp(wrapper, aligned_dir, ctx, *, seq_len: int, batch_size: int, max_rows: int = 0,
                       chunk_size: int = 1024, student_fingerprint: str | None = None) -> dict:
    """Bits per byte of the FSDP2-sharded student (collective: every rank calls it).

    Rows are split over ranks; ranks with fewer batches run empty ones so the collectives match.
    """
    import torch

    from csd_pipeline.runtime import progress
    from trainer import distributed

    batches = list(eval_batches(aligned_dir, "student", seq_len=seq_len, batch_size=batch_size,
                                max_rows=max_rows, rank=ctx.rank, world=ctx.world,
                                fingerprint=student_fingerprint))
    rounds = int(max(distributed.all_reduce_sum([0.0] * ctx.rank + [len(batches)] + [0.0] * (ctx.world - ctx.rank - 1),
                                                ctx.device)))
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    empty = np.zeros(0, dtype=np.int64)
    was_training = wrapper.training
    wrapper.eval()
    shown = progress.bar(rounds, "held-out", "batch", leave=False) if ctx.rank == 0 else progress.NullBar()
    with torch.no_grad(), shown:
        for i in range(rounds):
            if i < len(batches):
                packed, positions, tokens, text_bytes = batches[i]
                input_ids, position_ids = packed.input_ids, packed.position_ids
            else:
                input_ids = position_ids = np.zeros((1, 2), dtype=np.int64)
                positions, tokens, text_bytes = empty, empty, 0
            out = wrapper(torch.as_tensor(input_ids, device=ctx.device),
                          torch.as_tensor(position_ids, device=ctx.device),
                          torch.as_tensor(positions, device=ctx.device), torch.as_tensor(tokens, device=ctx.device),
                          global_ce_tokens=1.0, chunk_size=chunk_size)
            nats += float(out["ce"])  # divided by 1: the sum of -log p
            n_bytes += text_bytes
            n_tokens += len(tokens)
            n_rows += len(packed.placements) if i < len(batches) else 0
            shown.update(1)
    wrapper.train(was_training)
    nats, n_bytes, n_tokens, n_rows = distributed.all_reduce_sum([nats, n_bytes, n_tokens, n_rows], ctx.device)
    return _summary(nats, int(n_bytes), int(n_tokens), int(n_rows))


def _summary(nats: float, n_bytes: int, n_tokens: int, n_rows: int) -> dict:
    if n_bytes == 0:
        raise CsdError("the held-out aligned directory has no text bytes to score; pass a non-empty --eval-aligned")
    return {"bits_per_byte": nats / n_bytes / math.log(2), "nats": nats, "bytes": n_bytes, "tokens": n_tokens,
            "rows": n_rows}
