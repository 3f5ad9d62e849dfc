"""csd-train with the baseline losses (uld, gold, strict) and the shuffled-teacher control: options, and runs
on real teacher top-k (SmolLM2-135M-Instruct) checked against the direct float64 loss of the same batch."""

from __future__ import annotations

import json

import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.baselines import baseline_loss
from csd_pipeline.loss.csd import csd_loss
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


def _args(data, teacher, output, *extra):
    return ["--aligned", str(data["train_short"]), "--teacher-logits", str(teacher), "--student-config",
            str(data["student_config"]), "--student-tokenizer", "llama-spm", "--output", str(output), "--steps", "1",
            "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "0",
            "--workers", "0", "--no-progress", *extra]


def _first_metrics(output) -> dict:
    return json.loads((output / "metrics.jsonl").read_text().splitlines()[0])


def _direct_first_batch(config):
    """The first batch of the run and its loss at the initial weights: dense float64 logits, no FSDP."""
    from trainer.data import TrainingData
    from trainer.model import build_student

    data = TrainingData.open(config)
    loader = data.loader(0, 1, None)
    batch = next(loader)
    loader.close()
    model = build_student(config.student, config.seed, data.student_vocab.size)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(batch.input_ids), position_ids=torch.as_tensor(batch.position_ids),
                       use_cache=False).logits
    flat = logits.reshape(-1, logits.shape[-1]).double()
    counts = [sum(batch.shape_counts[0])]
    loss = config.loss
    if loss.is_baseline:
        out = baseline_loss(loss.loss, ce_positions=batch.ce_positions, ce_tokens=batch.ce_tokens, logits=flat,
                            teachers=batch.teachers, global_chunk_counts=counts, divergence=loss.divergence,
                            **loss.baseline_options())
    else:
        out = csd_loss(ce_positions=batch.ce_positions, ce_tokens=batch.ce_tokens, teachers=batch.teachers, logits=flat,
                       global_chunk_counts=counts, beta=loss.beta, divergence=loss.divergence)
    return out, batch


@pytest.fixture(scope="module")
def quiet_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "extra"), [
    ("uld", ["--kd-scale", "fixed", "--kd-weight", "1.5"]),
    ("gold", ["--gold-matched-weight", "0.5"]),
    ("strict", ["--strict-top-k", "4", "--kd-scale", "ratio", "--kd-weight", "0.5"]),
])
def test_baseline_loss_trains_and_matches_a_direct_loss(trainer_data, trainer_teacher, tmp_path, quiet_threads,
                                                        kind, extra):
    """One step of `csd-train --loss KIND` (FSDP2, checkpointed rows, float32) logs the CE and KD of the direct
    float64 loss on the same first batch, and the loss its --kd-scale says."""
    output = tmp_path / "run"
    config = parse_args(_args(trainer_data, trainer_teacher, output, "--loss", kind, *extra))
    train(config)
    row = _first_metrics(output)
    assert row["kd"] > 0 and row["chunks_1to1"] > 0
    assert (row["chunks_1toN"] + row["chunks_Mto1"] == 0) == (kind == "strict")
    out, batch = _direct_first_batch(config)
    assert row["ce"] == pytest.approx(float(out.ce), rel=1e-5) and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert row["chunks_1to1"] == batch.shape_counts[0][0]
    w = config.loss.kd_weight
    scale = {"fixed": w, "ratio": w, "dynamic": row["ce"] / row["kd"]}[config.loss.kd_scale]
    assert row["kd_scale"] == pytest.approx(scale, rel=1e-9)
    expected = (1 - w) * row["ce"] + w * row["kd"] if config.loss.kd_scale == "ratio" else row["ce"] + scale * row["kd"]
    assert row["loss"] == pytest.approx(expected, rel=1e-9)
    assert (output / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_shuffled_teacher_control_keeps_the_chunks_and_ce(trainer_data, trainer_teacher, tmp_path, quiet_threads):
    """`--teacher-control shuffled`: the same chunks and CE, another KD (the direct loss of the shuffled batch);
    the same stream with worker processes."""
    rows = {}
    for name, extra in (("real", []), ("shuffled", ["--teacher-control", "shuffled"]),
                        ("workers", ["--teacher-control", "shuffled", "--workers", "2"])):
        output = tmp_path / name
        config = parse_args(_args(trainer_data, trainer_teacher, output, "--divergence", "kl", *extra))
        train(config)
        rows[name] = _first_metrics(output)
    real, shuffled = rows["real"], rows["shuffled"]
    assert shuffled["ce"] == real["ce"] and shuffled["chunks_1to1"] == real["chunks_1to1"]
    assert abs(shuffled["kd"] - real["kd"]) > 1e-3 * real["kd"]
    assert rows["workers"]["kd"] == shuffled["kd"]
    out, _ = _direct_first_batch(config)
    assert shuffled["kd"] == pytest.approx(float(out.kd), rel=1e-4)
