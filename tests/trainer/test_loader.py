"""The loader's stream: the same for any number of workers, resumed exactly from any micro-batch's
state, and an older loader state refused in one line (CE data of `trainer_data["eval"]`: 3 shards)."""

from __future__ import annotations

import numpy as np
import pytest

from csd_pipeline.errors import CsdError


def _data(trainer_data, tmp_path, *extra):
    from trainer.data import TrainingData
    from trainer.options import parse_args

    return TrainingData.open(parse_args([
        "--aligned", str(trainer_data["eval"]), "--student-config", str(trainer_data["student_config"]),
        "--student-tokenizer", "llama-spm", "--output", str(tmp_path / "run"), "--loss", "ce", "--seq-len", "128",
        "--batch-size", "1", "--shuffle-block", "2", "--data-lanes", "3", "--no-progress", *extra]))


def _take(loader, n: int) -> list:
    try:
        return [next(loader) for _ in range(n)]
    finally:
        loader.close()


def _same(a, b) -> bool:
    return np.array_equal(a.input_ids, b.input_ids) and a.lane == b.lane and a.state == b.state


def test_the_stream_is_the_same_for_any_workers_and_resumes_exactly(trainer_data, tmp_path):
    data = _data(trainer_data, tmp_path, "--workers", "0")
    reference = _take(data.loader(0, 1, None), 40)  # 26 rows: the run crosses epochs in every lane
    assert reference[-1].state["epoch"] >= 1 and [b.lane for b in reference[:6]] == [0, 1, 2, 0, 1, 2]
    for workers in ("2", "3"):  # 2: one worker serves two lanes; 3: one lane each
        with_workers = _take(_data(trainer_data, tmp_path, "--workers", workers).loader(0, 1, None), 40)
        assert all(_same(a, b) for a, b in zip(reference, with_workers, strict=True))
    for stop in (0, 7, 23):
        resumed = _take(data.loader(0, 1, reference[stop].state), 40 - stop - 1)
        assert all(_same(a, b) for a, b in zip(reference[stop + 1:], resumed, strict=True))


def test_each_of_two_ranks_resumes_exactly(trainer_data, tmp_path):
    data = _data(trainer_data, tmp_path, "--workers", "0")
    for rank in (0, 1):
        reference = _take(data.loader(rank, 2, None), 16)  # 13 rows per rank: past its first epoch
        assert reference[-1].state["epoch"] >= 1
        resumed = _take(data.loader(rank, 2, reference[4].state), 11)
        assert all(_same(a, b) for a, b in zip(reference[5:], resumed, strict=True))


def test_each_epoch_of_a_lane_ends_with_its_own_micro_batch(trainer_data, tmp_path):
    data = _data(trainer_data, tmp_path, "--workers", "0")
    windows = {}
    for batch in _take(data.loader(0, 1, None), 40):
        lane = batch.state["lanes"][batch.lane]
        epoch = lane["epoch"] - (lane["position"] == 0)  # the epoch the batch's windows belong to
        windows[batch.lane, epoch] = windows.get((batch.lane, epoch), 0) + batch.windows
    from trainer.shuffle import EpochPlan

    rows = tuple(s.rows for s in data.aligned.shards)
    for lane in range(3):
        assert windows[lane, 0] == EpochPlan(0, 0, rows, 2).lane_count(lane, 3)


def test_an_older_or_other_loader_state_is_refused_in_one_line(trainer_data, tmp_path):
    data = _data(trainer_data, tmp_path, "--workers", "0")
    with pytest.raises(CsdError, match=r"version 1 \(every rank read every shard.*start a new --output") as err:
        data.loader(0, 1, {"version": 1, "epoch": 0, "position": 3})
    assert "\n" not in str(err.value)
    state = _take(data.loader(0, 1, None), 1)[0].state
    with pytest.raises(CsdError, match="3 lanes per rank, this run has 2; resume with the --data-lanes"):
        _data(trainer_data, tmp_path, "--workers", "0", "--data-lanes", "2").loader(0, 1, state)
