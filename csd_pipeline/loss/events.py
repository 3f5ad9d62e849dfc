"""CSD events per chunk (SPEC §5), built on the CPU in data-loader workers.

For every accepted chunk of an aligned row this module lists, as flat numpy index arrays:

- the student's chain gathers: (position, token) of the chunk's fixed student prefix s_1..s_{M-1};
- the events: for each, its student final-token gathers (the spelling class of u_k at the final
  predictor position) and the teacher's log q_T(k) (chain factors + final-token class, float64);
- per chunk its shape (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N).

The loss (`loss.py`) then only gathers student log-probabilities at those pairs and sums them per
chunk. Event rules: 1:1 takes the common spellings; 1:N the prefix-support entries of the
student->teacher table keyed by the observed teacher prefix bytes; M:1 the mirror image with the
teacher->student table; M:N only the observed sequence. The observed pair is always an event.
With a teacher top-k only candidates in the stored top-k (plus the observed token) are explicit.
Ids sharing a spelling are summed into one event (`spelling="sum"`) or sent to REST
(`spelling="exclude"`, the observed event then keeps only the observed ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from math import isfinite
from typing import Any

import numpy as np

from csd_pipeline.errors import CsdError

ACCEPTED = 0  # schemas.aligned.ChunkStatus.ACCEPTED
SHAPE_1_1, SHAPE_1_N, SHAPE_M_1, SHAPE_M_N = 0, 1, 2, 3
SPELLING_MODES = ("sum", "exclude")

_INDEX_FIELDS = ("chain_pos", "chain_tok", "chain_chunk", "final_pos", "final_tok", "final_event", "event_chunk", "chunk_shape")


@dataclass
class BatchEvents:
    """Flat events of one row or one batch, for one teacher (numpy on CPU, torch after `.to`).

    chain_pos/chain_tok/chain_chunk: int64 [Gc] student chain gathers and their chunk.
    final_pos/final_tok/final_event: int64 [Gf] student final-token gathers and their event.
    event_chunk: int64 [E]; event_teacher_logq: float64 [E] teacher log q_T per event.
    chunk_shape: int64 [C] (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N).
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
    stats: dict = field(default_factory=dict)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_shape.shape[0])

    @property
    def num_events(self) -> int:
        return int(self.event_chunk.shape[0])

    def shape_counts(self) -> list[int]:
        """Accepted KD chunks per shape [1:1, 1:N, M:1, M:N] (computed on the CPU when possible)."""
        counts = self.stats.get("shape_counts")
        if counts is not None:
            return list(counts)
        shape = self.chunk_shape
        if not isinstance(shape, np.ndarray):
            shape = shape.cpu().numpy()
        return np.bincount(shape, minlength=4)[:4].tolist()

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


RowEvents = BatchEvents


def empty_events(stats: dict | None = None) -> BatchEvents:
    """Events with no chunks (a row without accepted chunks, or loss "ce")."""
    z = np.zeros(0, dtype=np.int64)
    return BatchEvents(z, z, z, z, z, z, z, np.zeros(0, dtype=np.float64), z, dict(stats or {}))


# ----------------------------------------------------------------------------------------------
# Per-teacher context: tables and vocabularies, turned into dictionaries once
# ----------------------------------------------------------------------------------------------


