"""`teacher-logits --keep csd-events`: store only the top-k entries that the CSD loss turns into events.

The CSD loss (`events.row_events`) reads a teacher position's stored entries only where the position
is the final predictor of an accepted chunk (the position before the chunk's last teacher token),
and there only the candidates that fall into a student spelling class under the chunk's shape
(`EventContext.event_class`: 1:1 common spellings, 1:N / M:1 prefix completions, M:N the observed
spelling), plus the observed token. Every other entry only adds to REST, which the loss computes as
1 minus the events' mass, so it need not be stored: the CSD events built from the kept entries are
the events built from the whole top-k, to the bit.

`event_entry_mask` marks those entries of one row; `marked_first` moves them to the front of each
position (most likely first) and sets the row's entry counts. A position keeps at least its most
likely entry (the encoding stores n >= 1 entries): a position where nothing is read keeps just that.

What the store cannot serve any more: the baseline losses (ULD, GOLD, strict), which compare whole
next-token rows, and `csd-train --teacher-top-k`: the kept entries are not the most likely ones (not `exact`).
Recorded as `config.keep` = "csd-events" with the sha256 of the aligned tables (`config.tables_sha256`), and
the shard metadata `csd.keep`. It reads each row's aligned chunks, so it runs in the writer's scope, last.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import SHAPE_1_1, chunk_shape
from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks
from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.store.selectors import Selector


def event_entry_mask(aligned_row, teacher_index: int, ids: np.ndarray, lengths: np.ndarray, context) -> np.ndarray:
    """bool [T, k]: the entries of one row's teacher top-k (ids int [T, k], the first lengths[t] real)
    that the CSD loss turns into an event, spelling classes summed (a superset of what `--spelling
    exclude` reads). `aligned_row`: the row's aligned columns for `teacher_index`; context: the pair's
    `EventContext`."""
    row = read_aligned_chunks(aligned_row, teacher_index, context)
    ids = np.asarray(ids, dtype=np.int64)
    real = np.arange(ids.shape[1])[None, :] < np.asarray(lengths)[:, None]
    mask = np.zeros(ids.shape, dtype=bool)
    sb, tb, tsp = context.student_bytes, context.teacher_bytes, context.teacher_spelling
    common = context.teacher_common()
    inside = (ids >= 0) & (ids < len(common))
    for c in np.flatnonzero(row.status == ACCEPTED).tolist():
        m, n = int(row.student_len[c]), int(row.teacher_len[c])
        s0, t0 = int(row.student_start[c]), int(row.teacher_start[c])
        if m == 0 or n == 0 or s0 == 0 or t0 == 0:
            continue  # no predictor (or a corrupt chunk, which the trainer reports): nothing is read
        ft = t0 + n - 2  # the teacher position that predicts the chunk's final teacher token
        v_obs = int(row.teacher_ids[t0 + n - 1])
        candidates = ids[ft]
        observed = candidates == v_obs
        shape = chunk_shape(m, n)
        s_tok = row.student_ids[s0:s0 + m].tolist()
        if shape == SHAPE_1_1:
            if context.is_special_pair(s_tok[0], v_obs):
                mask[ft] = observed & real[ft]
                continue
            mask[ft] = (observed | (inside[ft] & common[np.where(inside[ft], candidates, 0)])) & real[ft]
            continue
        s_prefix = b"".join(sb[i] for i in s_tok[:-1])
        t_prefix = b"".join(tb[i] for i in row.teacher_ids[t0:t0 + n - 1].tolist())
        obs_spelling, u_obs = tsp[v_obs], s_tok[-1]
        found: dict[bytes | None, bool] = {}
        for j in np.flatnonzero(real[ft]).tolist():
            v = int(candidates[j])
            if v == v_obs:
                mask[ft, j] = True
                continue
            y = tsp[v] if 0 <= v < len(tsp) else None
            if y not in found:
                found[y] = context.event_class(shape, y, obs_spelling, s_prefix, t_prefix, u_obs) is not None
            mask[ft, j] = found[y]
    return mask


def marked_first(result: TeacherTopkRow, mask: np.ndarray) -> TeacherTopkRow:
    """`result` with only the `mask`ed entries of each position (at least its most likely one), in their
    order (most likely first); lengths count them. The left-out entries follow with log-prob -inf (and
    their own ids, so the encoder's checks hold): the encoder stores each position's `lengths` most
    likely entries, which are then exactly the kept ones."""
    ids, logprobs = result.ids, result.logprobs
    k = ids.shape[1]
    mask = mask & (np.arange(k)[None, :] < result.lengths[:, None])
    mask[mask.sum(axis=1) == 0, 0] = True  # the encoding stores n >= 1: the most likely entry
    order = np.argsort(~mask, axis=1, kind="stable")  # the kept ones first, each group in the given order
    lengths = mask.sum(axis=1).astype(np.int64)
    kept = np.arange(k)[None, :] < lengths[:, None]
    new_ids = np.take_along_axis(ids, order, axis=1)
    new_lp = np.where(kept, np.take_along_axis(logprobs, order, axis=1), -np.inf).astype(logprobs.dtype)
    return replace(result, ids=new_ids, logprobs=new_lp, lengths=lengths)


def event_selector(aligned_rows: list, teacher_index: int, context):
    """`select(row_index, TeacherTopkRow) -> TeacherTopkRow`: the event entries of each row of one shard
    (`aligned_rows`: its rows' aligned columns for `teacher_index`, in order; context: the pair's `EventContext`)."""

    def select(row_index: int, result: TeacherTopkRow) -> TeacherTopkRow:
        mask = event_entry_mask(aligned_rows[row_index], teacher_index, result.ids, result.lengths, context)
        return marked_first(result, mask)

    return select


@dataclass(frozen=True)
class CsdEvents(Selector):
    """Only the entries the CSD loss turns into events with the aligned tables (`tables`: the student->teacher
    and teacher->student table paths of teacher `teacher_index`, with their sha256)."""

    teacher_index: int
    tables_sha256: tuple = ()
    tables: tuple = field(default=(), compare=False)
    name = "csd-events"
    order = 50
    exact = False
    inexact = "keeps only the entries CSD turns into events (teacher-logits --keep csd-events)"
    reads_aligned = True

    @classmethod
    def check_options(cls, config) -> None:
        from csd_pipeline.teacher.config import KEEP_CHOICES

        if config.keep not in KEEP_CHOICES:
            raise CsdError(f"--keep {config.keep!r} is not one of {', '.join(KEEP_CHOICES)}; pass top-k (the default) "
                           "or csd-events.")

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> CsdEvents | None:
        if config.get("keep", "top-k") != "csd-events":
            return None
        index = int(config.get("teacher_index") or 0)
        if aligned is None:  # a store being read: what its manifest records
            return cls(index, tuple(config.get("tables_sha256") or ()))
        from csd_pipeline.runtime.files import file_sha256

        tables = tuple(str(path) for path in aligned.tables(index))
        return cls(index, tuple(file_sha256(path) for path in tables), tables)

    def identity(self) -> dict:
        return {"keep": self.name, "tables_sha256": list(self.tables_sha256)}

    def metadata(self) -> dict:
        return {b"csd.keep": self.name.encode()}

    def row_cut(self, aligned_rows: list):
        return event_selector(aligned_rows, self.teacher_index, self.event_context())

    def event_context(self):
        """The `EventContext` of the tables, built once per process (a copy sent to a worker builds its own)."""
        context = self.__dict__.get("_context")
        if context is None:
            from pathlib import Path

            from csd_pipeline.events.context import EventContext
            from csd_pipeline.vocab.tables import load_table

            s2t, t2s = self.tables
            context = EventContext(load_table(s2t), load_table(t2s), tables_name=str(Path(s2t).parent))
            object.__setattr__(self, "_context", context)
        return context

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_context"}
