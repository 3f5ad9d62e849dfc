"""Each rank reads what it trains on: the bytes of aligned and teacher top-k shards that the real
loader reads, counted at the file, for simulated ranks in one process (issue 31 item 4).

The plan-level bound for W = 1, 2, 8, 64 over many shards is `test_shuffle.test_bytes_*`."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.trainer_cases import counted_file_reads, lane_epoch_reads, make_read_store

WORLD = 2


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, tokenizer_path) -> dict:
    """22 aligned shards (~1 KB of text each) and their teacher top-k (`make_read_store`)."""
    return make_read_store(tmp_path_factory.mktemp("reads"))


def _data(store: dict, tmp_path, trainer_data):
    from trainer.data import TrainingData
    from trainer.options import parse_args

    return TrainingData.open(parse_args([
        "--aligned", str(store["aligned"]), "--teacher-logits", str(store["topk"]), "--student-config",
        str(trainer_data["student_config"]), "--student-tokenizer", "llama-spm", "--output", str(tmp_path / "run"),
        "--seq-len", "128", "--batch-size", "2", "--workers", "0", "--shuffle-block", "2", "--data-lanes", "2",
        "--no-progress"]))


@pytest.mark.slow
def test_each_rank_and_worker_reads_only_its_shards(small_store, trainer_data, tmp_path):
    """W = 2 against W = 1, counting the bytes the readers take from the files. The total is what one rank
    reads for the whole epoch through the same readers: pyarrow reads a file's last 64 KiB for its footer
    and then the row groups it needs, so a teacher shard smaller than that is read about twice, whatever W."""
    from trainer.shuffle import EpochPlan

    data = _data(small_store, tmp_path, trainer_data)
    rows = tuple(s.rows for s in data.aligned.shards)
    with counted_file_reads() as counts:
        alone = lane_epoch_reads(data, 0, 1, counts)
        ranks = [lane_epoch_reads(data, rank, WORLD, counts) for rank in range(WORLD)]
    whole = Counter()
    for read, _ in alone:
        whole.update(read)
    total, largest = sum(whole.values()), max(whole.values())
    assert set(whole) == set(range(len(rows))) and sum(w for _, w in alone) == sum(rows)
    trained = 0
    for rank, lanes in enumerate(ranks):
        assert len(lanes) == 2
        for worker, (read, windows) in enumerate(lanes):  # one lane per worker
            plan = EpochPlan(data.config.seed, 0, rows, 2)
            assert set(read) == set(plan.lane_shards(rank * 2 + worker, WORLD * 2))  # exactly its span's shards
            assert sum(read.values()) <= 1.2 * total / (WORLD * 2) + largest
            trained += windows
        assert sum(sum(read.values()) for read, _ in lanes) <= 1.2 * total / WORLD + largest
    assert trained == sum(rows)  # together the ranks trained on as many windows as the epoch has