class EventContext:
    """Look-up structures for one (student, teacher) pair, built once per data-loader worker.

    s2t: student->teacher SubtokenTable; t2s: teacher->student table. student_vocab /
    teacher_vocab: the vocabularies of the data's tokenizers (default: the tables' own copies).
    Spelling classes, common spellings and prefix-support entries come from the tables.
    Raises CsdError when the two tables or the vocabularies have different fingerprints
    (tables of another tokenizer).
    """

    def __init__(self, s2t, t2s, student_vocab=None, teacher_vocab=None, *, tables_name: str = "tables"):
        student_vocab = s2t.source if student_vocab is None else student_vocab
        teacher_vocab = s2t.destination if teacher_vocab is None else teacher_vocab
        checks = (
            ("student->teacher", "student (source)", s2t.source_fingerprint, student_vocab),
            ("student->teacher", "teacher (destination)", s2t.destination_fingerprint, teacher_vocab),
            ("teacher->student", "teacher (source)", t2s.source_fingerprint, teacher_vocab),
            ("teacher->student", "student (destination)", t2s.destination_fingerprint, student_vocab),
        )
        for direction, side, fingerprint, vocab in checks:
            if fingerprint != vocab.fingerprint:
                raise CsdError(
                    f"the {direction} table in {tables_name} was built for another {side} tokenizer than "
                    f"{vocab.name} (fingerprint {str(fingerprint)[:12]} != {vocab.fingerprint[:12]}); "
                    "re-run `csd-pipeline tables build` and the align stage with these tokenizers."
                )
        self.s2t, self.t2s = s2t, t2s
        self.student_vocab, self.teacher_vocab = student_vocab, teacher_vocab
        self.student_bytes = s2t.source.token_bytes
        self.teacher_bytes = s2t.destination.token_bytes
        # Spelling -> ids (tuples of ints: per-chunk work is plain dictionary look-ups).
        self.student_classes: dict[bytes, tuple[int, ...]] = {
            k: tuple(int(i) for i in v) for k, v in s2t.source.spellings().items()
        }
        self.teacher_classes: dict[bytes, tuple[int, ...]] = {
            k: tuple(int(i) for i in v) for k, v in s2t.destination.spellings().items()
        }
        # Per teacher id: its spelling (None for specials / untrusted tokens: never a spelling).
        self.teacher_spelling: list[bytes | None] = [None] * len(self.teacher_bytes)
        for spelling, ids in self.teacher_classes.items():
            for i in ids:
                self.teacher_spelling[i] = spelling
        self._common_dense = None
        self._prefix_cache: dict[tuple[str, bytes], list] = {}
        self._student_special = s2t.source.is_special & ~s2t.source.untrusted
        self._teacher_special = s2t.destination.is_special & ~s2t.destination.untrusted

    def is_special_pair(self, u: int, v: int) -> bool:
        """Whether (student u, teacher v) are both special tokens (no bytes): chat mode's end-of-turn pair."""
        return bool(self._student_special[u] and self._teacher_special[v])

    def common_dense(self):
        """Common spellings of the student->teacher table as flat arrays (dense teachers only)."""
        if self._common_dense is None:
            spellings, s_ids, s_cls, t_ids, t_cls = [], [], [], [], []
            for k, spelling in enumerate(self.s2t.common_spellings()):
                a, b = self.student_classes[spelling], self.teacher_classes[spelling]
                spellings.append(spelling)
                s_ids.append(np.asarray(a, dtype=np.int64))
                s_cls.append(np.full(len(a), k, dtype=np.int64))
                t_ids.append(np.asarray(b, dtype=np.int64))
                t_cls.append(np.full(len(b), k, dtype=np.int64))
            cat = np.concatenate
            self._common_dense = (spellings, cat(s_ids), cat(s_cls), cat(t_ids), cat(t_cls))
        return self._common_dense

    def prefix_support(self, direction: str, prefix: bytes) -> list:
        key = (direction, prefix)
        if key not in self._prefix_cache:
            table = self.s2t if direction == "s2t" else self.t2s
            if len(self._prefix_cache) > 4096:
                self._prefix_cache.clear()
            self._prefix_cache[key] = list(table.prefix_support(prefix))
        return self._prefix_cache[key]


# ----------------------------------------------------------------------------------------------
# Teacher information of one row
# ----------------------------------------------------------------------------------------------


def _teacher_arrays(teacher, teacher_len: int, row_id: str):
    """(topk_ids, topk_logprobs, observed_logprob) or (None, dense, None) from the teacher input."""
    if isinstance(teacher, np.ndarray) or hasattr(teacher, "detach"):
        dense = np.asarray(teacher.detach().cpu().numpy() if hasattr(teacher, "detach") else teacher, dtype=np.float64)
        if dense.ndim != 2 or dense.shape[0] != teacher_len:
            raise CsdError(
                f"row {row_id}: dense teacher log-probs have shape {dense.shape}, expected [{teacher_len}, V]; "
                "they were computed for another alignment."
            )
        return None, dense, None
    get = teacher.get if isinstance(teacher, dict) else lambda k: getattr(teacher, k)
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
    return ids, logprobs, observed


def _logsumexp(values) -> float:
    if len(values) == 1:
        return float(values[0])
    arr = np.asarray(values, dtype=np.float64)
    peak = arr.max()
    return float(peak + np.log(np.exp(arr - peak).sum()))


# ----------------------------------------------------------------------------------------------
# Events of one row
# ----------------------------------------------------------------------------------------------


