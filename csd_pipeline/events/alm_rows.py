"""What `--loss alm` (`loss.alm`) reads of each chunk: the two sides' chunk log-likelihoods, built on the CPU.

For every accepted chunk of an aligned row with a predictor on both sides (a token before it on each side),
this module keeps, as flat numpy arrays like `BatchEvents`:

- the student's gathers: every student token of the chunk at the position before it (`chain_pos`,
  `chain_tok`, `chain_chunk`); their log-probabilities summed are the student's chunk log-likelihood;
- the teacher's chunk log-likelihood: the sum of the stored observed log-probabilities of the chunk's
  teacher tokens (exact in every store, whatever it keeps of the top-k);
- with debiasing: the student position of the chunk's last token (`end_pos`, whose next-token row the
  loss reads) and the teacher's log-probability that the token after the chunk starts with whitespace or
  is a special token, from what the store has at the chunk's last teacher position: its stored entries
  plus the observed next token where they lack it, at least TEACHER_SPACE_FLOOR. That is a lower bound of the
  whole distribution's mass (tokenkit sums the whole row; `tests/loss/alm_debias_measure.py` measures the gap).

The whitespace masks (`space_mask`) follow tokenkit's `get_space_mask` with its default mode
"space+tab+newline+special": a token whose first byte is a space, a tab or a newline, or a (trusted)
special token.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import ChunkShapeCounts, chunk_shape, stack_chunk_rows
from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks, teacher_positions

WHITESPACE_FIRST_BYTES = (0x20, 0x09, 0x0A)  # tokenkit's space_mask_mode "space+tab+newline" (+ "special")
# The teacher's whitespace mass is taken as at least this. The stored entries cannot rule out whitespace tokens
# outside them, and a mass of 0 makes y_T = 0 for a chunk whose true y_T = p^(1/100) is near 1 (a whole-row mass of
# 1e-6 gives 0.87): with Gemma 3 on German, 9% of chunk ends store no whitespace token in the top-128, and those
# chunks alone turned the gradient away from the whole-row one (cosine 0.36; 0.92 with this floor).
TEACHER_SPACE_FLOOR = 1e-6

_SPACE_MASKS: dict[str, np.ndarray] = {}  # by vocabulary fingerprint


def space_mask(vocab) -> np.ndarray:
    """bool [V]: the ids of `vocab` (a `Vocabulary`) whose token starts with whitespace, or that are trusted
    special tokens (end of text, end of turn): the tokens that can follow a chunk that ends a word."""
    key = vocab.fingerprint
    if key not in _SPACE_MASKS:
        usable = np.asarray(vocab.flags) == 0
        special = np.asarray(vocab.is_special) & ~np.asarray(vocab.untrusted)
        first = np.asarray([b[0] if b else -1 for b in vocab.token_bytes], dtype=np.int64)
        _SPACE_MASKS[key] = special | (usable & np.isin(first, WHITESPACE_FIRST_BYTES))
    return _SPACE_MASKS[key]


@dataclass
class AlmRows(ChunkShapeCounts):
    """Per accepted chunk of a row or batch, what the ALM loss reads (numpy; torch after `.to`).

    chunk_shape: int64 [C] (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N); chain_pos / chain_tok / chain_chunk:
    int64 [G] the student's tokens of each chunk and the positions that predict them; teacher_logp:
    float64 [C] the teacher's chunk log-likelihood; end_pos: int64 [C] the student position of each
    chunk's last token; teacher_space_logp: float64 [C] log of the teacher's stored mass on whitespace-
    starting tokens after the chunk (at least log TEACHER_SPACE_FLOOR; 0 when `debias` is off); student_space: bool [Vs]
    the student's whitespace mask; debias: whether the loss adds the whitespace terms; stats: counters.
    """

    chunk_shape: Any
    chain_pos: Any
    chain_tok: Any
    chain_chunk: Any
    teacher_logp: Any
    end_pos: Any
    teacher_space_logp: Any
    student_space: Any
    debias: bool = True
    stats: dict = field(default_factory=dict)

    def to(self, device) -> AlmRows:
        """The same rows as torch tensors on `device` (log-probs stay float64)."""
        import torch

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "stats":
                out[f.name] = dict(value, shape_counts=self.shape_counts())
            elif f.name == "debias":
                out[f.name] = value
            else:
                out[f.name] = torch.as_tensor(value).to(device)
        return AlmRows(**out)


def _empty(student_space, debias: bool, stats: dict | None = None) -> AlmRows:
    z = np.zeros(0, dtype=np.int64)
    return AlmRows(z, z, z, z, np.zeros(0), z, np.zeros(0), student_space, debias, dict(stats or {}))


def teacher_space_logp(ids: np.ndarray, logprobs: np.ndarray, next_id: int, next_logp: float,
                       mask: np.ndarray) -> float:
    """log of the teacher's mass on whitespace ids among one position's stored entries (`ids`, `logprobs`, the
    real ones), plus the observed next token (`next_id`, -1: none) where they lack it; at least
    log TEACHER_SPACE_FLOOR, at most 0."""
    inside = (ids >= 0) & (ids < len(mask))
    values = logprobs[inside & mask[np.where(inside, ids, 0)] & np.isfinite(logprobs)]
    if 0 <= next_id < len(mask) and mask[next_id] and next_id not in ids and np.isfinite(next_logp):
        values = np.append(values, next_logp)
    if values.size == 0:
        return float(np.log(TEACHER_SPACE_FLOOR))
    return float(min(max(np.logaddexp.reduce(values), np.log(TEACHER_SPACE_FLOOR)), 0.0))


def build_alm_rows(aligned_row, teacher_index: int, teacher, context, *, debias: bool = True,
                   source: str = "") -> AlmRows:
    """The `AlmRows` of every accepted chunk of one aligned row for teacher `teacher_index`.

    aligned_row: the aligned columns (SPEC §8); teacher: that row's stored top-k (`TeacherTopkRow` or a dict
    with row_id, ids [T,k], logprobs [T,k], observed_logprob [T], optionally lengths and status); context: the
    pair's `EventContext`. debias: also read the teacher's whitespace mass after each chunk. Chunks without a
    predictor on either side are skipped and counted; a rejected teacher row gives none. Raises CsdError for a
    row that contradicts the tables or the teacher shard, naming the stage to re-run.
    """
    student_space = space_mask(context.student_vocab)
    row = read_aligned_chunks(aligned_row, teacher_index, context, source)
    status = teacher.get("status", 0) if isinstance(teacher, dict) else getattr(teacher, "status", 0)
    if status:
        return _empty(student_space, debias, {"rows_teacher_rejected": 1})
    positions = teacher_positions(teacher, row)
    if positions.dense:
        raise CsdError(f"{row.where}: --loss alm reads the teacher's stored observed log-probs, not dense log-probs; "
                       "pass the output of `csd-pipeline teacher-logits`.")
    teacher_mask = space_mask(context.teacher_vocab) if debias else None
    observed, n_teacher = positions.observed_logprob, len(row.teacher_ids)
    out = {k: [] for k in ("shape", "teacher_logp", "end_pos", "space", "chain")}
    stats = {"chunks_not_accepted": int(np.count_nonzero(row.status != ACCEPTED)), "chunks_no_predictor": 0}
    for c in np.flatnonzero(row.status == ACCEPTED).tolist():
        m, n = int(row.student_len[c]), int(row.teacher_len[c])
        s0, t0 = int(row.student_start[c]), int(row.teacher_start[c])
        if m == 0 or n == 0:
            raise CsdError(f"{row.where}: accepted chunk {c} has {m} student and {n} teacher tokens; the aligned "
                           "shard is corrupted, re-run the align stage.")
        if s0 == 0 or t0 == 0:
            stats["chunks_no_predictor"] += 1
            continue
        lps = observed[t0 - 1:t0 + n - 1]
        if not np.isfinite(lps).all():
            raise CsdError(f"{row.where}: the teacher log-probability of a token of accepted chunk {c} is not finite; "
                           "the teacher shard is corrupted, re-run `csd-pipeline teacher-logits`.")
        last = t0 + n - 1
        if debias:
            stored = int(positions.lengths[last])
            next_id = int(row.teacher_ids[last + 1]) if last + 1 < n_teacher else -1
            out["space"].append(teacher_space_logp(positions.ids[last, :stored], positions.logprobs[last, :stored],
                                                   next_id, float(observed[last]), teacher_mask))
        else:
            out["space"].append(0.0)
        index = len(out["shape"])
        out["shape"].append(chunk_shape(m, n))
        out["teacher_logp"].append(min(float(lps.sum()), 0.0))
        out["end_pos"].append(s0 + m - 1)
        out["chain"].extend((s0 - 1 + r, int(row.student_ids[s0 + r]), index) for r in range(m))
    chain = np.asarray(out["chain"], dtype=np.int64).reshape(-1, 3)
    return AlmRows(np.asarray(out["shape"], dtype=np.int64), chain[:, 0].copy(), chain[:, 1].copy(),
                   chain[:, 2].copy(), np.asarray(out["teacher_logp"], dtype=np.float64),
                   np.asarray(out["end_pos"], dtype=np.int64), np.asarray(out["space"], dtype=np.float64),
                   student_space, debias, stats)


def collate_alm_rows(rows: list[AlmRows], row_offsets) -> AlmRows:
    """Concatenate row `AlmRows` into one batch; row i's positions are shifted by row_offsets[i]."""
    offsets, chain_chunk, stats = stack_chunk_rows(rows, row_offsets, "collate_alm_rows")
    cat = np.concatenate
    return AlmRows(
        chunk_shape=cat([r.chunk_shape for r in rows]),
        chain_pos=cat([r.chain_pos + o for r, o in zip(rows, offsets, strict=True)]),
        chain_tok=cat([r.chain_tok for r in rows]),
        chain_chunk=cat(chain_chunk),
        teacher_logp=cat([r.teacher_logp for r in rows]),
        end_pos=cat([r.end_pos + o for r, o in zip(rows, offsets, strict=True)]),
        teacher_space_logp=cat([r.teacher_space_logp for r in rows]),
        student_space=rows[0].student_space, debias=rows[0].debias, stats=stats,
    )
