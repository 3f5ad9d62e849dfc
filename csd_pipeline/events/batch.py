"""CSD events (SPEC §5): what the data loader hands the loss, and how rows become a batch.

For every accepted chunk of an aligned row, the events are listed as flat numpy index arrays:

- the student's chain gathers: (position, token) of the chunk's fixed student prefix s_1..s_{M-1};
- the events: for each, its student final-token gathers (the spelling class of u_k at the final
  predictor position) and the teacher's log q_T(k) (chain factors + final-token class, float64);
- per chunk its shape (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N; the order of `schemas.aligned.SHAPES`),
  its student token span (first token, count) and the teacher's log-likelihood of its observed
  tokens (what `--kd-combine select` compares between teachers, `events.teacher_select`).

The loss (`loss.csd`) then only gathers student log-probabilities at those pairs and sums them per
chunk. One row's events are built by `events.row_events.build_row_events` (with the look-ups of
`events.context.EventContext` and the rules of `events.chunk_events`); this module holds the
`BatchEvents` type, the batch assembly (`collate_events`) and the CE targets (`ce_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from csd_pipeline.errors import CsdError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
# numpy is imported where it is used, so that `csd-train --help` (which reads SPELLING_MODES) stays instant.

SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, SHAPE_M_N = 0, 1, 2, 3


def chunk_shape(student_tokens: int, teacher_tokens: int) -> int:
    """The shape code of a chunk of M student and N teacher tokens (both >= 1)."""
    if student_tokens == 1:
        return SHAPE_1_1 if teacher_tokens == 1 else SHAPE_1_N
    return SHAPE_M_1 if teacher_tokens == 1 else SHAPE_M_N

# How token ids that share a spelling enter the events: summed into one event, or sent to REST; "prefix" sums
# them and, in 1:1 chunks, also counts every token that is no common spelling toward the longest common spelling
# that begins it (`EventContext.common_prefix`), on both sides.
SPELLING_MODES = ("sum", "exclude", "prefix")
DEFAULT_SPELLING = "sum"

_INDEX_FIELDS = ("chain_pos", "chain_tok", "chain_chunk", "final_pos", "final_tok", "final_event", "event_chunk",
                 "chunk_shape", "chunk_student_start", "chunk_student_len")
# Fields that hold flat student positions: shifted by each row's offset when rows become a batch.
_POSITION_FIELDS = ("chain_pos", "final_pos", "chunk_student_start")


class ChunkShapeCounts:
    """`num_chunks` and `shape_counts()` (accepted KD chunks per shape, on the CPU) of a batch with a `chunk_shape`
    column and `stats`: the CSD events, the baseline rows and the ALM rows share them."""

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_shape.shape[0])

    def shape_counts(self) -> list[int]:
        """Chunks per shape [1:1, 1:N, M:1, M:N]."""
        import numpy as np

        counts = self.stats.get("shape_counts")
        if counts is not None:
            return list(counts)
        shape = self.chunk_shape if isinstance(self.chunk_shape, np.ndarray) else self.chunk_shape.cpu().numpy()
        return np.bincount(shape, minlength=4)[:4].tolist()


@dataclass
class BatchEvents(ChunkShapeCounts):
    """Flat events of one row or one batch, for one teacher (numpy on CPU, torch after `.to`).

    chain_pos/chain_tok/chain_chunk: int64 [Gc] student chain gathers and their chunk.
    final_pos/final_tok/final_event: int64 [Gf] student final-token gathers and their event.
    event_chunk: int64 [E]; event_teacher_logq: float64 [E] teacher log q_T per event.
    chunk_shape: int64 [C] (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N).
    chunk_student_start / chunk_student_len: int64 [C] the student tokens the chunk spans: the position of
    its first token in the row (in the packed batch after `collate_events`) and M.
    chunk_teacher_loglik: float64 [C] the teacher's log-probability of the chunk's observed teacher tokens.
    stats: counters (chunks skipped by reason, rows) for logging; not sent to the device.
    """

    chain_pos: Any
    chain_tok: Any
    chain_chunk: Any
    final_pos: Any
    final_tok: Any
    final_event: Any
    event_chunk: Any
    event_teacher_logq: Any
    chunk_shape: Any
    chunk_student_start: Any
    chunk_student_len: Any
    chunk_teacher_loglik: Any
    stats: dict = field(default_factory=dict)

    @property
    def num_events(self) -> int:
        return int(self.event_chunk.shape[0])

    def to(self, device, float_dtype=None) -> BatchEvents:
        """The same events as torch tensors on `device` (teacher log q in float_dtype, default float64)."""
        import torch

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "stats":
                stats = dict(value)
                stats.setdefault("shape_counts", self.shape_counts())
                out[f.name] = stats
            elif isinstance(value, torch.Tensor):
                out[f.name] = value.to(device)
            else:
                out[f.name] = torch.as_tensor(value).to(device)
            if f.name == "event_teacher_logq" and float_dtype is not None:
                out[f.name] = out[f.name].to(float_dtype)
        return BatchEvents(**out)


def empty_events(stats: dict | None = None) -> BatchEvents:
    """Events with no chunks (a row without accepted chunks, or loss "ce")."""
    import numpy as np

    z = np.zeros(0, dtype=np.int64)
    f = np.zeros(0, dtype=np.float64)
    return BatchEvents(z, z, z, z, z, z, z, f, z, z, z, f, dict(stats or {}))


def collate_events(rows: list[BatchEvents], row_offsets) -> BatchEvents:
    """Concatenate row events into one batch; row i's positions are shifted by row_offsets[i].

    row_offsets: the flat position of each row's first token in the student hidden states
    ([B*T] padded or packed). Chunk and event indices are renumbered. Stats are summed.
    """
    import numpy as np

    offsets = [int(o) for o in row_offsets]
    if len(offsets) != len(rows):
        raise CsdError(f"collate_events got {len(rows)} rows but {len(offsets)} row offsets; give one per row.")
    if not rows:
        return empty_events()
    parts: dict[str, list] = {name: [] for name in _INDEX_FIELDS}
    parts["event_teacher_logq"] = []
    parts["chunk_teacher_loglik"] = []
    stats: dict = {}
    n_chunks = n_events = 0
    for ev, off in zip(rows, offsets):
        for name in parts:
            value = getattr(ev, name)
            if name in _POSITION_FIELDS:
                value = value + off
            elif name in ("chain_chunk", "event_chunk"):
                value = value + n_chunks
            elif name == "final_event":
                value = value + n_events
            parts[name].append(value)
        n_chunks += ev.num_chunks
        n_events += ev.num_events
        for key, value in ev.stats.items():
            if isinstance(value, int | float):
                stats[key] = stats.get(key, 0) + value
    stats["rows"] = len(rows)
    return BatchEvents(**{k: np.concatenate(v) for k, v in parts.items()}, stats=stats)


def ce_targets(student_ids_rows, loss_mask_rows, row_offsets) -> tuple[np.ndarray, np.ndarray]:
    """Flat CE targets (positions, tokens): position p predicts token p+1 where mask[p+1] is true."""
    import numpy as np

    positions, tokens = [], []
    for ids, mask, off in zip(student_ids_rows, loss_mask_rows, row_offsets, strict=True):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != ids.shape:
            raise CsdError(
                f"student_loss_mask has {mask.shape[0]} entries for {ids.shape[0]} student tokens; re-run the align stage."
            )
        p = np.flatnonzero(mask[1:])
        positions.append(p + int(off))
        tokens.append(ids[p + 1])
    if not positions:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(positions), np.concatenate(tokens)


def stack_chunk_rows(rows: list, row_offsets, what: str) -> tuple[list[int], list, dict]:
    """What collating per-row chunk rows (baseline, ALM) shares: the row offsets (one per row, checked), each row's
    `chain_chunk` shifted past the chunks before it, and the numeric stats summed (with `rows`)."""
    offsets = [int(o) for o in row_offsets]
    if len(offsets) != len(rows) or not rows:
        raise CsdError(f"{what} got {len(rows)} rows and {len(offsets)} row offsets; give one per row.")
    n_chunks, chain_chunk, stats = 0, [], {}
    for r in rows:
        chain_chunk.append(r.chain_chunk + n_chunks)
        n_chunks += r.num_chunks
        for key, value in r.stats.items():
            if isinstance(value, int | float):
                stats[key] = stats.get(key, 0) + value
    stats["rows"] = len(rows)
    return offsets, chain_chunk, stats