def _row_get(row, key):
    if isinstance(row, dict):
        if key not in row:
            raise CsdError(f"aligned row has no column {key!r}; re-run the align stage with this teacher.")
        return row[key]
    return getattr(row, key)


def build_row_events(
    aligned_row,
    teacher_index: int,
    teacher,
    context: EventContext,
    *,
    spelling: str = "sum",
    only_1to1: bool = False,
    source: str = "",
) -> BatchEvents:
    """Events of every accepted chunk of one aligned row for teacher `teacher_index`.

    aligned_row: a mapping with the aligned columns (SPEC §8): row_id, student_ids,
    teacher{i}_ids, teacher{i}_chunk_student_len / _teacher_len / _status. teacher: that row's
    teacher top-k (`TeacherTopkRow` or a dict with row_id, ids [T,k], logprobs [T,k],
    observed_logprob [T]) or dense teacher log-probs [T, V] (tests). context: the `EventContext`
    of this teacher. Positions in the result are row-local (student position j-1 predicts token j).
    source: a file name for error messages. Raises CsdError for a row that contradicts the tables
    or the teacher shard (naming the row and the stage to re-run).
    """
    if spelling not in SPELLING_MODES:
        raise CsdError(f"unknown spelling mode {spelling!r}; choose 'sum' or 'exclude' (loss.spelling).")
    row_id = _row_get(aligned_row, "row_id") if not isinstance(aligned_row, dict) or "row_id" in aligned_row else None
    where = f"row {row_id}" + (f" of {source}" if source else "")
    prefix = f"teacher{teacher_index}_"
    student_ids = np.asarray(_row_get(aligned_row, "student_ids"), dtype=np.int64)
    teacher_ids = np.asarray(_row_get(aligned_row, prefix + "ids"), dtype=np.int64)
    m_len = np.asarray(_row_get(aligned_row, prefix + "chunk_student_len"), dtype=np.int64)
    n_len = np.asarray(_row_get(aligned_row, prefix + "chunk_teacher_len"), dtype=np.int64)
    status = np.asarray(_row_get(aligned_row, prefix + "chunk_status"), dtype=np.int64)
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
    teacher_status = teacher.get("status", 0) if isinstance(teacher, dict) else getattr(teacher, "status", 0)
    if teacher_status:
        # A row the teacher-logits stage rejected (non-finite log-probs): CE only, no KD events.
        return empty_events({"rows_teacher_rejected": 1})
    topk_ids, teacher_lp, observed = _teacher_arrays(teacher, len(teacher_ids), row_id)
    dense = topk_ids is None
    if dense:
        observed = np.full(len(teacher_ids), np.nan)
        observed[:-1] = teacher_lp[np.arange(len(teacher_ids) - 1), teacher_ids[1:]]

    builder = _RowBuilder(context, spelling, where)
    s_starts = np.concatenate([[0], np.cumsum(m_len)[:-1]]) if m_len.size else m_len
    t_starts = np.concatenate([[0], np.cumsum(n_len)[:-1]]) if n_len.size else n_len
    stats = {"chunks_not_accepted": 0, "chunks_no_predictor": 0, "chunks_not_1to1": 0, "chunks_special_pair": 0}
    sb, tb = context.student_bytes, context.teacher_bytes
    for c in np.flatnonzero(status == ACCEPTED).tolist():
        m, n, s0, t0 = int(m_len[c]), int(n_len[c]), int(s_starts[c]), int(t_starts[c])
        if m == 0 or n == 0:
            raise CsdError(
                f"{where}: accepted chunk {c} has {m} student and {n} teacher tokens; an accepted chunk needs "
                "both sides, the aligned shard is corrupted, re-run the align stage."
            )
        if s0 == 0 or t0 == 0:
            stats["chunks_no_predictor"] += 1
            continue
        shape = SHAPE_1_1 if m == 1 and n == 1 else SHAPE_1_N if m == 1 else SHAPE_M_1 if n == 1 else SHAPE_M_N
        if only_1to1 and shape != SHAPE_1_1:
            stats["chunks_not_1to1"] += 1
            continue
        s_tok = student_ids[s0 : s0 + m].tolist()
        t_tok = teacher_ids[t0 : t0 + n].tolist()
        if shape == SHAPE_1_1 and context.is_special_pair(s_tok[0], t_tok[0]):
            # Chat mode's end-of-turn pair: no byte spelling, so the only explicit event is the observed
            # pair; everything else is REST on both sides.
            obs_lp = teacher_lp[t0 - 1, t_tok[0]] if dense else observed[t0 - 1]
            if not np.isfinite(obs_lp):
                raise CsdError(
                    f"{where}: the teacher log-probability of the special token of accepted chunk {c} is not "
                    "finite; the teacher shard is corrupted, re-run `csd-pipeline teacher-logits`."
                )
            chunk = builder.start_chunk(shape, [])
            builder._add_event(chunk, s0 - 1, np.asarray([s_tok[0]], dtype=np.int64), float(obs_lp))
            stats["chunks_special_pair"] += 1
            continue
        s_prefix = b"".join(sb[i] for i in s_tok[:-1])
        t_prefix = b"".join(tb[i] for i in t_tok[:-1])
        u_obs, v_obs = s_tok[-1], t_tok[-1]
        if s_prefix + sb[u_obs] != t_prefix + tb[v_obs] or not sb[u_obs] or not tb[v_obs]:
            raise CsdError(
                f"{where}: accepted chunk {c} (student tokens {s0}..{s0 + m - 1}, teacher tokens {t0}..{t0 + n - 1}) "
                f"spells {s_prefix + sb[u_obs]!r} on the student side but {t_prefix + tb[v_obs]!r} on the teacher "
                "side; the aligned shard does not match these tokenizers/tables, re-run the align stage."
            )
        ft = t0 + n - 2
        chain_lp = observed[t0 - 1 : ft]
        obs_lp = observed[ft]
        if not (np.isfinite(chain_lp).all() and np.isfinite(obs_lp)):
            raise CsdError(
                f"{where}: the teacher log-probability of a token of accepted chunk {c} is not finite; the teacher "
                "shard is corrupted, re-run `csd-pipeline teacher-logits`."
            )
        teacher_chain = float(chain_lp.sum())
        chunk = builder.start_chunk(shape, [(s0 - 1 + r, s_tok[r]) for r in range(m - 1)])
        fs = s0 + m - 2
        if dense:
            builder.dense_events(chunk, shape, fs, teacher_lp[ft], teacher_chain, s_prefix, t_prefix, u_obs, v_obs)
        else:
            builder.topk_events(
                chunk, shape, fs, topk_ids[ft], teacher_lp[ft], obs_lp, teacher_chain, s_prefix, t_prefix, u_obs, v_obs
            )
    stats["chunks_not_accepted"] = int(np.count_nonzero(status != ACCEPTED))
    return builder.finish(stats)


