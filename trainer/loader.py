"""Streaming training batches: shuffled windows, packed, with CE targets and CSD events.

`BatchLoader(spec, workers)` streams one rank's micro-batches. The rank runs `spec.lanes` lanes
(`trainer.shuffle`: each a contiguous span of the epoch's shards, read one block of shards at a
time, its rows permuted within the block); each lane packs its own windows greedily
(`csd_pipeline.evaluation.packing`) and the rank takes micro-batches from its lanes in turn. CE
targets and CSD events (`csd_pipeline.events.batch`) are built in data-loader worker processes:
worker w of W serves lanes w, w+W, ..., so each worker reads only its lanes' shards, and the
stream is the same whatever the number of workers. Every micro-batch carries the rank's loader
state after it (`trainer.data.rank_state`: each lane's epoch and rows consumed, and the next lane).
Aligned rows are read with `AlignedOutput.read`, teacher rows with `TeacherTopkOutput.shard`.

Only the training entry point imports this module (it imports torch at the top).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from csd_pipeline.align.output import AlignedOutput
from csd_pipeline.errors import CsdError
from csd_pipeline.evaluation.packing import check_window_length, pack, plan_rows
from trainer.data import lane_state, rank_state
from trainer.shuffle import EpochPlan


@dataclass
class MicroBatch:
    """One rank's packed micro-batch with its CE targets and per-teacher events (numpy)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    ce_positions: np.ndarray
    ce_tokens: np.ndarray
    teachers: list                 # per active teacher: its rows as the loss collates them (`TrainingLoss.collate`)
    shape_counts: list[list[int]]  # per active teacher: accepted chunks per shape (schemas.aligned.SHAPES)
    content_tokens: int
    padding_tokens: int
    windows: int
    lane: int = 0                   # the lane of this rank that supplied it
    state: dict = field(default_factory=dict)  # its lane's state after it; `BatchLoader` makes it the rank's


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
    loss: object                   # the run's `TrainingLoss`: prepares each teacher's rows (loss.training)
    rank: int
    world: int
    lanes: int                     # lanes per rank (`trainer.shuffle.lanes_per_rank`)
    lane_states: list              # each lane's `lane_state` to start from
    next_lane: int                 # the lane that supplies the first micro-batch
    pad_id: int
    teacher_top_k: int = 0
    teacher_cache_bytes: int = 0  # decoded teacher blocks kept per worker, over all teachers and open shards
    teacher_control: str = "none"  # shuffled: the batch's teacher rows given to other positions


@dataclass
class _Window:
    lane: int
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


def _lane_windows(spec: LoaderSpec, lane: int):
    """Lane `lane`'s windows in data order from its state in `spec`, across epochs, forever.

    Only the aligned shards of the lane's current block are read (`EpochPlan.lane_rows`)."""
    columns = spec.aligned.training_columns(spec.teacher_indices)
    shard_rows = tuple(shard.rows for shard in spec.aligned.shards)
    lanes, index = spec.world * spec.lanes, spec.rank * spec.lanes + lane
    epoch, start = spec.lane_states[lane]["epoch"], spec.lane_states[lane]["position"]
    while True:
        plan = EpochPlan(spec.seed, epoch, shard_rows, spec.shuffle_block)
        count = plan.lane_count(index, lanes)
        offsets = plan.shard_offsets
        position = start
        for block, rows in plan.lane_rows(index, lanes, start):
            shards = {s: _ShardColumns(spec.aligned, s, columns) for s in block.shards}
            shard_of = np.searchsorted(offsets, rows, side="right") - 1
            for global_row, shard in zip(rows.tolist(), shard_of.tolist(), strict=True):
                local = global_row - int(offsets[shard])
                row = shards[shard].row(local)
                position += 1
                after = lane_state(epoch, position) if position < count else lane_state(epoch + 1, 0)
                yield _Window(lane, shard, local, len(row["student_ids"]), after, row)
        epoch, start = epoch + 1, 0


def _batch_plans(spec: LoaderSpec, lane: int):
    """(windows, placements) of lane `lane`'s micro-batches in order; the packing plan only needs window lengths.

    A micro-batch never holds two epochs: the lane's last one of an epoch takes what is left of it, so
    nothing of the next epoch is read before the lane reaches it."""
    pending: deque = deque()
    source = _lane_windows(spec, lane)
    capacity = spec.batch_size * spec.seq_len
    while True:
        # enough windows that the plan stops on a window that does not fit (never on a short buffer),
        # or up to the epoch's end
        while sum(w.length for w in pending) <= capacity and not (pending and pending[-1].state_after["position"] == 0):
            window = next(source)
            check_window_length(window.length, spec.seq_len, window.columns["row_id"])
            pending.append(window)
        placements, used = plan_rows([w.length for w in pending], spec.seq_len, spec.batch_size)
        yield [pending.popleft() for _ in range(used)], placements


