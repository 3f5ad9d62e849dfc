"""What the baseline losses (`loss.baselines`: ULD, GOLD, strict) read of each chunk, built on the CPU.

CSD turns the teacher's stored top-k into chunk events through the tables (`events.batch`). The
baselines compare whole next-token rows instead, so for every accepted chunk of an aligned row
this module keeps (as flat numpy arrays, like `BatchEvents`):

- the student's final predictor position (the position before its last token of the chunk) and its
  chain gathers, the student's own tokens s_1..s_{M-1} of the chunk;
- the teacher's chain log-probability, the sum of the observed log-probs of t_1..t_{N-1};
- the teacher's explicit entries at the chunk's final predictor position: the stored top-k plus the
  observed final token (as for CSD), sorted by log-probability, each with its shared spelling class
  (-1 when no student token has the same bytes), padded with -inf / -1 to one width per batch;
- the same entries grouped by shared class (log of the summed probability, how many explicit ids),
  and the log-probs of the entries without a shared class, sorted;
- once per teacher: the student ids of every shared class, the shared class of every teacher id,
  the number of teacher ids in each class and the teacher's vocabulary size.

Shared spelling classes are the common spellings of the student->teacher table (bytes that both
vocabularies can emit as one token; ids with equal bytes form one class, as `spelling="sum"`).

`shuffle_teacher_rows` builds the control arm `--teacher-control shuffled`: the same stored rows,
given to other positions of the batch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import SHAPE_1_1, ChunkShapeCounts, chunk_shape, stack_chunk_rows
from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks, teacher_positions

BASELINE_LOSSES = ("uld", "gold", "strict")
TEACHER_CONTROLS = ("none", "shuffled")


@dataclass
class SharedVocabulary:
    """The shared spelling classes of one (student, teacher) pair.

    class_student_ids: int64 [K, L], the student ids of each class (-1 padding); teacher_class: int64
    [Vt], the class of each teacher id (-1: none); class_teacher_size: int64 [K], teacher ids per
    class; teacher_vocab_size: Vt.
    """

    class_student_ids: Any
    teacher_class: Any
    class_teacher_size: Any
    teacher_vocab_size: int

    @property
    def num_classes(self) -> int:
        return int(self.class_teacher_size.shape[0])


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_vocabulary(context) -> SharedVocabulary:
    """The `SharedVocabulary` of an `EventContext` (built once per context)."""
    if context not in _SHARED:
        spellings, s_ids, s_cls, t_ids, t_cls = context.common_dense()
        order = np.argsort(s_cls, kind="stable")
        s_ids, s_cls = s_ids[order], s_cls[order]
        rank = np.arange(len(s_cls)) - np.searchsorted(s_cls, s_cls)  # position of the id within its class
        class_student_ids = np.full((len(spellings), int(rank.max(initial=0)) + 1), -1, dtype=np.int64)
        class_student_ids[s_cls, rank] = s_ids
        teacher_class = np.full(context.teacher_vocab.size, -1, dtype=np.int64)
        teacher_class[t_ids] = t_cls
        sizes = np.bincount(t_cls, minlength=len(spellings)).astype(np.int64)
        _SHARED[context] = SharedVocabulary(class_student_ids, teacher_class, sizes, int(context.teacher_vocab.size))
    return _SHARED[context]


@dataclass
class BaselineRows(ChunkShapeCounts):
    """Per accepted chunk of a row or batch, what the baseline losses read (numpy; torch after `.to`).

    final_pos: int64 [C]; chunk_shape: int64 [C] (0 = 1:1, 1 = 1:N, 2 = M:1, 3 = M:N);
    chain_pos/chain_tok/chain_chunk: int64 [Gc]; teacher_chain_logp: float64 [C];
    teacher_logp: float64 [C, W] explicit entries, descending, -inf padding; teacher_class: int64 [C, W]
    (-1: no shared class, or padding); class_id / class_logp / class_count: [C, W2] the explicit entries
    grouped by shared class (-1 / -inf / 0 padding); unshared_logp: float64 [C, W3] the explicit entries
    without a shared class, descending; shared: the pair's `SharedVocabulary`; stats: counters.
    """

    final_pos: Any
    chunk_shape: Any
    chain_pos: Any
    chain_tok: Any
    chain_chunk: Any
    teacher_chain_logp: Any
    teacher_logp: Any
    teacher_class: Any
    class_id: Any
    class_logp: Any
    class_count: Any
    unshared_logp: Any
    shared: SharedVocabulary
    stats: dict = field(default_factory=dict)

    def to(self, device) -> BaselineRows:
        """The same rows as torch tensors on `device` (log-probs stay float64)."""
        import torch

        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "stats":
                out[f.name] = dict(value, shape_counts=self.shape_counts())
            elif f.name == "shared":
                out[f.name] = SharedVocabulary(
                    *(torch.as_tensor(getattr(value, k)).to(device) for k in ("class_student_ids", "teacher_class",
                                                                            "class_teacher_size")),
                    int(value.teacher_vocab_size))
            else:
                out[f.name] = torch.as_tensor(value).to(device)
        return BaselineRows(**out)


_PADDED = {"teacher_logp": -np.inf, "teacher_class": -1, "class_id": -1, "class_logp": -np.inf, "class_count": 0,
           "unshared_logp": -np.inf}


def _empty(shared: SharedVocabulary, stats: dict | None = None) -> BaselineRows:
    z = np.zeros(0, dtype=np.int64)
    padded = {k: np.zeros((0, 0), dtype=np.int64 if isinstance(v, int) else np.float64) for k, v in _PADDED.items()}
    return BaselineRows(z, z, z, z, z, np.zeros(0), **padded, shared=shared, stats=dict(stats or {}))


def build_baseline_rows(aligned_row, teacher_index: int, teacher, context, *, only_1to1: bool = False,
                        source: str = "") -> BaselineRows:
    """The `BaselineRows` of every accepted chunk of one aligned row for teacher `teacher_index`.

    aligned_row: the aligned columns (SPEC §8); teacher: that row's stored top-k (`TeacherTopkRow` or a
    dict with row_id, ids [T,k], logprobs [T,k], observed_logprob [T]); context: the pair's
    `EventContext`. only_1to1 keeps only 1:1 chunks (the strict loss). Chunks without a predictor on
    either side are skipped and counted. Raises CsdError for a row that contradicts the tables or the
    teacher shard, naming the stage to re-run.
    """
    shared = shared_vocabulary(context)
    row = read_aligned_chunks(aligned_row, teacher_index, context, source)
    where, student_ids, teacher_ids = row.where, row.student_ids, row.teacher_ids
    m_len, n_len, status, s_starts, t_starts = (row.student_len, row.teacher_len, row.status, row.student_start,
                                                row.teacher_start)
    teacher_status = teacher.get("status", 0) if isinstance(teacher, dict) else getattr(teacher, "status", 0)
    if teacher_status:
        return _empty(shared, {"rows_teacher_rejected": 1})
    positions = teacher_positions(teacher, row)
    topk_ids, topk_lp, observed = positions.ids, positions.logprobs, positions.observed_logprob
    if positions.dense:
        raise CsdError(f"{where}: the baseline losses read the teacher's stored top-k, not dense log-probs; "
                       "pass the output of `csd-pipeline teacher-logits`.")
    sb, tb = context.student_bytes, context.teacher_bytes
    out = {k: [] for k in ("final_pos", "chunk_shape", "teacher_chain_logp", "entries", "classes", "chain", "class_id",
                           "class_logp", "class_count", "unshared")}
    stats = {"chunks_not_accepted": int(np.count_nonzero(status != ACCEPTED)), "chunks_no_predictor": 0,
             "chunks_not_1to1": 0}
    for c in np.flatnonzero(status == ACCEPTED).tolist():
        m, n, s0, t0 = int(m_len[c]), int(n_len[c]), int(s_starts[c]), int(t_starts[c])
        if m == 0 or n == 0:
            raise CsdError(f"{where}: accepted chunk {c} has {m} student and {n} teacher tokens; the aligned shard "
                           "is corrupted, re-run the align stage.")
        if s0 == 0 or t0 == 0:
            stats["chunks_no_predictor"] += 1
            continue
        shape = chunk_shape(m, n)
        if only_1to1 and shape != SHAPE_1_1:
            stats["chunks_not_1to1"] += 1
            continue
        s_tok, t_tok = student_ids[s0:s0 + m].tolist(), teacher_ids[t0:t0 + n].tolist()
        special = shape == SHAPE_1_1 and context.is_special_pair(s_tok[0], t_tok[0])
        if not special and b"".join(sb[i] for i in s_tok) != b"".join(tb[i] for i in t_tok):
            raise CsdError(f"{where}: accepted chunk {c} spells different bytes on the student and teacher sides; "
                           "the aligned shard does not match these tokenizers/tables, re-run the align stage.")
        ft = t0 + n - 2
        lps = observed[t0 - 1:ft + 1]
        if not np.isfinite(lps).all():
            raise CsdError(f"{where}: the teacher log-probability of a token of accepted chunk {c} is not finite; "
                           "the teacher shard is corrupted, re-run `csd-pipeline teacher-logits`.")
        stored = int(positions.lengths[ft])  # a variable-length row (--top-p) stores fewer than k entries here
        ids, values = topk_ids[ft, :stored], topk_lp[ft, :stored]
        keep = np.isfinite(values)
        ids, values = ids[keep], values[keep]
        if t_tok[-1] not in ids:
            ids, values = np.append(ids, t_tok[-1]), np.append(values, lps[-1])
        order = np.argsort(-values, kind="stable")
        ids, values = ids[order], values[order]
        inside = (ids >= 0) & (ids < len(shared.teacher_class))
        classes = np.where(inside, shared.teacher_class[np.clip(ids, 0, len(shared.teacher_class) - 1)], -1)
        out["classes"].append(classes)
        out["entries"].append(values)
        grouped = _by_class(values, classes)
        for key, value in zip(("class_id", "class_logp", "class_count"), grouped, strict=True):
            out[key].append(value)
        out["unshared"].append(values[classes < 0])
        out["final_pos"].append(s0 + m - 2)
        out["chunk_shape"].append(shape)
        out["teacher_chain_logp"].append(float(lps[:-1].sum()))
        out["chain"].extend((s0 - 1 + r, s_tok[r], len(out["final_pos"]) - 1) for r in range(m - 1))
    return _finish(out, shared, stats)


def _by_class(values: np.ndarray, classes: np.ndarray):
    """(class ids, log of their summed probabilities, explicit ids per class) of the entries with a shared class."""
    shared_entries = classes >= 0
    ids, inverse, counts = np.unique(classes[shared_entries], return_inverse=True, return_counts=True)
    logp = np.full(len(ids), -np.inf)
    np.logaddexp.at(logp, inverse, values[shared_entries])
    return ids, logp, counts


def _pad(parts: list, fill, dtype) -> np.ndarray:
    width = max((len(p) for p in parts), default=0)
    out = np.full((len(parts), width), fill, dtype=dtype)
    for i, p in enumerate(parts):
        out[i, :len(p)] = p
    return out


def _finish(out: dict, shared: SharedVocabulary, stats: dict) -> BaselineRows:
    chain = np.asarray(out["chain"], dtype=np.int64).reshape(-1, 3)
    return BaselineRows(
        final_pos=np.asarray(out["final_pos"], dtype=np.int64),
        chunk_shape=np.asarray(out["chunk_shape"], dtype=np.int64),
        chain_pos=chain[:, 0].copy(), chain_tok=chain[:, 1].copy(), chain_chunk=chain[:, 2].copy(),
        teacher_chain_logp=np.asarray(out["teacher_chain_logp"], dtype=np.float64),
        teacher_logp=_pad(out["entries"], -np.inf, np.float64),
        teacher_class=_pad(out["classes"], -1, np.int64),
        class_id=_pad(out["class_id"], -1, np.int64),
        class_logp=_pad(out["class_logp"], -np.inf, np.float64),
        class_count=_pad(out["class_count"], 0, np.int64),
        unshared_logp=_pad(out["unshared"], -np.inf, np.float64),
        shared=shared, stats=stats,
    )


def collate_baseline_rows(rows: list[BaselineRows], row_offsets) -> BaselineRows:
    """Concatenate row `BaselineRows` into one batch; row i's positions are shifted by row_offsets[i]."""
    offsets, chain_chunk, stats = stack_chunk_rows(rows, row_offsets, "collate_baseline_rows")
    cat = np.concatenate
    padded = {}
    for key, fill in _PADDED.items():
        parts = [getattr(r, key) for r in rows]
        width = max(p.shape[1] for p in parts)
        padded[key] = cat([np.pad(p, ((0, 0), (0, width - p.shape[1])), constant_values=fill) for p in parts])
    return BaselineRows(
        final_pos=cat([r.final_pos + o for r, o in zip(rows, offsets, strict=True)]),
        chunk_shape=cat([r.chunk_shape for r in rows]),
        chain_pos=cat([r.chain_pos + o for r, o in zip(rows, offsets, strict=True)]),
        chain_tok=cat([r.chain_tok for r in rows]),
        chain_chunk=cat(chain_chunk),
        teacher_chain_logp=cat([r.teacher_chain_logp for r in rows]),
        **padded,
        shared=rows[0].shared, stats=stats,
    )


