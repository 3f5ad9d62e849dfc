"""Held-out bits per byte: a figure that compares models with different tokenizers.

    bits/byte = (sum over content tokens of -ln p(token | earlier tokens of its window)) / (UTF-8 bytes
                of the windows' text) / ln 2

Content tokens are the tokens of non-`SPECIAL` chunks: the zero-width context token (BOS or
document separator) is never a target, it only predicts the first content token. The student side
reads the student's ids, teacher i its own ids with its own chunks (`AlignedOutput.side_columns`),
so the same aligned directory scores both on exactly the same bytes. Windows are packed as in
training (positions restart per window) and the log-probabilities come from the chunked LM-head
gather, so memory stays bounded by the chunk size. Each window's nats and bytes are also summed by its
row's `source` (`evaluation.per_source`). The trainer's FSDP evaluation (`trainer/evaluation.py`) scores
its batches from `HeldOutRows` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.evaluation.packing import PackedBatch, check_window_length, pack, plan_rows


def content_targets(chunk_len: np.ndarray, status: np.ndarray, n_tokens: int) -> np.ndarray:
    """Indices of the tokens covered by non-SPECIAL chunks, excluding token 0 (it has no predictor)."""
    from schemas.aligned import ChunkStatus

    covered = np.repeat(np.asarray(status) != ChunkStatus.SPECIAL, np.asarray(chunk_len, dtype=np.int64))
    if covered.shape[0] != n_tokens:
        raise CsdError(f"chunk lengths cover {covered.shape[0]} tokens but the row has {n_tokens}; "
                       "the aligned shard is corrupted, re-run `csd-pipeline align`")
    covered[:1] = False
    return np.flatnonzero(covered)


@dataclass
class HeldOutBatch:
    """One packed held-out batch: its inputs, flat target positions and tokens (window order), its text
    bytes, and per window its target count, text bytes and source (the corpus file of its row)."""

    packed: PackedBatch
    positions: np.ndarray
    tokens: np.ndarray
    text_bytes: int
    window_tokens: np.ndarray
    window_bytes: list[int]
    window_sources: list[str]


def _eval_rows(aligned_dir, side, max_rows: int, fingerprint: str | None) -> list[tuple]:
    """(ids, target indices, text bytes, source) of the held-out rows, in manifest order."""
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
    rows = []
    for shard in aligned.shards:
        table = aligned.read(shard, ["text", "source", columns.ids, columns.chunk_len,
                                     columns.chunk_status]).to_pydict()
        for text, source, ids, lens, status in zip(table["text"], table["source"], table[columns.ids],
                                                   table[columns.chunk_len], table[columns.chunk_status], strict=True):
            if max_rows and len(rows) >= max_rows:
                return rows
            ids = np.asarray(ids, dtype=np.int64)
            rows.append((ids, content_targets(np.asarray(lens), np.asarray(status), len(ids)),
                         len(text.encode("utf-8")), source))
    return rows


class HeldOutRows:
    """The held-out rows of an aligned directory (one side), read once: `sources` (sorted, all ranks alike)
    and `batches` (one rank's packed batches). Raises `CsdError` for a directory that cannot be scored."""

    def __init__(self, aligned_dir, side="student", *, max_rows: int = 0, fingerprint: str | None = None):
        self.rows = _eval_rows(aligned_dir, side, max_rows, fingerprint)
        self.sources = sorted({r[3] for r in self.rows})

    def batches(self, *, seq_len: int, batch_size: int, rank: int = 0, world: int = 1):
        """This rank's `HeldOutBatch`es (rows i with i % world == rank), packed as in training."""
        rows = [r for i, r in enumerate(self.rows) if i % world == rank]
        start = 0
        while start < len(rows):
            for ids, *_ in rows[start:start + batch_size * seq_len]:
                check_window_length(len(ids), seq_len, "held-out row")
            placements, used = plan_rows([len(r[0]) for r in rows[start:]], seq_len, batch_size)
            chosen = rows[start:start + used]
            packed = pack([r[0] for r in chosen], placements, seq_len, batch_size)
            offsets = packed.flat_offsets
            positions = np.concatenate([off + r[1] - 1 for off, r in zip(offsets, chosen, strict=True)])
            tokens = np.concatenate([r[0][r[1]] for r in chosen])
            yield HeldOutBatch(packed, positions, tokens, sum(r[2] for r in chosen),
                               np.array([len(r[1]) for r in chosen], dtype=np.int64), [r[2] for r in chosen],
                               [r[3] for r in chosen])
            start += used


def eval_batches(aligned_dir, side="student", *, seq_len: int, batch_size: int, max_rows: int = 0,
                 rank: int = 0, world: int = 1, fingerprint: str | None = None):
    """Packed held-out batches of this rank (`HeldOutBatch`)."""
    return HeldOutRows(aligned_dir, side, max_rows=max_rows, fingerprint=fingerprint).batches(
        seq_len=seq_len, batch_size=batch_size, rank=rank, world=world)


def bits_per_byte(model, aligned_dir, side="student", *, seq_len: int, batch_size: int, max_rows: int = 0,
                  chunk_size: int = 1024, fingerprint: str | None = None) -> dict:
    """Bits per byte of any HF causal LM on an aligned directory (single process, no grad).

    side: "student" (reads the student's ids) or a teacher index i (reads teacher i's ids: use it to
    score the teacher). fingerprint: when given, the tokenizer fingerprint the directory must
    record for that side. Returns {"bits_per_byte", "nats", "bytes", "tokens", "rows", "sources"}
    ("sources": the same figures per source, `per_source.SourceTally.by_source`). Raises
    `CsdError` for a missing/mismatched directory or a window longer than `seq_len`.
    """
    import torch

    from csd_pipeline.evaluation.per_source import SourceTally
    from csd_pipeline.loss.token_logprobs import chunked_token_logprobs
    from csd_pipeline.runtime import progress

    device = next(model.parameters()).device
    nats, n_bytes, n_tokens, n_rows = 0.0, 0, 0, 0
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    held_out = HeldOutRows(aligned_dir, side, max_rows=max_rows, fingerprint=fingerprint)
    tally = SourceTally(held_out.sources)
    with torch.no_grad(), progress.bar(len(held_out.rows), "bits per byte", "row") as shown:
        for batch in held_out.batches(seq_len=seq_len, batch_size=batch_size):
            packed = batch.packed
            hidden = decoder(input_ids=torch.as_tensor(packed.input_ids, device=device),
                             position_ids=torch.as_tensor(packed.position_ids, device=device),
                             use_cache=False).last_hidden_state
            logprobs = chunked_token_logprobs(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                              torch.as_tensor(batch.positions, device=device),
                                              torch.as_tensor(batch.tokens, device=device), chunk_size)
            nats -= float(logprobs.double().sum())
            tally.add(batch, logprobs.double().cpu().numpy())
            n_bytes += batch.text_bytes
            n_tokens += len(batch.tokens)
            n_rows += len(packed.placements)
            shown.update(len(packed.placements))
    return summary(nats, n_bytes, n_tokens, n_rows, tally.by_source())


def summary(nats: float, n_bytes: int, n_tokens: int, n_rows: int, sources: dict | None = None) -> dict:
    """{"bits_per_byte", "nats", "bytes", "tokens", "rows"} of summed counts, plus "sources" (per source:
    the same keys) when given; `CsdError` when no byte was scored."""
    if n_bytes == 0:
        raise CsdError("the held-out aligned directory has no text bytes to score; pass a non-empty --eval-aligned")
    out = {"bits_per_byte": nats / n_bytes / math.log(2), "nats": nats, "bytes": n_bytes, "tokens": n_tokens,
           "rows": n_rows}
    if sources is not None:
        out["sources"] = sources
    return out
