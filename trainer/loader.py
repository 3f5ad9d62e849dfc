"""Streaming training batches: shuffled windows, packed, with CE targets and CSD events.

`BatchLoader(spec, workers)` streams one rank's micro-batches: the epoch order of
`trainer.shuffle` (one block of shards in memory at a time), greedy packing
(`csd_pipeline.evaluation.packing`), CE targets and CSD events (`csd_pipeline.loss.events`) built
in data-loader worker processes. Worker w of W builds batches w, w+W, ...; the torch DataLoader
hands them back in order, so the stream is the same whatever the number of workers. Every
micro-batch carries the loader state after it: `{"version", "epoch", "position"}`, the next window
of this rank. Aligned rows are read with `AlignedOutput.read`, teacher rows with
`TeacherTopkOutput.shard`.

Only the training entry point imports this module (it imports torch at the top).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from csd_pipeline.align.output import AlignedOutput
from csd_pipeline.errors import CsdError
from csd_pipeline.evaluation.packing import check_window_length, pack, plan_rows
from trainer.data import LOADER_STATE_VERSION
from trainer.shuffle import EpochPlan


@dataclass
class MicroBatch:
    """One rank's packed micro-batch with its CE targets and per-teacher events (numpy)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    ce_positions: np.ndarray
    ce_tokens: np.ndarray
    teachers: list                 # BatchEvents per active teacher
    shape_counts: list[list[int]]  # per active teacher: accepted chunks per shape (schemas.aligned.SHAPES)
    content_tokens: int
    padding_tokens: int
    windows: int
    state: dict = field(default_factory=dict)


@dataclass
class LoaderSpec:
    """Everything a loader worker needs (plain values and the two outputs, so it crosses process boundaries)."""

    aligned: AlignedOutput
    teachers: list                 # TeacherTopkOutput of each active teacher
    teacher_indices: list[int]     # each active teacher's index in the aligned rows
    tables: list[tuple[str, str]]  # each active teacher's (student->teacher, teacher->student) tables
    seed: int
    shuffle_block: int
    seq_len: int
    batch_size: int
    spelling: str
    only_1to1: bool
    rank: int
    world: int
    epoch: int
    position: int
    pad_id: int
    teacher_top_k: int = 0
    teacher_cache_bytes: int = 0  # decoded teacher blocks kept per worker, over all teachers and open shards
    baseline: bool = False         # uld, gold, strict: per-chunk rows (ChunkRows) instead of CSD events
    teacher_control: str = "none"  # shuffled: the batch's teacher rows given to other positions
    kd_combine: str = "sum"        # select: per group of chunks, only the chosen teacher's chunks (loss.teacher_select)


@dataclass
class _Window:
    shard: int
    row: int           # row within the shard
    length: int
    state_after: dict  # loader state once this window is consumed
    columns: dict      # this row's aligned values


class _ShardColumns:
    """One aligned shard's columns as flat numpy arrays + offsets (O(1) row access, no Python lists)."""

    def __init__(self, aligned: AlignedOutput, shard: int, columns: list[str]):
        import pyarrow as pa

        table = aligned.read(aligned.shards[shard], columns)
        self.lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.scalars: dict[str, list] = {}
        for name in columns:
            column = table.column(name).combine_chunks()
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                self.lists[name] = (column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy())
            else:
                self.scalars[name] = column.to_pylist()

    def row(self, i: int) -> dict:
        out = {name: values[i] for name, values in self.scalars.items()}
        for name, (values, offsets) in self.lists.items():
            out[name] = values[offsets[i]:offsets[i + 1]]
        return out


