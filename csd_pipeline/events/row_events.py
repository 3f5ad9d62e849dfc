"""The CSD events of one aligned row for one teacher (SPEC §5), built on the CPU in data-loader workers.

`build_row_events` reads the row's chunks for the teacher and checks them against the vocabularies
(`AlignedRowChunks`), checks the teacher's log-probabilities at each of its positions (`teacher_positions`:
a stored teacher top-k or, in tests, dense log-probs), then walks the accepted chunks and lets
`events.chunk_events.EventBuilder` list each chunk's events. Positions in the result are row-local
(student position j-1 predicts token j); `events.batch.collate_events` shifts them into a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import (
    DEFAULT_SPELLING,
    SHAPE_1_1,
    SPELLING_MODES,
    BatchEvents,
    chunk_shape,
    empty_events,
)
from csd_pipeline.events.chunk_events import EventBuilder
from csd_pipeline.events.context import EventContext
from csd_pipeline.teacher.row import TeacherTopkRow
from schemas.aligned import ChunkStatus, teacher_columns

ACCEPTED = int(ChunkStatus.ACCEPTED)


@dataclass
class AlignedRowChunks:
    """One aligned row's tokens and its chunks for one teacher, checked against each other and the vocabularies."""

    where: str  # the row (and file) for error messages
    row_id: object
    student_ids: np.ndarray  # int64 [S]
    teacher_ids: np.ndarray  # int64 [T]
    student_len: np.ndarray  # int64 [C]: M, student tokens of each chunk
    teacher_len: np.ndarray  # int64 [C]: N, teacher tokens of each chunk
    status: np.ndarray  # int64 [C]: ChunkStatus codes
    student_start: np.ndarray  # int64 [C]: first student token of each chunk
    teacher_start: np.ndarray  # int64 [C]: first teacher token of each chunk


def build_row_events(
    aligned_row,
    teacher_index: int,
    teacher,
    context: EventContext,
    *,
    spelling: str = DEFAULT_SPELLING,
    only_1to1: bool = False,
    source: str = "",
) -> BatchEvents:
    """Events of every accepted chunk of one aligned row for teacher `teacher_index`.

    aligned_row: a mapping with the aligned columns (SPEC §8): row_id, student_ids,
    teacher{i}_ids, teacher{i}_chunk_student_len / _teacher_len / _status. teacher: that row's
    teacher top-k (`TeacherTopkRow` or a dict with row_id, ids [T,k], logprobs [T,k],
    observed_logprob [T] and optionally lengths [T], the real entries of each position of a
    variable-length row; entries beyond them are ignored) or dense teacher log-probs [T, V] (tests). context: the `EventContext`
    of this teacher. Positions in the result are row-local (student position j-1 predicts token j).
    source: a file name for error messages. Raises CsdError for a row that contradicts the tables
    or the teacher shard (naming the row and the stage to re-run).
    """
    if spelling not in SPELLING_MODES:
        raise CsdError(f"unknown spelling mode {spelling!r}; choose 'sum' or 'exclude' (loss.spelling).")
    row = read_aligned_chunks(aligned_row, teacher_index, context, source)
    teacher_status = teacher.get("status", 0) if isinstance(teacher, dict) else getattr(teacher, "status", 0)
    if teacher_status:
        # A row the teacher-logits stage rejected (non-finite log-probs): CE only, no KD events.
        return empty_events({"rows_teacher_rejected": 1})
    positions = teacher_positions(teacher, row)
    builder = EventBuilder(context, spelling, row.where)
    stats = {"chunks_not_accepted": 0, "chunks_no_predictor": 0, "chunks_not_1to1": 0, "chunks_special_pair": 0}
    for c in np.flatnonzero(row.status == ACCEPTED).tolist():
        counted = _chunk_events(builder, row, positions, c, context, only_1to1)
        if counted is not None:
            stats[counted] += 1
    stats["chunks_not_accepted"] = int(np.count_nonzero(row.status != ACCEPTED))
    return builder.finish(stats)