class _RowBuilder:
    """Accumulates one row's events as Python lists, then converts them to arrays once."""

    def __init__(self, context: EventContext, spelling: str, where: str):
        self.ctx = context
        self.exclude = spelling == "exclude"
        self.where = where
        self.chain_pos: list[int] = []
        self.chain_tok: list[int] = []
        self.chain_chunk: list[int] = []
        self.final_pos: list[int] = []
        self.final_tok: list[int] = []
        self.final_event: list[int] = []
        self.event_chunk: list[int] = []
        self.event_logq: list[float] = []
        self.chunk_shape: list[int] = []

    def start_chunk(self, shape: int, chain: list[tuple[int, int]]) -> int:
        c = len(self.chunk_shape)
        self.chunk_shape.append(shape)
        for pos, tok in chain:
            self.chain_pos.append(pos)
            self.chain_tok.append(tok)
            self.chain_chunk.append(c)
        return c

    def _add_event(self, chunk: int, pos: int, student_ids, teacher_logq: float) -> None:
        e = len(self.event_chunk)
        self.event_chunk.append(chunk)
        self.event_logq.append(teacher_logq)
        if len(student_ids) == 1:
            self.final_pos.append(pos)
            self.final_tok.append(int(student_ids[0]))
            self.final_event.append(e)
        else:
            n = len(student_ids)
            self.final_pos.extend([pos] * n)
            self.final_tok.extend(int(i) for i in student_ids)
            self.final_event.extend([e] * n)

    def _student_class_for(self, shape: int, teacher_spelling: bytes, s_prefix: bytes, t_prefix: bytes):
        """Student final spelling paired with a teacher final spelling, or None (not an event)."""
        if shape == SHAPE_1_1:
            return teacher_spelling
        if shape == SHAPE_1_N:
            return t_prefix + teacher_spelling
        # M:1: the teacher's token spells the student prefix + one student token.
        if len(teacher_spelling) > len(s_prefix) and teacher_spelling.startswith(s_prefix):
            return teacher_spelling[len(s_prefix) :]
        return None

    def _observed_error(self, chunk_index: int) -> CsdError:
        return CsdError(
            f"{self.where}: the observed pair of a chunk (KD chunk {chunk_index}) is not an event of the tables; "
            "the tables do not match the tokenizers of the data, re-run `csd-pipeline tables build` and align."
        )

    def topk_events(self, chunk, shape, pos, cand_ids, cand_lp, obs_lp, chain, s_prefix, t_prefix, u_obs, v_obs):
        ctx = self.ctx
        tsp = ctx.teacher_spelling
        obs_spelling = tsp[v_obs]
        groups: dict[bytes, list[float]] = {}
        seen_obs = False
        n_teacher = len(tsp)
        for v, lp in zip(cand_ids.tolist(), cand_lp.tolist()):
            if v == v_obs:
                seen_obs = True
                lp = obs_lp = lp if isfinite(lp) else obs_lp
            elif not isfinite(lp):
                continue  # padding of a short top-k row
            y = tsp[v] if 0 <= v < n_teacher else None
            if y is None or (shape == SHAPE_M_N and y != obs_spelling):
                continue
            groups.setdefault(y, []).append(lp)
        if not seen_obs:
            groups.setdefault(obs_spelling, []).append(obs_lp)
        found_obs = False
        for y, lps in groups.items():
            is_obs = y == obs_spelling
            if shape == SHAPE_M_N:
                x = ctx.student_bytes[u_obs]
            else:
                x = self._student_class_for(shape, y, s_prefix, t_prefix)
                if x is None:
                    continue
            s_ids = ctx.student_classes.get(x)
            if s_ids is None:
                continue
            if self.exclude and (len(s_ids) > 1 or len(ctx.teacher_classes[y]) > 1):
                if not is_obs:
                    continue
                s_ids = (u_obs,)
                lps = [obs_lp]
            if is_obs:
                if u_obs not in s_ids:
                    raise self._observed_error(chunk)
                found_obs = True
            self._add_event(chunk, pos, s_ids, chain + _logsumexp(lps))
        if not found_obs:
            raise self._observed_error(chunk)

    def dense_events(self, chunk, shape, pos, teacher_row, chain, s_prefix, t_prefix, u_obs, v_obs):
        ctx = self.ctx
        sb, tb = ctx.student_bytes, ctx.teacher_bytes
        obs_pair = (sb[u_obs], tb[v_obs])
        if shape == SHAPE_1_1:
            self._dense_common_events(chunk, pos, teacher_row, chain, u_obs, v_obs)
            return
        if shape == SHAPE_1_N:
            pairs = ctx.prefix_support("s2t", t_prefix)
        elif shape == SHAPE_M_1:
            pairs = [(b, a) for a, b in ctx.prefix_support("t2s", s_prefix)]
        else:
            pairs = [obs_pair]
        found_obs = False
        for x, y in pairs:
            s_ids, t_ids = ctx.student_classes.get(x), ctx.teacher_classes.get(y)
            if s_ids is None or t_ids is None:
                continue
            is_obs = (x, y) == obs_pair
            if self.exclude and (len(s_ids) > 1 or len(t_ids) > 1):
                if not is_obs:
                    continue
                s_ids = (u_obs,)
                t_ids = (v_obs,)
            if is_obs:
                if u_obs not in s_ids or v_obs not in t_ids:
                    raise self._observed_error(chunk)
                found_obs = True
            self._add_event(chunk, pos, s_ids, chain + _logsumexp(teacher_row[np.asarray(t_ids)]))
        if not found_obs:
            raise self._observed_error(chunk)

    def _dense_common_events(self, chunk, pos, teacher_row, chain, u_obs, v_obs):
        """1:1 chunk with a dense teacher: every common spelling is an event (vectorised)."""
        spellings, s_ids, s_cls, t_ids, t_cls = self.ctx.common_dense()
        n_cls = len(spellings)
        obs = self.ctx.teacher_spelling[v_obs]
        hit = np.flatnonzero(t_ids == v_obs)
        obs_k = int(t_cls[hit[0]]) if hit.size else None
        if obs_k is None or spellings[obs_k] != obs or u_obs not in s_ids[s_cls == obs_k]:
            raise self._observed_error(chunk)
        s_size = np.bincount(s_cls, minlength=n_cls)
        t_size = np.bincount(t_cls, minlength=n_cls)
        keep = np.ones(n_cls, dtype=bool) if not self.exclude else (s_size == 1) & (t_size == 1)
        keep[obs_k] = True
        values = teacher_row[t_ids]
        peak = np.full(n_cls, -np.inf)
        np.maximum.at(peak, t_cls, values)
        total = np.zeros(n_cls)
        np.add.at(total, t_cls, np.exp(values - peak[t_cls]))
        logq = chain + peak + np.log(total)
        s_keep_ids, s_keep_cls = s_ids, s_cls
        if self.exclude and (s_size[obs_k] > 1 or t_size[obs_k] > 1):
            logq[obs_k] = chain + float(teacher_row[v_obs])
            in_obs = s_cls == obs_k
            s_keep_ids = np.concatenate([s_ids[~in_obs], [u_obs]])
            s_keep_cls = np.concatenate([s_cls[~in_obs], [obs_k]])
        kept = np.flatnonzero(keep)
        event_of_class = np.full(n_cls, -1, dtype=np.int64)
        base = len(self.event_chunk)
        event_of_class[kept] = base + np.arange(kept.size)
        sel = keep[s_keep_cls]
        self.event_chunk.extend([chunk] * kept.size)
        self.event_logq.extend(logq[kept].tolist())
        self.final_tok.extend(s_keep_ids[sel].tolist())
        self.final_event.extend(event_of_class[s_keep_cls[sel]].tolist())
        self.final_pos.extend([pos] * int(sel.sum()))

    def finish(self, stats: dict) -> BatchEvents:
        def ints(values):
            return np.asarray(values, dtype=np.int64)

        return BatchEvents(
            chain_pos=ints(self.chain_pos),
            chain_tok=ints(self.chain_tok),
            chain_chunk=ints(self.chain_chunk),
            final_pos=ints(self.final_pos),
            final_tok=ints(self.final_tok),
            final_event=ints(self.final_event),
            event_chunk=ints(self.event_chunk),
            event_teacher_logq=np.asarray(self.event_logq, dtype=np.float64),
            chunk_shape=ints(self.chunk_shape),
            stats=stats,
        )


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------