class _BatchBuilder:
    """Turns planned windows into a `MicroBatch` (tables and teacher shards loaded once per worker)."""

    def __init__(self, spec: LoaderSpec, lanes_here: int = 1):
        self.spec = spec
        self.lanes_here = lanes_here  # lanes this worker serves: they share its teacher cache
        self._contexts = None
        self._teacher_cache: dict[tuple[int, int, int], object] = {}

    def contexts(self):
        if self._contexts is None:
            from csd_pipeline.events.context import EventContext
            from csd_pipeline.vocab.tables import load_table

            self._contexts = [
                EventContext(load_table(s2t), load_table(t2s), tables_name=str(Path(s2t).parent))
                for s2t, t2s in self.spec.tables
            ]
        return self._contexts

    def teacher_row(self, lane: int, t: int, shard: int, row: int):
        key = (lane, t, shard)
        if key not in self._teacher_cache:
            # a lane's block spans at most `shuffle_block` shards: keep that many per lane and teacher
            mine = [k for k in self._teacher_cache if k[:2] == (lane, t)]
            for old in mine[: max(0, len(mine) - self.spec.shuffle_block + 1)]:
                del self._teacher_cache[old]
            open_shards = min(self.spec.shuffle_block, len(self.spec.aligned.shards)) * self.lanes_here
            share = self.spec.teacher_cache_bytes // (open_shards * len(self.spec.teachers))
            self._teacher_cache[key] = self.spec.teachers[t].shard(shard, cache_bytes=share)
        topk = self._teacher_cache[key][row]
        return most_likely_entries(topk, self.spec.teacher_top_k) if self.spec.teacher_top_k else topk

    def build(self, windows: list[_Window], placements) -> MicroBatch:
        from csd_pipeline.events.batch import ce_targets

        spec = self.spec
        packed = pack([w.columns["student_ids"] for w in windows], placements, spec.seq_len, spec.batch_size,
                      spec.pad_id)
        offsets = packed.flat_offsets
        ce_positions, ce_tokens = ce_targets([w.columns["student_ids"] for w in windows],
                                             [w.columns["student_loss_mask"] for w in windows], offsets)
        rows_by_teacher = [self._teacher_rows(t, index, windows) for t, index in enumerate(spec.teacher_indices)]
        rows_by_teacher = spec.loss.select(rows_by_teacher, [w.columns for w in windows], spec.teacher_indices)
        teachers = [spec.loss.collate(rows, offsets) for rows in rows_by_teacher]
        shapes = [events.shape_counts() for events in teachers]
        return MicroBatch(
            input_ids=packed.input_ids, position_ids=packed.position_ids, ce_positions=ce_positions,
            ce_tokens=ce_tokens, teachers=teachers, shape_counts=shapes, content_tokens=packed.content_tokens,
            padding_tokens=spec.batch_size * spec.seq_len - packed.content_tokens, windows=len(windows),
            lane=windows[0].lane, state=dict(windows[-1].state_after),
        )

    def _teacher_rows(self, t: int, index: int, windows: list[_Window]) -> list:
        """Teacher `t`'s rows of every window as the loss prepares them (`TrainingLoss.prepare_row`), row-local."""
        from csd_pipeline.events.baseline_rows import shuffle_teacher_rows

        spec = self.spec
        context = self.contexts()[t]
        topks = [self.teacher_row(w.lane, t, w.shard, w.row) for w in windows]
        if spec.teacher_control == "shuffled":  # the same stored rows, at other positions of the batch
            first = windows[0].state_after
            rng = np.random.default_rng([spec.seed, spec.rank, windows[0].lane, t, first["epoch"], first["position"]])
            topks = shuffle_teacher_rows(topks, rng)
        # A rejected teacher row (non-finite values) gives no events or rows (CE only) and is counted.
        return [spec.loss.prepare_row(w.columns, index, topk, context, source=spec.aligned.shards[w.shard].file)
                for w, topk in zip(windows, topks, strict=True)]