def _chunk_events(builder: EventBuilder, row: AlignedRowChunks, positions: TeacherTopkRow, c: int,
                  context: EventContext, only_1to1: bool) -> str | None:
    """Add accepted chunk `c`'s events to `builder`; returns the stats key to count it under, if any."""
    m, n = int(row.student_len[c]), int(row.teacher_len[c])
    s0, t0 = int(row.student_start[c]), int(row.teacher_start[c])
    if m == 0 or n == 0:
        raise CsdError(
            f"{row.where}: accepted chunk {c} has {m} student and {n} teacher tokens; an accepted chunk needs "
            "both sides, the aligned shard is corrupted, re-run the align stage."
        )
    if s0 == 0 or t0 == 0:
        return "chunks_no_predictor"
    shape = chunk_shape(m, n)
    if only_1to1 and shape != SHAPE_1_1:
        return "chunks_not_1to1"
    s_tok = row.student_ids[s0 : s0 + m].tolist()
    t_tok = row.teacher_ids[t0 : t0 + n].tolist()
    if shape == SHAPE_1_1 and context.is_special_pair(s_tok[0], t_tok[0]):
        # Chat mode's end-of-turn pair: no byte spelling, so the only explicit event is the observed
        # pair; everything else is REST on both sides.
        if not np.isfinite(positions.observed_logprob[t0 - 1]):
            raise CsdError(
                f"{row.where}: the teacher log-probability of the special token of accepted chunk {c} is not "
                "finite; the teacher shard is corrupted, re-run `csd-pipeline teacher-logits`."
            )
        chunk = builder.start_chunk(shape, [], (s0, m), float(positions.observed_logprob[t0 - 1]))
        builder.add_event(chunk, s0 - 1, np.asarray([s_tok[0]], dtype=np.int64), float(positions.observed_logprob[t0 - 1]))
        return "chunks_special_pair"
    sb, tb = context.student_bytes, context.teacher_bytes
    s_prefix = b"".join(sb[i] for i in s_tok[:-1])
    t_prefix = b"".join(tb[i] for i in t_tok[:-1])
    u_obs, v_obs = s_tok[-1], t_tok[-1]
    if s_prefix + sb[u_obs] != t_prefix + tb[v_obs] or not sb[u_obs] or not tb[v_obs]:
        raise CsdError(
            f"{row.where}: accepted chunk {c} (student tokens {s0}..{s0 + m - 1}, teacher tokens {t0}..{t0 + n - 1}) "
            f"spells {s_prefix + sb[u_obs]!r} on the student side but {t_prefix + tb[v_obs]!r} on the teacher "
            "side; the aligned shard does not match these tokenizers/tables, re-run the align stage."
        )
    ft = t0 + n - 2  # the teacher position that predicts the chunk's final teacher token
    chain_lp = positions.observed_logprob[t0 - 1 : ft]
    obs_lp = positions.observed_logprob[ft]
    if not (np.isfinite(chain_lp).all() and np.isfinite(obs_lp)):
        raise CsdError(
            f"{row.where}: the teacher log-probability of a token of accepted chunk {c} is not finite; the teacher "
            "shard is corrupted, re-run `csd-pipeline teacher-logits`."
        )
    teacher_chain = float(chain_lp.sum())
    chunk = builder.start_chunk(shape, [(s0 - 1 + r, s_tok[r]) for r in range(m - 1)], (s0, m),
                                teacher_chain + float(obs_lp))
    fs = s0 + m - 2  # the student position that predicts the chunk's final student token
    if positions.dense:
        builder.add_dense_events(chunk, shape, fs, positions.logprobs[ft], teacher_chain, s_prefix, t_prefix,
                                 u_obs, v_obs)
    else:
        n = int(positions.lengths[ft])  # a variable-length row (--top-p) stores fewer than k entries here
        builder.add_topk_events(chunk, shape, fs, positions.ids[ft, :n], positions.logprobs[ft, :n], obs_lp,
                                teacher_chain, s_prefix, t_prefix, u_obs, v_obs)
    return None


def _row_get(row, key):
    if isinstance(row, dict):
        if key not in row:
            raise CsdError(f"aligned row has no column {key!r}; re-run the align stage with this teacher.")
        return row[key]
    return getattr(row, key)