# ----------------------------------------------------------------------------------------------
# The control arm


def shuffle_teacher_rows(rows: list, rng) -> list:
    """The batch's stored teacher values, each position's given to another position of the batch.

    rows: one teacher top-k row per window of the micro-batch (`TeacherTopkRow` or dict). A position's
    stored values (top-k ids, their log-probs, their count and the observed log-prob, together) move to another
    position, over every window of the batch, by a random cyclic derangement (`rng`, a numpy
    Generator): no position keeps its own values, and every stored row is used once, so the entropy
    and mass of the teacher's rows are kept while their link to the text is broken. Only positions
    with a finite observed log-prob take part (a window's last position has none); rejected rows are
    left as they are. Returns new rows.
    """
    def get(row, key):
        return row[key] if isinstance(row, dict) else getattr(row, key)

    def ok(row) -> bool:
        return (row.get("status", 0) if isinstance(row, dict) else getattr(row, "status", 0)) == 0

    def lengths(row):  # entries stored per position: all k unless the row says (--top-p)
        counts = row.get("lengths") if isinstance(row, dict) else getattr(row, "lengths", None)
        ids = np.asarray(get(row, "ids"))
        return np.full(ids.shape[0], ids.shape[1], np.int64) if counts is None else np.array(counts, np.int64)

    arrays = {r: (*(np.array(get(row, k)) for k in ("ids", "logprobs", "observed_logprob")), lengths(row))
              for r, row in enumerate(rows) if ok(row)}
    slots = [(r, j) for r, (_, _, obs, _) in arrays.items() for j in np.flatnonzero(np.isfinite(obs)).tolist()]
    if len(slots) < 2:
        return list(rows)
    order = rng.permutation(len(slots))
    source = {slots[order[i]]: slots[order[(i + 1) % len(slots)]] for i in range(len(slots))}
    width = max(a[0].shape[1] for a in arrays.values())
    new = {}
    for r, (ids, lps, obs, counts) in arrays.items():  # positions that do not take part keep their own values
        new[r] = (np.full((len(ids), width), -1, ids.dtype), np.full((len(ids), width), -np.inf, lps.dtype), obs.copy(),
                  counts.copy())
        new[r][0][:, :ids.shape[1]] = ids
        new[r][1][:, :ids.shape[1]] = lps
    for (r, j), (sr, sj) in source.items():
        ids, lps, obs, counts = arrays[sr]
        new[r][0][j] = -1
        new[r][1][j] = -np.inf
        new[r][0][j, :ids.shape[1]] = ids[sj]
        new[r][1][j, :ids.shape[1]] = lps[sj]
        new[r][2][j] = obs[sj]
        new[r][3][j] = counts[sj]
    out = []
    for r, row in enumerate(rows):
        if r not in new:
            out.append(row)
            continue
        values = dict(zip(("ids", "logprobs", "observed_logprob", "lengths"), new[r], strict=True))
        out.append(dict(row, **values) if isinstance(row, dict) else replace(row, **values))
    return out