def _windows(spec: LoaderSpec):
    """This rank's windows in data order from (spec.epoch, spec.position), across epochs, forever."""
    columns = spec.aligned.training_columns(spec.teacher_indices)
    shard_rows = tuple(shard.rows for shard in spec.aligned.shards)
    epoch, start = spec.epoch, spec.position
    while True:
        plan = EpochPlan(spec.seed, epoch, shard_rows, spec.shuffle_block)
        count = plan.rank_count(spec.rank, spec.world)
        offsets = plan.shard_offsets
        position = start
        for _, rows in plan.rank_rows(spec.rank, spec.world, start):
            shard_of = np.searchsorted(offsets, rows, side="right") - 1
            shards = {s: _ShardColumns(spec.aligned, s, columns) for s in np.unique(shard_of).tolist()}
            for global_row, shard in zip(rows.tolist(), shard_of.tolist(), strict=True):
                local = global_row - int(offsets[shard])
                row = shards[shard].row(local)
                position += 1
                after = ({"version": LOADER_STATE_VERSION, "epoch": epoch, "position": position}
                         if position < count else {"version": LOADER_STATE_VERSION, "epoch": epoch + 1, "position": 0})
                yield _Window(shard, local, len(row["student_ids"]), after, row)
        epoch, start = epoch + 1, 0


def _batch_plans(spec: LoaderSpec):
    """(batch index, windows, placements) in order; the packing plan only needs window lengths."""
    pending: deque = deque()
    source = _windows(spec)
    capacity = spec.batch_size * spec.seq_len
    index = 0
    while True:
        # enough windows that the plan stops on a window that does not fit (never on a short buffer)
        while sum(w.length for w in pending) <= capacity:
            window = next(source)
            check_window_length(window.length, spec.seq_len, window.columns["row_id"])
            pending.append(window)
        placements, used = plan_rows([w.length for w in pending], spec.seq_len, spec.batch_size)
        yield index, [pending.popleft() for _ in range(used)], placements
        index += 1


class _BatchBuilder:
    """Turns planned windows into a `MicroBatch` (tables and teacher shards loaded once per worker)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        self._contexts = None
        self._teacher_cache: dict[tuple[int, int], object] = {}

    def contexts(self):
        if self._contexts is None:
            from csd_pipeline.loss.event_context import EventContext
            from csd_pipeline.vocab.tables import load_table

            self._contexts = [
                EventContext(load_table(s2t), load_table(t2s), tables_name=str(Path(s2t).parent))
                for s2t, t2s in self.spec.tables
            ]
        return self._contexts

    def teacher_row(self, t: int, shard: int, row: int):
        key = (t, shard)
        if key not in self._teacher_cache:
            # a block spans at most `shuffle_block` shards: keep that many per teacher
            mine = [k for k in self._teacher_cache if k[0] == t]
            for old in mine[: max(0, len(mine) - self.spec.shuffle_block + 1)]:
                del self._teacher_cache[old]
            open_shards = min(self.spec.shuffle_block, len(self.spec.aligned.shards))
            share = self.spec.teacher_cache_bytes // (open_shards * len(self.spec.teachers))
            self._teacher_cache[key] = self.spec.teachers[t].shard(shard, cache_bytes=share)
        topk = self._teacher_cache[key][row]
        return keep_most_likely(topk, self.spec.teacher_top_k) if self.spec.teacher_top_k else topk

    def build(self, windows: list[_Window], placements) -> MicroBatch:
        from csd_pipeline.loss.events import ce_targets, collate_events
        from csd_pipeline.loss.teacher_rows import collate_chunk_rows

        spec = self.spec
        packed = pack([w.columns["student_ids"] for w in windows], placements, spec.seq_len, spec.batch_size,
                      spec.pad_id)
        offsets = packed.flat_offsets
        ce_positions, ce_tokens = ce_targets([w.columns["student_ids"] for w in windows],
                                             [w.columns["student_loss_mask"] for w in windows], offsets)
        rows_by_teacher = [self._teacher_rows(t, index, windows) for t, index in enumerate(spec.teacher_indices)]
        if spec.kd_combine == "select" and not spec.baseline:
            from csd_pipeline.loss.teacher_select import chunk_boundaries, select_windows

            boundaries = [[chunk_boundaries(w.columns, index) for w in windows] for index in spec.teacher_indices]
            rows_by_teacher = select_windows(rows_by_teacher, boundaries)
        teachers = [collate_chunk_rows(rows, offsets) if spec.baseline else collate_events(rows, offsets)
                    for rows in rows_by_teacher]
        shapes = [events.shape_counts() for events in teachers]
        return MicroBatch(
            input_ids=packed.input_ids, position_ids=packed.position_ids, ce_positions=ce_positions,
            ce_tokens=ce_tokens, teachers=teachers, shape_counts=shapes, content_tokens=packed.content_tokens,
            padding_tokens=spec.batch_size * spec.seq_len - packed.content_tokens, windows=len(windows),
            state=dict(windows[-1].state_after),
        )

    def _teacher_rows(self, t: int, index: int, windows: list[_Window]) -> list:
        """Teacher `t`'s events (or, for a baseline, `ChunkRows`) of every window, row-local."""
        from csd_pipeline.loss.row_events import build_row_events
        from csd_pipeline.loss.teacher_rows import build_row_chunks, shuffle_teacher_rows

        spec = self.spec
        context = self.contexts()[t]
        topks = [self.teacher_row(t, w.shard, w.row) for w in windows]
        if spec.teacher_control == "shuffled":  # the same stored rows, at other positions of the batch
            first = windows[0].state_after
            rng = np.random.default_rng([spec.seed, spec.rank, t, first["epoch"], first["position"]])
            topks = shuffle_teacher_rows(topks, rng)
        # A rejected teacher row (non-finite values) gives no events or rows (CE only) and is counted.
        if spec.baseline:
            return [build_row_chunks(w.columns, index, topk, context, only_1to1=spec.only_1to1,
                                     source=spec.aligned.shards[w.shard].file)
                    for w, topk in zip(windows, topks, strict=True)]
        return [build_row_events(w.columns, index, topk, context, spelling=spec.spelling, only_1to1=spec.only_1to1,
                                 source=spec.aligned.shards[w.shard].file)
                for w, topk in zip(windows, topks, strict=True)]


