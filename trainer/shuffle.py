"""The data order: a pure function of (seed, epoch, shard sizes), and its split over ranks.

An epoch permutes the shards, groups consecutive shards of that order into blocks of
`block` shards, and permutes the rows of each block. Only one block has to be read at a time,
so the order streams while still mixing rows across shards. The concatenated block orders
form the epoch's global sequence; rank `r` of `w` takes every `w`-th element starting at `r`,
so ranks get disjoint parts and together exactly the epoch. Nothing here reads data.
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


@dataclass(frozen=True)
class EpochPlan:
    """The order of one epoch over shards of the given sizes (rows per shard)."""

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

    def blocks(self) -> list[np.ndarray]:
        """Shard indices of each block, in epoch order."""
        shard_order = _rng(self.seed, self.epoch, _SHARD_STREAM).permutation(len(self.shard_rows))
        return [shard_order[i:i + self.block] for i in range(0, len(shard_order), self.block)]

    def block_rows(self, block_index: int, shards: np.ndarray) -> np.ndarray:
        """Global row indices of one block, permuted (int64)."""
        offsets = self.shard_offsets
        rows = np.concatenate(
            [np.arange(offsets[s], offsets[s + 1], dtype=np.int64) for s in shards]
        ) if len(shards) else np.zeros(0, dtype=np.int64)
        return rows[_rng(self.seed, self.epoch, _ROW_STREAM, block_index).permutation(len(rows))]

    def order(self) -> np.ndarray:
        """The whole epoch's global order (for tests and small data; streaming uses `rank_rows`)."""
        parts = [self.block_rows(b, shards) for b, shards in enumerate(self.blocks())]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def rank_count(self, rank: int, world: int) -> int:
        """How many rows rank `rank` of `world` gets in this epoch."""
        _check_rank(rank, world)
        total = self.total_rows
        return max(0, (total - rank + world - 1) // world)

    def rank_rows(self, rank: int, world: int, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (block index, global row indices) of rank `rank`'s part, from its `start`-th row on.

        Rank `rank` takes epoch positions rank, rank + world, rank + 2*world, ...; `start` counts
        rows of this rank (the loader state), so a resumed reader skips whole blocks unread.
        """
        _check_rank(rank, world)
        first_position = rank + start * world  # global epoch position of the first row wanted
        position = 0
        for b, shards in enumerate(self.blocks()):
            size = int(sum(self.shard_rows[s] for s in shards))
            end = position + size
            if end > first_position and size:
                rows = self.block_rows(b, shards)
                lo = max(first_position, position)
                # first position >= lo that belongs to this rank
                lo += (rank - lo) % world
                if lo < end:
                    yield b, rows[lo - position:size:world]
            position = end


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise CsdError(f"rank {rank} of world size {world} is out of range; check the launcher's RANK/WORLD_SIZE")