def collate_events(rows: list[BatchEvents], row_offsets) -> BatchEvents:
    """Concatenate row events into one batch; row i's positions are shifted by row_offsets[i].

    row_offsets: the flat position of each row's first token in the student hidden states
    ([B*T] padded or packed). Chunk and event indices are renumbered. Stats are summed.
    """
    offsets = [int(o) for o in row_offsets]
    if len(offsets) != len(rows):
        raise CsdError(f"collate_events got {len(rows)} rows but {len(offsets)} row offsets; give one per row.")
    if not rows:
        return empty_events()
    parts: dict[str, list] = {name: [] for name in _INDEX_FIELDS}
    parts["event_teacher_logq"] = []
    stats: dict = {}
    n_chunks = n_events = 0
    for ev, off in zip(rows, offsets):
        parts["chain_pos"].append(ev.chain_pos + off)
        parts["chain_tok"].append(ev.chain_tok)
        parts["chain_chunk"].append(ev.chain_chunk + n_chunks)
        parts["final_pos"].append(ev.final_pos + off)
        parts["final_tok"].append(ev.final_tok)
        parts["final_event"].append(ev.final_event + n_events)
        parts["event_chunk"].append(ev.event_chunk + n_chunks)
        parts["event_teacher_logq"].append(ev.event_teacher_logq)
        parts["chunk_shape"].append(ev.chunk_shape)
        n_chunks += ev.num_chunks
        n_events += ev.num_events
        for key, value in ev.stats.items():
            if isinstance(value, int | float):
                stats[key] = stats.get(key, 0) + value
    stats["rows"] = len(rows)
    return BatchEvents(**{k: np.concatenate(v) for k, v in parts.items()}, stats=stats)


def ce_targets(student_ids_rows, loss_mask_rows, row_offsets) -> tuple[np.ndarray, np.ndarray]:
    """Flat CE targets (positions, tokens): position p predicts token p+1 where mask[p+1] is true."""
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