def keep_most_likely(topk, n: int):
    """The row with only its n most likely stored entries per position (all when n >= k).

    The stored entries are the teacher's k most likely ids, so their n most likely are exactly what a
    top-n capture would store (up to the encoding's quantisation). A variable-length row (`--top-p`)
    keeps min(n, its length) entries per position: padding (log-prob -inf) sorts last. Of a
    `--keep csd-events` row these are the n most likely event entries (a superset of the events of a
    top-n capture).
    """
    from dataclasses import replace

    if not topk.ok or n >= topk.ids.shape[1]:
        return topk
    order = np.argsort(-topk.logprobs, axis=1, kind="stable")[:, :n]
    return replace(topk, ids=np.take_along_axis(topk.ids, order, axis=1),
                   logprobs=np.take_along_axis(topk.logprobs, order, axis=1), lengths=np.minimum(topk.lengths, n))


@dataclass
class _LoaderError:
    """A `CsdError` raised in a worker, carried back as a value (the DataLoader would add a traceback)."""

    message: str


def stream_batches(spec: LoaderSpec, worker: int = 0, workers: int = 1):
    """Yield the `MicroBatch`es with index % workers == worker, in order."""
    builder = _BatchBuilder(spec)
    try:
        for index, windows, placements in _batch_plans(spec):
            if index % workers == worker:
                yield builder.build(windows, placements)
    except CsdError as err:
        yield _LoaderError(str(err))


class _Stream(torch.utils.data.IterableDataset):
    """The loader stream as a torch IterableDataset (worker w builds batches w, w+W, ...)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return stream_batches(self.spec, worker, workers)


def _identity(batch):
    return batch


class BatchLoader:
    """Iterator of `MicroBatch`es; `workers` > 0 builds them in that many worker processes."""

    def __init__(self, spec: LoaderSpec, workers: int):
        self.spec = spec
        if workers == 0:
            self._iter = stream_batches(spec)
            self._loader = None
        else:
            self._loader = torch.utils.data.DataLoader(
                _Stream(spec), batch_size=None, num_workers=workers, collate_fn=_identity,
                prefetch_factor=4, persistent_workers=False,
            )
            self._iter = iter(self._loader)

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        batch = next(self._iter)
        if isinstance(batch, _LoaderError):
            raise CsdError(batch.message)
        return batch

    def close(self) -> None:
        """Stop the worker processes."""
        shutdown = getattr(self._iter, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iter = iter(())
