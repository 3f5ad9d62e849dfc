"""Held-out bits per byte: a figure that compares models with different tokenizers.

    bits/byte = (sum over content tokens of -ln p(token | earlier tokens of its window)) / (UTF-8 bytes
                of the windows' text) / ln 2

Content tokens are the tokens of non-`SPECIAL` chunks: the zero-width context token (BOS or
document separator) is never a target, it only predicts the first content token. The student side
reads the student's ids, teacher i its own ids with its own chunks (`AlignedOutput.side_columns`),
so the same aligned directory scores both on exactly the same bytes. Windows are packed as in
training (positions restart per window) and the log-probabilities come from the chunked LM-head
gather, so memory stays bounded by the chunk size. The trainer's FSDP evaluation
(`trainer/evaluation.py`) scores its batches from `eval_batches` too.
"""

from __future__ import annotations

import math

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.evaluation.packing import check_window_length, pack, plan_rows


def content_targets(chunk_len: np.ndarray, status: np.ndarray, n_tokens: int) -> np.ndarray:
    """Indices of the tokens covered by non-SPECIAL chunks, excluding token 0 (it has no predictor)."""
    from schemas.aligned import ChunkStatus

    covered = np.repeat(np.asarray(status) != ChunkStatus.SPECIAL, np.asarray(chunk_len, dtype=np.int64))
    if covered.shape[0] != n_tokens:
        raise CsdError(f"chunk lengths cover {covered.shape[0]} tokens but the row has {n_tokens}; "
                       "the aligned shard is corrupted, re-run `csd-pipeline align`")
    covered[:1] = False
    return np.flatnonzero(covered)


def _eval_rows(aligned_dir, side, max_rows: int, fingerprint: str | None):
    """(ids, target indices, text bytes) of the held-out rows, in manifest order."""
    from csd_pipeline.align.output import AlignedOutput

    aligned = AlignedOutput.open(aligned_dir)
    if aligned.mode != "text":
        raise CsdError(f"{aligned.directory} was aligned in {aligned.mode} mode; bits per byte scores whole texts: "
                       "pass a held-out directory aligned with `csd-pipeline align --mode text`")
    if not aligned.context_token:
        raise CsdError(f"{aligned.directory} was aligned with --no-context-token: its first token has no predictor, "
                       "so bits per byte would leave bytes unscored; re-run `csd-pipeline align` with context tokens")
    if side != "student":
        aligned.check_teacher_index(int(side), "teacher")
    if fingerprint is not None:
        aligned.require_tokenizer(side, fingerprint)
    columns = aligned.side_columns(side)
    count = 0
    for shard in aligned.shards:
        table = aligned.read(shard, ["text", columns.ids, columns.chunk_len, columns.chunk_status]).to_pydict()
        for text, ids, lens, status in zip(table["text"], table[columns.ids], table[columns.chunk_len],
                                           table[columns.chunk_status], strict=True):
            if max_rows and count >= max_rows:
                return
            ids = np.asarray(ids, dtype=np.int64)
            yield ids, content_targets(np.asarray(lens), np.asarray(status), len(ids)), len(text.encode("utf-8"))
            count += 1


def eval_batches(aligned_dir, side="student", *, seq_len: int, batch_size: int, max_rows: int = 0,
                 rank: int = 0, world: int = 1, fingerprint: str | None = None):
    """Packed held-out batches of this rank: (packed, target positions, target tokens, text bytes)."""
    rows = [r for i, r in enumerate(_eval_rows(aligned_dir, side, max_rows, fingerprint)) if i % world == rank]
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


def bits_per_byte(model, aligned_dir, side="student", *, seq_len: int, batch_size: int, max_rows: int = 0,
                  chunk_size: int = 1024, fingerprint: str | None = None) -> dict:
    """Bits per byte of any HF causal LM on an aligned directory (single process, no grad).

    side: "student" (reads the student's ids) or a teacher index i (reads teacher i's ids: use it to
    score the teacher). fingerprint: when given, the tokenizer fingerprint the directory must
    record for that side. Returns {"bits_per_byte", "nats", "bytes", "tokens", "rows"}. Raises
    `CsdError` for a missing/mismatched directory or a window longer than `seq_len`.
    """
    import torch

    from csd_pipeline.loss.token_logprobs import chunked_token_logprobs

    device = next(model.parameters()).device
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    with torch.no_grad():
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
    return summary(nats, n_bytes, n_tokens, n_rows)


def summary(nats: float, n_bytes: int, n_tokens: int, n_rows: int) -> dict:
    """{"bits_per_byte", "nats", "bytes", "tokens", "rows"} of summed counts; `CsdError` when no byte was scored."""
    if n_bytes == 0:
        raise CsdError("the held-out aligned directory has no text bytes to score; pass a non-empty --eval-aligned")
    return {"bits_per_byte": nats / n_bytes / math.log(2), "nats": nats, "bytes": n_bytes, "tokens": n_tokens,
            "rows": n_rows}
