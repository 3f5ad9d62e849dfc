"""The data order: a pure function of (seed, epoch, shard sizes, lanes), and its split over ranks.

Each epoch permutes the shards; laid end to end in that order (each shard's rows in stored order)
they form the epoch's sequence of N rows. The sequence is cut into `lanes` contiguous spans of
equal size (floor(k N / lanes) to floor((k + 1) N / lanes): sizes differ by at most one row, no
row is dropped or repeated). A lane's span is grouped into blocks of `block` consecutive shards (or
parts of shards, at the span's ends) and the rows of each block are permuted. A lane therefore
touches only the shards of its span, one block at a time, while its rows still mix across the
shards of a block and, from epoch to epoch, across every shard (as mosaicml/streaming partitions
samples over canonical nodes, then shuffles within blocks).

The trainer runs `world x lanes_per_rank` lanes: rank r owns lanes r*V .. r*V + V - 1, a
contiguous span of about N / world rows, and its data-loader workers split those V lanes
(`trainer/loader.py`). Lanes are disjoint and together cover the epoch. Nothing here reads data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from csd_pipeline.errors import CsdError

# Stream tags keep the shard permutation and each block's row permutation independent.
_SHARD_STREAM = 0
_ROW_STREAM = 1


def _rng(seed: int, epoch: int, *tags: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, *tags])))


def lanes_per_rank(total_rows: int, world: int, wanted: int) -> int:
    """How many lanes each rank runs: `wanted` (`--data-lanes`), fewer when the data has fewer than
    `wanted` rows per rank (every lane gets at least one row). Raises `CsdError` for a bad world size."""
    _check_lane(0, world)
    if wanted < 1:
        raise CsdError(f"--data-lanes must be at least 1, got {wanted}")
    return max(1, min(wanted, total_rows // world))


@dataclass(frozen=True)
class Block:
    """A run of one lane's rows: `parts` are (shard, first row, end row) in the epoch's shard order."""

    index: int                           # within the lane's epoch
    start: int                           # the lane's position (rows before this block in its epoch)
    parts: tuple[tuple[int, int, int], ...]

    @property
    def rows(self) -> int:
        return sum(end - first for _, first, end in self.parts)

    @property
    def shards(self) -> list[int]:
        return [shard for shard, _, _ in self.parts]


@dataclass(frozen=True)
class EpochPlan:
    """The order of one epoch over shards of the given sizes (rows per shard, manifest order)."""

    seed: int
    epoch: int
    shard_rows: tuple[int, ...]
    block: int

    def __post_init__(self):
        if self.block < 1:
            raise CsdError(f"--shuffle-block must be at least 1, got {self.block}")
        if any(n < 0 for n in self.shard_rows):
            raise CsdError("a shard reports a negative row count; re-run the stage that wrote it")

    @property
    def shard_offsets(self) -> np.ndarray:
        """Global index of the first row of each shard (shards in manifest order)."""
        return np.concatenate([[0], np.cumsum(self.shard_rows, dtype=np.int64)])

    @property
    def total_rows(self) -> int:
        return int(sum(self.shard_rows))

    def shard_order(self) -> np.ndarray:
        """The epoch's permutation of the shards (manifest indices)."""
        return _rng(self.seed, self.epoch, _SHARD_STREAM).permutation(len(self.shard_rows))

    def lane_span(self, lane: int, lanes: int) -> tuple[int, int]:
        """(first, end) positions of lane `lane` of `lanes` in the epoch's sequence."""
        _check_lane(lane, lanes)
        total = self.total_rows
        return lane * total // lanes, (lane + 1) * total // lanes

    def lane_count(self, lane: int, lanes: int) -> int:
        """How many rows lane `lane` of `lanes` gets in this epoch."""
        first, end = self.lane_span(lane, lanes)
        return end - first

    def lane_blocks(self, lane: int, lanes: int) -> list[Block]:
        """The blocks of lane `lane` of `lanes`, in order: the shards its span touches, `block` at a time."""
        first, end = self.lane_span(lane, lanes)
        order = self.shard_order()
        sizes = np.asarray(self.shard_rows, dtype=np.int64)[order]
        starts = np.concatenate([[0], np.cumsum(sizes)])  # position of each ordered shard's first row
        parts = []
        # the ordered shards that overlap [first, end): the last one starting at or before `first`, on
        for i in range(max(0, int(np.searchsorted(starts, first, side="right")) - 1), len(order)):
            if starts[i] >= end:
                break
            lo, hi = max(first, int(starts[i])), min(end, int(starts[i + 1]))
            if hi > lo:
                parts.append((int(order[i]), lo - int(starts[i]), hi - int(starts[i])))
        blocks, position = [], 0
        for index, at in enumerate(range(0, len(parts), self.block)):
            group = tuple(parts[at:at + self.block])
            blocks.append(Block(index, position, group))
            position += blocks[-1].rows
        return blocks

    def block_rows(self, lane: int, lanes: int, block: Block) -> np.ndarray:
        """Global row indices (manifest order, int64) of one block of a lane, permuted."""
        offsets = self.shard_offsets
        rows = np.concatenate([np.arange(offsets[s] + lo, offsets[s] + hi, dtype=np.int64)
                               for s, lo, hi in block.parts]) if block.parts else np.zeros(0, dtype=np.int64)
        permutation = _rng(self.seed, self.epoch, _ROW_STREAM, lanes, lane, block.index).permutation(len(rows))
        return rows[permutation]

    def lane_rows(self, lane: int, lanes: int, start: int = 0) -> Iterator[tuple[Block, np.ndarray]]:
        """Yield (block, global row indices) of lane `lane` of `lanes` from its `start`-th row on.

        `start` counts rows of this lane (the loader state); blocks before it are skipped unread.
        """
        for block in self.lane_blocks(lane, lanes):
            if block.start + block.rows > start:
                yield block, self.block_rows(lane, lanes, block)[max(0, start - block.start):]

    def lane_shards(self, lane: int, lanes: int) -> list[int]:
        """The shards (manifest indices) lane `lane` of `lanes` opens in this epoch, in the order it reads them."""
        return [shard for block in self.lane_blocks(lane, lanes) for shard in block.shards]

    def order(self, lanes: int = 1) -> np.ndarray:
        """The epoch's rows, lane after lane (for tests and small data; the loader uses `lane_rows`)."""
        parts = [rows for lane in range(lanes) for _, rows in self.lane_rows(lane, lanes)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _check_lane(lane: int, lanes: int) -> None:
    if lanes < 1 or not 0 <= lane < lanes:
        raise CsdError(f"lane {lane} of {lanes} is out of range; check the launcher's RANK/WORLD_SIZE")
