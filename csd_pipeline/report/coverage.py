"""Teacher mass on explicit events: how much of the teacher's probability CSD compares event by event.

For each accepted chunk of an aligned row, the CSD events (`csd_pipeline.loss.events`, the same code
the trainer's loader runs, spelling classes summed) carry teacher probabilities q_T(e); their sum is
the teacher mass on explicit events, and 1 minus it is the teacher's REST. The trainer logs the mean
of this per step (`teacher_event_mass`); here it is computed from the stored top-k alone, no student
needed, per chunk, so its distribution can be drawn. Also the stored top-k's own mass per position.

Rows come from evenly spaced shards of the teacher output, `max_rows` in all (the event enumeration
is Python per chunk, a few thousand chunks a second), and the report says how many were read.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.report import TEACHER_ROWS
from schemas.aligned import SHAPES, teacher_columns


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

    def by_shape(self) -> dict:
        """shape -> {"chunks", "mean", "p10", "p50"} of the mass on explicit events."""
        out = {}
        for code, name in enumerate(SHAPES):
            values = self.mass[self.shape == code]
            if values.size:
                out[name] = {"chunks": int(values.size), "mean": float(values.mean()),
                             "p10": float(np.quantile(values, 0.1)), "p50": float(np.quantile(values, 0.5))}
        return out


def matching_aligned(teacher_manifest: dict, candidates: list) -> Path:
    """The aligned folder a teacher output was computed from: among `candidates` (folders given to the
    report) or the path its manifest records, the one whose manifest has the recorded sha256.

    Raises `CsdError` naming the folder to pass when none matches.
    """
    wanted = teacher_manifest.get("aligned", {}).get("manifest_sha256")
    recorded = teacher_manifest.get("sources", {}).get("aligned")
    for folder in [*candidates, *([recorded] if recorded else [])]:
        path = Path(folder) / "manifest.json"
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == wanted:
            return Path(folder)
    raise CsdError(f"the aligned folder this teacher output was computed from ({recorded or 'not recorded'}) is "
                   "missing or has changed; pass that aligned folder to the report too.")


def _tables_of(aligned_manifest: dict, aligned_dir: Path, index: int) -> tuple[Path, Path]:
    entries = aligned_manifest.get("tables") or []
    entry = next((t for t in entries if isinstance(t, dict) and t.get("teacher") == index), None)
    if entry is None and index < len(entries):
        entry = entries[index]
    if not isinstance(entry, dict) or "student_to_teacher" not in entry:
        raise CsdError(f"the manifest of {aligned_dir} lists no tables for teacher {index}; re-run `csd-pipeline align`.")
    return aligned_dir / entry["student_to_teacher"], aligned_dir / entry["teacher_to_student"]


def _spread(shards: list[dict], max_rows: int) -> list[tuple[int, int]]:
    """(shard index, rows to read from its start) over evenly spaced shards, `max_rows` in all."""
    total = sum(int(s["rows"]) for s in shards)
    if total <= max_rows:
        return [(i, int(s["rows"])) for i, s in enumerate(shards)]
    mean = total / len(shards)
    count = min(len(shards), max(1, math.ceil(max_rows / max(mean, 1))))
    picked = sorted({round(k * (len(shards) - 1) / max(count - 1, 1)) for k in range(count)})
    plan, left = [], max_rows
    for i in picked:
        take = min(int(shards[i]["rows"]), math.ceil(max_rows / len(picked)), left)
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
    import pyarrow.parquet as pq

    from csd_pipeline.loss.events import EventContext, build_row_events
    from csd_pipeline.runtime.manifest import read_manifest
    from csd_pipeline.teacher.reader import read_teacher_shard
    from csd_pipeline.vocab.tables import load_table

    teacher_dir, aligned_dir = Path(teacher_dir), Path(aligned_dir)
    manifest = read_manifest(teacher_dir, stage="teacher-logits")
    aligned = read_manifest(aligned_dir, stage="align")
    index = int(manifest.get("config", {}).get("teacher_index", 0))
    s2t, t2s = _tables_of(aligned, aligned_dir, index)
    context = EventContext(load_table(s2t), load_table(t2s), tables_name=str(s2t.parent))
    columns = ["row_id", "student_ids", *teacher_columns(index)]
    masses, shapes, topk_mass = [], [], []
    read = rejected = events = 0
    for shard_index, take in _spread(manifest["shards"], max_rows):
        name = manifest["shards"][shard_index]["file"]
        # ParquetFile, not read_table: that one imports pyarrow.dataset (and pandas with it), seconds for nothing
        rows = pq.ParquetFile(aligned_dir / aligned["shards"][shard_index]["file"]).read(columns=columns).slice(0, take)
        topk = read_teacher_shard(teacher_dir, name)
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
    return TeacherCoverage(rows_read=read, rows_total=int(manifest["totals"]["rows"]), rows_rejected=rejected,
                           top_k=int(manifest.get("config", {}).get("top_k", 0)), mass=_flat(masses, np.float64),
                           shape=_flat(shapes, np.int64), events=events, topk_mass=_flat(topk_mass, np.float64))


def _flat(parts: list, dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)
