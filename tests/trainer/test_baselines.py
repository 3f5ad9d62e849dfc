"""csd-train with the baseline losses (uld, gold, strict) and the shuffled-teacher control: options, and runs
on real teacher top-k (SmolLM2-135M-Instruct) checked against the direct float64 loss of the same batch."""

from __future__ import annotations

import pytest

from csd_pipeline.errors import CsdError
from tests.trainer_cases import direct_first_batch_loss, kd_run_args, metrics
from trainer.loop import train
from trainer.options import parse_args

BASE = ["--aligned", "A", "--output", "O", "--student", "S", "--teacher-logits", "T"]


@pytest.mark.parametrize(("argv", "names"), [
    (["--loss", "ot"], "--loss"),
    (["--kd-scale", "ratio", "--kd-weight", "1.5"], "--kd-weight"),
    (["--kd-scale", "ratio", "--loss", "ce"], "--kd-scale ratio"),
    (["--loss", "gold", "--gold-matched-weight", "1.2"], "--gold-matched-weight"),
    (["--loss", "strict", "--strict-top-k", "-1"], "--strict-top-k"),
    (["--loss", "strict", "--strict-divergence", "tv"], "--strict-divergence"),
    (["--loss", "uld", "--teacher-temperature", "2"], "--teacher-temperature"),
    (["--teacher-control", "reversed"], "--teacher-control"),
])
def test_baseline_options_are_validated(argv, names):
    with pytest.raises(CsdError, match=names):
        parse_args([*BASE, *argv])
    config = parse_args([*BASE, "--loss", "strict", "--strict-top-k", "16", "--kd-scale", "ratio", "--kd-weight", "1",
                         "--teacher-control", "shuffled"])
    loss = config.loss
    assert (loss.strict_top_k, loss.strict_divergence, loss.gold_matched_weight) == (16, "reverse_kl", None)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "extra"), [
    ("uld", ["--kd-scale", "fixed", "--kd-weight", "1.5"]),
    ("gold", ["--gold-matched-weight", "0.5"]),
    ("strict", ["--strict-top-k", "4", "--kd-scale", "ratio", "--kd-weight", "0.5"]),
])
def test_baseline_loss_trains_and_matches_a_direct_loss(trainer_data, trainer_teacher, tmp_path, one_thread,
                                                        kind, extra):
    """One step of `csd-train --loss KIND` (FSDP2, checkpointed rows, float32) logs the CE and KD of the direct
    float64 loss on the same first batch, and the loss its --kd-scale says."""
    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss", kind, *extra, steps=1))
    train(config)
    row = metrics(output)[0]
    assert row["kd"] > 0 and row["chunks_1to1"] > 0
    assert (row["chunks_1toN"] + row["chunks_Mto1"] == 0) == (kind == "strict")
    out, batch = direct_first_batch_loss(config)
    assert row["ce"] == pytest.approx(float(out.ce), rel=1e-5) and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert row["chunks_1to1"] == batch.shape_counts[0][0]
    w = config.loss.kd_weight
    scale = {"fixed": w, "ratio": w, "dynamic": row["ce"] / row["kd"]}[config.loss.kd_scale]
    assert row["kd_scale"] == pytest.approx(scale, rel=1e-9)
    expected = (1 - w) * row["ce"] + w * row["kd"] if config.loss.kd_scale == "ratio" else row["ce"] + scale * row["kd"]
    assert row["loss"] == pytest.approx(expected, rel=1e-9)
    assert (output / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_shuffled_teacher_control_keeps_the_chunks_and_ce(trainer_data, trainer_teacher, tmp_path, one_thread):
    """`--teacher-control shuffled`: the same chunks and CE, another KD (the direct loss of the shuffled batch);
    the same stream with worker processes."""
    rows = {}
    for name, extra in (("real", []), ("shuffled", ["--teacher-control", "shuffled"]),
                        ("workers", ["--teacher-control", "shuffled", "--workers", "2"])):
        output = tmp_path / name
        config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--divergence", "kl", *extra, steps=1))
        train(config)
        rows[name] = metrics(output)[0]
    real, shuffled = rows["real"], rows["shuffled"]
    assert shuffled["ce"] == real["ce"] and shuffled["chunks_1to1"] == real["chunks_1to1"]
    assert abs(shuffled["kd"] - real["kd"]) > 1e-3 * real["kd"]
    assert rows["workers"]["kd"] == shuffled["kd"]
    out, _ = direct_first_batch_loss(config)
    assert shuffled["kd"] == pytest.approx(float(out.kd), rel=1e-4)
