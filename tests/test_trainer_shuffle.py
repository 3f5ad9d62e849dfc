"""The data order is a pure function of (seed, epoch, shard sizes); ranks split it disjointly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.shuffle import EpochPlan

shard_sizes = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def shard_of(global_rows, shard_offsets) -> np.ndarray:
    """The shard index of each global row index."""
    return np.searchsorted(shard_offsets, np.asarray(global_rows, dtype=np.int64), side="right") - 1


@settings(max_examples=150, deadline=None)
@given(sizes=shard_sizes, seed=seeds, epoch=st.integers(0, 50), block=st.integers(1, 5))
def test_every_epoch_is_a_permutation(sizes, seed, epoch, block):
    plan = EpochPlan(seed, epoch, tuple(sizes), block)
    order = plan.order()
    assert sorted(order.tolist()) == list(range(sum(sizes)))  # nothing duplicated or lost
    again = EpochPlan(seed, epoch, tuple(sizes), block).order()
    assert np.array_equal(order, again)  # pure: the same inputs give the same order


@settings(max_examples=150, deadline=None)
@given(sizes=shard_sizes, seed=seeds, epoch=st.integers(0, 5), block=st.integers(1, 4),
       world=st.integers(1, 6))
def test_ranks_get_disjoint_parts_covering_the_epoch(sizes, seed, epoch, block, world):
    plan = EpochPlan(seed, epoch, tuple(sizes), block)
    order = plan.order()
    parts = []
    for rank in range(world):
        rows = [r for _, chunk in plan.rank_rows(rank, world) for r in chunk.tolist()]
        assert rows == order[rank::world].tolist()  # reference: stride the whole epoch order
        assert len(rows) == plan.rank_count(rank, world)
        parts.append(rows)
    flat = [r for part in parts for r in part]
    assert len(flat) == len(set(flat)) == sum(sizes)


@settings(max_examples=100, deadline=None)
@given(sizes=shard_sizes, seed=seeds, world=st.integers(1, 4), data=st.data())
def test_resuming_at_any_position_continues_the_same_sequence(sizes, seed, world, data):
    plan = EpochPlan(seed, 1, tuple(sizes), 2)
    rank = data.draw(st.integers(0, world - 1))
    full = [r for _, chunk in plan.rank_rows(rank, world) for r in chunk.tolist()]
    start = data.draw(st.integers(0, len(full)))
    resumed = [r for _, chunk in plan.rank_rows(rank, world, start) for r in chunk.tolist()]
    assert resumed == full[start:]


def test_epochs_and_seeds_differ_and_blocks_bound_the_shards_in_memory():
    sizes = (50, 30, 0, 70, 20, 40)
    a = EpochPlan(1, 0, sizes, 2).order()
    assert not np.array_equal(a, EpochPlan(1, 1, sizes, 2).order())
    assert not np.array_equal(a, EpochPlan(2, 0, sizes, 2).order())
    plan = EpochPlan(1, 0, sizes, 2)
    offsets = plan.shard_offsets
    for b, shards in enumerate(plan.blocks()):
        shard = shard_of(plan.block_rows(b, shards), offsets)
        assert set(shard.tolist()) <= set(shards.tolist()) and len(shards) <= 2