def read_aligned_chunks(aligned_row, teacher_index: int, context: EventContext, source: str = "") -> AlignedRowChunks:
    """The row's tokens and teacher `teacher_index`'s chunks; raises `CsdError` when they do not fit together
    or an id is outside its vocabulary (naming the row and the stage to re-run)."""
    row_id = _row_get(aligned_row, "row_id") if not isinstance(aligned_row, dict) or "row_id" in aligned_row else None
    where = f"row {row_id}" + (f" of {source}" if source else "")
    ids_column, student_len_column, teacher_len_column, status_column = teacher_columns(teacher_index)
    student_ids = np.asarray(_row_get(aligned_row, "student_ids"), dtype=np.int64)
    teacher_ids = np.asarray(_row_get(aligned_row, ids_column), dtype=np.int64)
    m_len = np.asarray(_row_get(aligned_row, student_len_column), dtype=np.int64)
    n_len = np.asarray(_row_get(aligned_row, teacher_len_column), dtype=np.int64)
    status = np.asarray(_row_get(aligned_row, status_column), dtype=np.int64)
    if not (m_len.shape == n_len.shape == status.shape):
        raise CsdError(f"{where}: teacher{teacher_index} chunk columns have different lengths; re-run the align stage.")
    if int(m_len.sum()) != len(student_ids) or int(n_len.sum()) != len(teacher_ids) or (m_len < 0).any() or (n_len < 0).any():
        raise CsdError(
            f"{where}: teacher{teacher_index} chunks cover {int(m_len.sum())} student / {int(n_len.sum())} teacher "
            f"tokens but the row has {len(student_ids)} / {len(teacher_ids)}; the aligned shard is corrupted, "
            "re-run the align stage."
        )
    for ids, vocab, side in ((student_ids, context.student_vocab, "student"), (teacher_ids, context.teacher_vocab, "teacher")):
        if ids.size and (ids.min() < 0 or ids.max() >= vocab.size):
            raise CsdError(
                f"{where}: a {side} id ({int(ids.max())}) is outside the {side} vocabulary {vocab.name} "
                f"({vocab.size} ids); the tables do not match the tokenizers of the data, re-run align."
            )
    s_starts = np.concatenate([[0], np.cumsum(m_len)[:-1]]) if m_len.size else m_len
    t_starts = np.concatenate([[0], np.cumsum(n_len)[:-1]]) if n_len.size else n_len
    return AlignedRowChunks(where, row_id, student_ids, teacher_ids, m_len, n_len, status, s_starts, t_starts)


def teacher_positions(teacher, row: AlignedRowChunks) -> TeacherTopkRow:
    """The teacher input of one row (a `TeacherTopkRow`, a dict of its fields, or dense log-probs [T, V]) as a
    checked `TeacherTopkRow` in float64 whose padding entries have log-prob -inf; raises `CsdError` when its
    shapes or row id show that it was computed for another alignment."""
    teacher_len, row_id = len(row.teacher_ids), row.row_id
    if isinstance(teacher, np.ndarray) or hasattr(teacher, "detach"):
        dense = np.asarray(teacher.detach().cpu().numpy() if hasattr(teacher, "detach") else teacher, dtype=np.float64)
        if dense.ndim != 2 or dense.shape[0] != teacher_len:
            raise CsdError(
                f"row {row_id}: dense teacher log-probs have shape {dense.shape}, expected [{teacher_len}, V]; "
                "they were computed for another alignment."
            )
        observed = np.full(teacher_len, np.nan)
        observed[:-1] = dense[np.arange(teacher_len - 1), row.teacher_ids[1:]]
        return TeacherTopkRow(row_id, None, dense, observed)
    get = teacher.get if isinstance(teacher, dict) else lambda k: getattr(teacher, k, None)
    topk_row_id = get("row_id")
    if topk_row_id is not None and row_id is not None and str(topk_row_id) != str(row_id):
        raise CsdError(
            f"teacher top-k row {topk_row_id} is paired with aligned row {row_id}: the teacher shards were "
            "computed for another alignment; re-run `csd-pipeline teacher-logits` on this aligned directory."
        )
    ids = np.asarray(get("ids"), dtype=np.int64)
    logprobs = np.asarray(get("logprobs"), dtype=np.float64)
    observed = np.asarray(get("observed_logprob"), dtype=np.float64)
    if ids.ndim != 2 or ids.shape != logprobs.shape or ids.shape[0] != teacher_len or observed.shape != (teacher_len,):
        raise CsdError(
            f"teacher top-k row {topk_row_id}: shapes ids {ids.shape}, logprobs {logprobs.shape}, observed "
            f"{observed.shape} do not match the {teacher_len} teacher tokens of aligned row {row_id}; the teacher "
            "shards were computed for another alignment; re-run `csd-pipeline teacher-logits`."
        )
    lengths = get("lengths")
    k = ids.shape[1]
    lengths = np.full(teacher_len, k, np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (teacher_len,) or (teacher_len and (lengths.min() < 0 or lengths.max() > k)):
        raise CsdError(
            f"teacher top-k row {topk_row_id}: its entry counts (shape {lengths.shape}) are not {teacher_len} values "
            f"in [0, {k}]; the teacher shard is corrupted, re-run `csd-pipeline teacher-logits`."
        )
    # Entries beyond a position's count are padding (id -1, log-prob -inf): never candidates.
    logprobs = np.where(np.arange(k)[None, :] < lengths[:, None], logprobs, -np.inf)
    return TeacherTopkRow(topk_row_id, ids, logprobs, observed, 0, lengths)
