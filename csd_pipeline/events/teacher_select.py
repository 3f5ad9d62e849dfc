"""Per-chunk teacher selection (`csd-train --kd-combine select`): one teacher per group of chunks.

Each teacher's chunks of one aligned row partition the row's student tokens. A *group* is the span
between two consecutive student token boundaries that are chunk boundaries of every active teacher
(a byte position where every teacher's chunking meets); each teacher's chunks fall inside groups.
In each group the teachers whose KD chunks (accepted, with events) cover the whole group are
eligible, and the one that gives the group's observed text the highest log-probability (the sum of
`BatchEvents.chunk_teacher_loglik` over its chunks in the group: the same bytes for every teacher,
so comparable) is chosen, ties to the lower teacher index. When no teacher covers the group, the
teacher whose KD chunks cover most of its student tokens is chosen (ties: the higher log-probability,
then the lower index). Only the chosen teacher's chunks of a group are kept; the KD term is then
the sum of the kept chunks' divergences over all teachers divided by the number of kept chunks
(docs/LOSSES.md).

`select_row` applies the rule to one row's events (one `BatchEvents` per teacher, row-local); the
data loader (`trainer/loader.py`) calls it for every window before `collate_events`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import BatchEvents
from schemas.aligned import teacher_columns


def chunk_boundaries(aligned_row, teacher_index: int) -> np.ndarray:
    """The student token boundaries of teacher `teacher_index`'s chunks in one aligned row: 0, the end
    of every chunk (the row's length last), as int64."""
    column = teacher_columns(teacher_index)[1]
    lengths = np.asarray(aligned_row[column] if isinstance(aligned_row, dict) else getattr(aligned_row, column),
                         dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def group_edges(boundaries: list[np.ndarray]) -> np.ndarray:
    """The boundaries common to every teacher (sorted, unique): group g spans [edges[g], edges[g+1])."""
    if not boundaries:
        raise CsdError("teacher selection needs at least one teacher's chunks; pass --teacher-logits")
    ends = {int(b[-1]) for b in boundaries}
    if len(ends) != 1:
        raise CsdError(f"the teachers' chunks of one row cover {sorted(ends)} student tokens; they must cover the "
                       "same row: re-run the align stage")
    common = np.unique(boundaries[0])
    for b in boundaries[1:]:
        common = np.intersect1d(common, b)
    return common


def choose_teachers(coverage: np.ndarray, score: np.ndarray, group_len: np.ndarray) -> np.ndarray:
    """The chosen teacher of every group (-1 where no teacher has a KD chunk in it).

    coverage [n_teachers, G]: student tokens of the group that the teacher's KD chunks cover;
    score [n_teachers, G]: their summed teacher log-likelihood; group_len [G]: the group's student tokens.
    """
    full = coverage == group_len[None, :]
    # First key: covers the whole group where some teacher does, covered tokens where none does;
    # then the score; then the lower index.
    primary = np.where(full.any(axis=0)[None, :], full.astype(np.int64), coverage)
    chosen = np.full(coverage.shape[1], -1, dtype=np.int64)
    for g in np.flatnonzero((coverage > 0).any(axis=0)).tolist():
        candidates = np.flatnonzero(primary[:, g] == primary[:, g].max())
        keys = score[candidates, g]
        chosen[g] = int(candidates[np.flatnonzero(keys == keys.max())[0]])
    return chosen


def keep_chunks(events: BatchEvents, keep: np.ndarray) -> BatchEvents:
    """The events of the chunks where `keep` [C] is true, renumbered (numpy events, one row or a batch)."""
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != (events.num_chunks,):
        raise CsdError(f"keep_chunks got {keep.shape[0]} flags for {events.num_chunks} chunks; give one per chunk")
    new_chunk = np.cumsum(keep) - 1
    event_kept = keep[events.event_chunk]
    new_event = np.cumsum(event_kept) - 1
    chain_kept = keep[events.chain_chunk]
    final_kept = event_kept[events.final_event]
    stats = dict(events.stats)
    stats.pop("shape_counts", None)
    return replace(
        events,
        chain_pos=events.chain_pos[chain_kept], chain_tok=events.chain_tok[chain_kept],
        chain_chunk=new_chunk[events.chain_chunk[chain_kept]],
        final_pos=events.final_pos[final_kept], final_tok=events.final_tok[final_kept],
        final_event=new_event[events.final_event[final_kept]],
        event_chunk=new_chunk[events.event_chunk[event_kept]],
        event_teacher_logq=events.event_teacher_logq[event_kept],
        chunk_shape=events.chunk_shape[keep], chunk_student_start=events.chunk_student_start[keep],
        chunk_student_len=events.chunk_student_len[keep], chunk_teacher_loglik=events.chunk_teacher_loglik[keep],
        stats=stats,
    )


def select_row(events: list[BatchEvents], boundaries: list[np.ndarray]) -> list[BatchEvents]:
    """One row's events per teacher with, in each group, only the chosen teacher's chunks kept.

    events: row-local `BatchEvents` of each active teacher (`events.row_events.build_row_events`);
    boundaries: each teacher's chunk boundaries in the same row (`chunk_boundaries`). Each result
    carries `stats["groups"]` (groups with a KD chunk, counted on the first teacher) and
    `stats["groups_uncovered"]` (of those, groups no teacher covers whole).
    """
    if len(events) != len(boundaries):
        raise CsdError(f"select_row got events of {len(events)} teachers and chunks of {len(boundaries)}; "
                       "give both for every active teacher")
    edges = group_edges(boundaries)
    group_len = np.diff(edges)
    n_groups = len(group_len)
    coverage = np.zeros((len(events), n_groups), dtype=np.int64)
    score = np.zeros((len(events), n_groups), dtype=np.float64)
    group_of = []
    for t, ev in enumerate(events):
        start, length = ev.chunk_student_start, ev.chunk_student_len
        g = np.searchsorted(edges, start, side="right") - 1
        if start.size and (g.min() < 0 or (start + length > edges[np.minimum(g + 1, n_groups)]).any()):
            raise CsdError("a KD chunk crosses a boundary of its teacher's own chunks; the aligned row and its "
                           "events disagree, re-run the align stage")
        coverage[t] = np.bincount(g, weights=length, minlength=n_groups).astype(np.int64)
        score[t] = np.bincount(g, weights=ev.chunk_teacher_loglik, minlength=n_groups)
        group_of.append(g)
    chosen = choose_teachers(coverage, score, group_len)
    used = chosen >= 0
    uncovered = used & ~(coverage == group_len[None, :]).any(axis=0)
    out = []
    for t, (ev, g) in enumerate(zip(events, group_of, strict=True)):
        kept = keep_chunks(ev, chosen[g] == t)
        kept.stats.update(groups=int(used.sum()) if t == 0 else 0,
                          groups_uncovered=int(uncovered.sum()) if t == 0 else 0)
        out.append(kept)
    return out


def select_windows(rows_by_teacher: list[list[BatchEvents]], boundaries_by_teacher: list[list[np.ndarray]]
                   ) -> list[list[BatchEvents]]:
    """`select_row` over the windows of a batch: per teacher, per window, in and out."""
    if not rows_by_teacher:
        return rows_by_teacher
    per_window = [select_row([rows[w] for rows in rows_by_teacher], [b[w] for b in boundaries_by_teacher])
                  for w in range(len(rows_by_teacher[0]))]
    return [[selected[t] for selected in per_window] for t in range(len(rows_by_teacher))]
