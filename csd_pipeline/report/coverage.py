"""Teacher mass on explicit events: how much of the teacher's probability CSD compares event by event.

For each accepted chunk of an aligned row, the CSD events (`csd_pipeline.events.batch`, the same code
the trainer's loader runs, spelling classes summed) carry teacher probabilities q_T(e); their sum is
the teacher mass on explicit events, and 1 minus it is the teacher's REST. The trainer logs the mean
of this per step (`teacher_event_mass`); here it is computed from the stored top-k alone, no student
needed, per chunk, so its distribution can be drawn. Also the stored top-k's own mass per position.

Rows come from evenly spaced shards of the teacher output, `max_rows` in all (the event enumeration
is Python per chunk, a few thousand chunks a second), and the report says how many were read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.report import TEACHER_ROWS
from csd_pipeline.runtime.storage import location
from schemas.aligned import SHAPES


@dataclass
class TeacherCoverage:
    """Per accepted chunk of the rows read: `mass` (teacher mass on explicit events) and `shape` (index
    into SHAPES); per teacher position of those rows: `topk_mass` (probability in the stored top-k)."""

    rows_read: int
    rows_total: int
    rows_rejected: int
    top_k: int
    mass: np.ndarray
    shape: np.ndarray
    events: int
    topk_mass: np.ndarray
    keep: str = "top-k"  # the store's `--keep`: "csd-events" holds only the entries CSD reads

    @property
    def stored_label(self) -> str:
        """What a position stores, for labels: "top-128", or "CSD-event entries of the top-128"."""
        return f"top-{self.top_k}" if self.keep == "top-k" else f"CSD-event entries of the top-{self.top_k}"

    def by_shape(self) -> dict:
        """shape -> {"chunks", "mean", "p10", "p50"} of the mass on explicit events."""
        out = {}
        for code, name in enumerate(SHAPES):
            values = self.mass[self.shape == code]
            if values.size:
                out[name] = {"chunks": int(values.size), "mean": float(values.mean()),
                             "p10": float(np.quantile(values, 0.1)), "p50": float(np.quantile(values, 0.5))}
        return out


def matching_aligned(teacher, candidates: list) -> Path:
    """The aligned folder a teacher output (a `TeacherTopkOutput`) was computed from: among `candidates`
    (folders given to the report) or the path its manifest records, the one whose manifest has the
    recorded sha256.

    Raises `CsdError` naming the folder to pass when none matches.
    """
    from csd_pipeline.runtime.files import file_sha256
    from csd_pipeline.runtime.manifest import MANIFEST_NAME

    wanted = (teacher.manifest.get("aligned") or {}).get("manifest_sha256")
    recorded = (teacher.manifest.get("sources") or {}).get("aligned")
    for folder in [*candidates, *([recorded] if recorded else [])]:
        path = location(folder) / MANIFEST_NAME
        if path.is_file() and file_sha256(path) == wanted:
            return location(folder)
    raise CsdError(f"the aligned folder this teacher output was computed from ({recorded or 'not recorded'}) is "
                   "missing or has changed; pass that aligned folder to the report too.")


def _spread(shard_rows: list[int], max_rows: int) -> list[tuple[int, int]]:
    """(shard index, rows to read from its start) over evenly spaced shards, `max_rows` in all."""
    total = sum(shard_rows)
    if total <= max_rows:
        return list(enumerate(shard_rows))
    mean = total / len(shard_rows)
    count = min(len(shard_rows), max(1, math.ceil(max_rows / max(mean, 1))))
    picked = sorted({round(k * (len(shard_rows) - 1) / max(count - 1, 1)) for k in range(count)})
    plan, left = [], max_rows
    for i in picked:
        take = min(shard_rows[i], math.ceil(max_rows / len(picked)), left)
        if take:
            plan.append((i, take))
            left -= take
    return plan


def teacher_coverage(teacher_dir, aligned_dir, *, max_rows: int = TEACHER_ROWS, advance=None) -> TeacherCoverage:
    """The `TeacherCoverage` of a teacher-logits output over at most `max_rows` rows.

    `aligned_dir`: the aligned folder it was computed from (see `matching_aligned`). `advance(n)`:
    told of rows as they are read (a progress bar). Raises `CsdError` for a folder that is not a
    complete teacher-logits output, or tables and shards that do not match.
    """
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.events.context import EventContext
    from csd_pipeline.events.row_events import build_row_events
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from csd_pipeline.vocab.tables import load_table

    teacher, aligned = TeacherTopkOutput.open(teacher_dir), AlignedOutput.open(aligned_dir)
    teacher.verify()
    teacher.check_pairs_with(aligned)  # co-partitioned: teacher shard i holds the rows of aligned shard i
    index = teacher.teacher_index
    s2t, t2s = aligned.tables(index)
    context = EventContext(load_table(s2t), load_table(t2s), tables_name=str(s2t.parent))
    columns = aligned.training_columns([index])
    masses, shapes, topk_mass = [], [], []
    read = rejected = events = 0
    for shard_index, take in _spread([shard.rows for shard in aligned.shards], max_rows):
        name = teacher.shard_files[shard_index]
        rows = aligned.read(aligned.shards[shard_index], columns).slice(0, take)
        topk = teacher.shard(shard_index)
        for r, row in enumerate(rows.to_pylist()):
            stored = topk[r]
            read += 1
            if not stored.ok:
                rejected += 1
                continue
            found = build_row_events(row, index, stored, context, source=name)
            masses.append(np.bincount(found.event_chunk, np.exp(found.event_teacher_logq), minlength=found.num_chunks))
            shapes.append(np.asarray(found.chunk_shape))
            events += found.num_events
            topk_mass.append(np.exp(stored.logprobs.astype(np.float64)).sum(axis=1))
        if advance is not None:
            advance(len(rows))
    return TeacherCoverage(rows_read=read, rows_total=int(teacher.manifest["totals"]["rows"]), rows_rejected=rejected,
                           top_k=int(teacher.manifest.get("config", {}).get("top_k", 0)), mass=_flat(masses, np.float64),
                           shape=_flat(shapes, np.int64), events=events, topk_mass=_flat(topk_mass, np.float64),
                           keep=teacher.keep)


def _flat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)