def most_likely_entries(topk, n: int):
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
    """Yield the `MicroBatch`es of the lanes v with v % workers == worker, in the rank's order.

    The rank takes micro-batches from its lanes in turn, from `spec.next_lane` on; this worker yields
    those of its own lanes in that order, so it reads only its lanes' shards."""
    mine = [lane for lane in range(spec.lanes) if lane % workers == worker]
    builder = _BatchBuilder(spec, lanes_here=len(mine))
    plans = {lane: _batch_plans(spec, lane) for lane in mine}
    lane = spec.next_lane
    try:
        while True:
            if lane in plans:
                yield builder.build(*next(plans[lane]))
            lane = (lane + 1) % spec.lanes
    except CsdError as err:
        yield _LoaderError(str(err))


class _Stream(torch.utils.data.IterableDataset):
    """Worker `worker` of `workers`'s part of the stream as a torch IterableDataset (one process each)."""

    def __init__(self, spec: LoaderSpec, worker: int, workers: int):
        self.spec, self.worker, self.workers = spec, worker, workers

    def __iter__(self):
        return stream_batches(_own_file_systems(self.spec), self.worker, self.workers)


def _own_file_systems(spec: LoaderSpec) -> LoaderSpec:
    """`spec` for a forked worker: its outputs copied when one is on an object store. The fsspec file system a
    worker inherits cannot serve it (s3fs's event loop and connections are the parent's: "This class is not
    fork-safe"); a copy's paths open their own file system in the worker."""
    import copy
    from dataclasses import replace

    from csd_pipeline.runtime.storage import is_remote_object

    if not any(is_remote_object(out.directory) for out in [spec.aligned, *spec.teachers]):
        return spec
    return replace(spec, aligned=copy.deepcopy(spec.aligned), teachers=copy.deepcopy(spec.teachers))


def _identity(batch):
    return batch


WORKER_GC_ENV = "CSD_TEST_WORKER_GC"


def _start_worker(parent_pid: int, worker_id: int) -> None:
    from csd_pipeline.runtime.lifetime import end_with_parent

    end_with_parent(parent_pid)  # a csd-train killed with -9 takes its workers with it
    if os.environ.get(WORKER_GC_ENV):  # test hook: a collection in the worker at once (issue 35's hang)
        import gc

        gc.collect()


def _forked_workers(spec: LoaderSpec, count: int) -> list:
    """One DataLoader iterator (one forked worker process) per worker.

    The workers are forked with the garbage collector's objects frozen, so that a worker never finalizes
    what it inherited. When the last reference to a destroyed gloo process group sits in a reference
    cycle not yet collected (an earlier `train` in this process: a test session, a bench), a collection
    in the forked worker runs gloo's destructor there, on threads that exist only in the parent: the
    worker hangs for good or crashes (issue 35, docs/RELIABILITY.md). Frozen, it stays the parent's."""
    import gc
    from functools import partial

    gc.freeze()
    try:
        return [iter(torch.utils.data.DataLoader(
            _Stream(spec, worker, count), batch_size=None, num_workers=1, collate_fn=_identity,
            prefetch_factor=4, persistent_workers=False, worker_init_fn=partial(_start_worker, os.getpid())))
            for worker in range(count)]
    finally:
        gc.unfreeze()


class BatchLoader:
    """Iterator of the rank's `MicroBatch`es, each carrying the rank's loader state after it.

    `workers` > 0 builds them in min(workers, lanes) worker processes (one torch DataLoader each);
    worker w serves lanes w, w + workers, ..., so it reads only their shards. The stream is the same
    for any number of workers."""

    def __init__(self, spec: LoaderSpec, workers: int):
        self.spec = spec
        self.lane_states = [dict(state) for state in spec.lane_states]
        self.next_lane = spec.next_lane
        if workers == 0:
            self._iters = [stream_batches(spec)]
        else:
            self._iters = _forked_workers(spec, min(workers, spec.lanes))

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        lane = self.next_lane
        batch = next(self._iters[lane % len(self._iters)])
        if isinstance(batch, _LoaderError):
            raise CsdError(batch.message)
        if batch.lane != lane:
            raise CsdError(f"data-loader worker sent a micro-batch of lane {batch.lane} where lane {lane} was due; "
                           "this is a bug, please report it")
        self.lane_states[lane] = batch.state
        self.next_lane = (lane + 1) % self.spec.lanes
        batch.state = rank_state(self.lane_states, self.next_lane)
        return batch

    def close(self) -> None:
        """Stop the worker processes."""
        for iterator in self._iters:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iters = [iter(())]
