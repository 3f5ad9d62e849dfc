"""The data order is a pure function of (seed, epoch, shard sizes, lanes); lanes split it disjointly,
each reading only the shards of its own span (bytes per rank and per worker: `test_bytes_*`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from csd_pipeline.errors import CsdError
from trainer.shuffle import EpochPlan, lanes_per_rank

shard_sizes = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def shard_of(global_rows, shard_offsets) -> np.ndarray:
    """The shard index of each global row index."""
    return np.searchsorted(shard_offsets, np.asarray(global_rows, dtype=np.int64), side="right") - 1


def lane_rows(plan: EpochPlan, lane: int, lanes: int, start: int = 0) -> list[int]:
    return [r for _, chunk in plan.lane_rows(lane, lanes, start) for r in chunk.tolist()]


@settings(max_examples=150, deadline=None)
@given(sizes=shard_sizes, seed=seeds, epoch=st.integers(0, 50), block=st.integers(1, 5), lanes=st.integers(1, 6))
def test_every_epoch_is_a_permutation(sizes, seed, epoch, block, lanes):
    plan = EpochPlan(seed, epoch, tuple(sizes), block)
    order = plan.order(lanes)
    assert sorted(order.tolist()) == list(range(sum(sizes)))  # nothing duplicated or lost
    again = EpochPlan(seed, epoch, tuple(sizes), block).order(lanes)
    assert np.array_equal(order, again)  # pure: the same inputs give the same order


@settings(max_examples=150, deadline=None)
@given(sizes=shard_sizes, seed=seeds, epoch=st.integers(0, 5), block=st.integers(1, 4), lanes=st.integers(1, 8))
def test_lanes_get_disjoint_spans_covering_the_epoch_and_read_only_their_shards(sizes, seed, epoch, block, lanes):
    plan = EpochPlan(seed, epoch, tuple(sizes), block)
    offsets = plan.shard_offsets
    # the reference: the shards in the epoch's order, laid end to end, cut into `lanes` equal spans
    sequence = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in plan.shard_order()] + [[]])
    parts = []
    for lane in range(lanes):
        rows = lane_rows(plan, lane, lanes)
        first, end = lane * len(sequence) // lanes, (lane + 1) * len(sequence) // lanes
        assert sorted(rows) == sorted(sequence[first:end].astype(int).tolist())
        assert len(rows) == plan.lane_count(lane, lanes)
        assert set(shard_of(rows, offsets).tolist()) == set(plan.lane_shards(lane, lanes)) - \
            {s for s in range(len(sizes)) if sizes[s] == 0}
        for block_, chunk in plan.lane_rows(lane, lanes):
            assert len(block_.parts) <= block and set(shard_of(chunk, offsets).tolist()) <= set(block_.shards)
        parts.append(rows)
    counts = [len(p) for p in parts]
    assert max(counts) - min(counts) <= 1  # no row dropped or padded: sizes differ by at most one
    flat = [r for part in parts for r in part]
    assert len(flat) == len(set(flat)) == sum(sizes)


@settings(max_examples=100, deadline=None)
@given(sizes=shard_sizes, seed=seeds, lanes=st.integers(1, 4), block=st.integers(1, 3), data=st.data())
def test_resuming_at_any_position_continues_the_same_sequence(sizes, seed, lanes, block, data):
    plan = EpochPlan(seed, 1, tuple(sizes), block)
    lane = data.draw(st.integers(0, lanes - 1))
    full = lane_rows(plan, lane, lanes)
    start = data.draw(st.integers(0, len(full)))
    assert lane_rows(plan, lane, lanes, start) == full[start:]


def test_epochs_and_seeds_differ_and_rows_mix_across_the_shards_of_a_block():
    sizes = (50, 30, 0, 70, 20, 40)
    a = EpochPlan(1, 0, sizes, 2).order(2)
    assert not np.array_equal(a, EpochPlan(1, 1, sizes, 2).order(2))
    assert not np.array_equal(a, EpochPlan(2, 0, sizes, 2).order(2))
    assert not np.array_equal(a, EpochPlan(1, 0, sizes, 2).order(3))
    plan = EpochPlan(1, 0, sizes, 3)
    offsets = plan.shard_offsets
    for block, rows in plan.lane_rows(0, 1):
        shard = shard_of(rows, offsets)
        assert len(set(shard.tolist())) == len([p for p in block.parts if p[2] > p[1]]) > 1
        assert (shard[1:] != shard[:-1]).mean() > 0.3  # rows of the block's shards interleave
    # from epoch to epoch a lane's span covers other shards
    assert len({tuple(EpochPlan(1, e, sizes, 2).lane_shards(0, 2)) for e in range(6)}) > 1


def test_lanes_per_rank_gives_every_lane_a_row():
    assert lanes_per_rank(100, 4, 2) == 2
    assert lanes_per_rank(5, 4, 2) == 1
    assert lanes_per_rank(1000, 64, 8) == 8
    with pytest.raises(CsdError, match="--data-lanes"):
        lanes_per_rank(100, 4, 0)


def bytes_read(plan: EpochPlan, shard_bytes, world: int, lanes: int, workers: int) -> np.ndarray:
    """[rank, worker] bytes of the shards each data-loader worker of each rank opens in the epoch
    (worker w serves lanes w, w + workers, ...; a shard two lanes touch is read by both)."""
    out = np.zeros((world, workers), dtype=np.int64)
    for rank in range(world):
        for lane in range(lanes):
            shards = plan.lane_shards(rank * lanes + lane, world * lanes)
            out[rank, lane % workers] += int(sum(shard_bytes[s] for s in shards))
    return out


@pytest.mark.parametrize("world", [1, 2, 8, 64])
def test_bytes_each_rank_and_worker_reads_shrink_with_ranks(world):
    """Issue 31 item 4: bytes read by each rank <= 1.2 x total / W + one shard, and the same for each
    loader worker (of its rank's share), over 4,096 shards of uneven sizes."""
    rng = np.random.default_rng(7)
    rows = rng.integers(600, 1400, size=4096)
    shard_bytes = rows * rng.integers(900, 1100, size=4096)  # bytes per row vary by shard
    total, largest = int(shard_bytes.sum()), int(shard_bytes.max())
    for epoch in (0, 1):
        plan = EpochPlan(3, epoch, tuple(rows.tolist()), 4)
        for lanes, workers in ((2, 1), (2, 2), (4, 2), (4, 4)):
            read = bytes_read(plan, shard_bytes, world, lanes, workers)
            assert read.sum(axis=1).max() <= 1.2 * total / world + largest
            assert read.max() <= 1.2 * total / (world * workers) + largest
            if world == 1:  # every shard once, and a shard cut between two lanes once more
                assert total <= read.sum() <= total + (lanes - 1) * largest
