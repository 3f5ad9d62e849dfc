"""csd-train with the CSD loss on real teacher top-k (SmolLM2-135M-Instruct) and its data checks."""

from __future__ import annotations

import json
import shutil

import pytest

from csd_pipeline.errors import CsdError
from tests.trainer_cases import direct_first_batch_loss, kd_run_args, metrics
from trainer.loop import train
from trainer.options import parse_args


@pytest.fixture(scope="module")
def csd_run(trainer_data, trainer_teacher, tmp_path_factory, one_thread):
    output = tmp_path_factory.mktemp("csd") / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output)))
    return output


@pytest.mark.slow
def test_csd_steps_match_a_direct_loss_on_the_same_batch(trainer_data, trainer_teacher, csd_run):
    rows = metrics(csd_run)
    first = rows[0]
    assert first["kd"] > 0 and first["chunks_1to1"] > 0 and first["chunks_Mto1"] + first["chunks_1toN"] > 0
    for row in rows:  # L = CE + sg(CE/KD) KD: its value is 2 CE with one micro-step
        assert row["loss"] == pytest.approx(2 * row["ce"], rel=1e-12)
        assert 0 < row["teacher_event_mass"] <= 1 and 0 <= row["student_rest_mass"] <= 1
    # independent path: the same first batch, the same initial weights, dense logits, no FSDP
    out, batch = direct_first_batch_loss(parse_args(kd_run_args(trainer_data, trainer_teacher, csd_run)))
    assert first["ce"] == pytest.approx(float(out.ce), rel=1e-5)
    assert first["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert first["chunks_1to1"] == batch.shape_counts[0][0]


@pytest.mark.slow
def test_csd_1to1_uses_only_one_to_one_chunks(trainer_data, trainer_teacher, csd_run, tmp_path):
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss", "csd_1to1", "--steps", "1")))
    row, reference = metrics(output)[0], metrics(csd_run)[0]
    assert row["chunks_1to1"] == reference["chunks_1to1"] > 0
    assert row["chunks_1toN"] == row["chunks_Mto1"] == row["chunks_MtoN"] == 0
    assert row["ce"] == reference["ce"]  # same data, same weights: only the KD term differs


@pytest.mark.slow
@pytest.mark.parametrize(("scale", "weight"), [("dynamic", 2.0), ("fixed", 0.5)])
def test_kd_scale_and_weight_set_the_kd_multiplier(trainer_data, trainer_teacher, csd_run, tmp_path, scale, weight):
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--steps", "1", "--kd-scale", scale,
                          "--kd-weight", str(weight))))
    row, reference = metrics(output)[0], metrics(csd_run)[0]
    assert (row["ce"], row["kd"]) == (reference["ce"], reference["kd"])  # same first step before the update
    expected = weight * row["ce"] / row["kd"] if scale == "dynamic" else weight
    assert row["kd_scale"] == pytest.approx(expected, rel=1e-12)
    assert row["loss"] == pytest.approx(row["ce"] + expected * row["kd"], rel=1e-12)


@pytest.mark.slow
def test_teacher_temperature_reaches_the_loss(trainer_data, trainer_teacher, csd_run, tmp_path):
    """`--teacher-temperature` changes the first step's KD (not its CE) to the direct loss's value."""
    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--steps", "1", "--teacher-temperature", "1.5"))
    train(config)
    row, reference = metrics(output)[0], metrics(csd_run)[0]
    assert row["ce"] == reference["ce"] and row["kd"] != pytest.approx(reference["kd"], rel=1e-3)
    out, _ = direct_first_batch_loss(config, teacher_temperature=1.5)
    assert row["kd"] == pytest.approx(float(out.kd), rel=1e-4)


@pytest.mark.slow
def test_teacher_computed_from_other_aligned_data_is_refused(trainer_data, trainer_teacher, tmp_path):
    forged = tmp_path / "topk"
    shutil.copytree(trainer_teacher, forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["aligned"]["manifest_sha256"] = "0" * 64
    (forged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CsdError, match=r"another aligned directory.*re-run `csd-pipeline teacher-logits"):
        train(parse_args(kd_run_args(trainer_data, forged, tmp_path / "run")))


@pytest.mark.slow
def test_kd_teacher_without_its_directory_is_refused(trainer_data, trainer_teacher, tmp_path):
    with pytest.raises(CsdError, match="--kd-teachers names teacher 1"):
        train(parse_args(kd_run_args(trainer_data, trainer_teacher, tmp_path / "run", "--kd-teachers", "0:1,1:0.5")))


@pytest.mark.slow
def test_csd_resume_with_worker_processes_matches_the_in_process_run(trainer_data, trainer_teacher, csd_run,
                                                                      tmp_path):
    # the stream is the same whatever the number of data-loader workers, and resumes exactly
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--workers", "2", "stop_at_step=2")))
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--workers", "2", "--resume")))
    keys = ("step", "loss", "ce", "kd", "lr", "grad_norm", "chunks_1to1", "chunks_1toN", "chunks_Mto1", "chunks_MtoN")
    assert [{k: r[k] for k in keys} for r in metrics(output)] == [{k: r[k] for k in keys} for r in metrics(csd_run)]


def second_teacher(trainer_teacher, tmp_path):
    """Teacher 1 of train_short: the same tokenizer as teacher 0, so its top-k is the same file content;
    only the index recorded in the manifest differs."""
    second = tmp_path / "topk1"
    shutil.copytree(trainer_teacher, second)
    manifest = json.loads((second / "manifest.json").read_text())
    manifest["config"]["teacher_index"] = 1
    (second / "manifest.json").write_text(json.dumps(manifest))
    return second


@pytest.mark.slow
def test_two_teachers_are_weighted_and_counted_apart(trainer_data, trainer_teacher, csd_run, tmp_path):
    second = second_teacher(trainer_teacher, tmp_path)
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--teacher-logits", str(second),
                          "--kd-teachers", "0:1.0,1:0.5", "--steps", "1")))
    row, single = metrics(output)[0], metrics(csd_run)[0]
    assert row["teacher0_chunks"] == row["teacher1_chunks"] == single["chunks_1to1"] + single["chunks_1toN"] + \
        single["chunks_Mto1"] + single["chunks_MtoN"]
    assert row["teacher1_kd"] == pytest.approx(row["teacher0_kd"], rel=1e-12)
    assert row["kd"] == pytest.approx(1.5 * single["kd"], rel=1e-6)  # KD = 1.0 KD_0 + 0.5 KD_1
    assert row["ce"] == single["ce"] and row["chunks_1to1"] == 2 * single["chunks_1to1"]


@pytest.mark.slow
def test_two_teachers_selected_per_group(trainer_data, trainer_teacher, csd_run, tmp_path):
    """--kd-combine select with two identical teachers: every group ties, so teacher 0 is chosen everywhere
    and KD is the single teacher's (one mean over the kept chunks), not the sum's 2 KD."""
    second = second_teacher(trainer_teacher, tmp_path)
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--teacher-logits", str(second),
                          "--kd-combine", "select", "--steps", "1")))
    row, single = metrics(output)[0], metrics(csd_run)[0]
    chunks = sum(single[f"chunks_{key}"] for key in ("1to1", "1toN", "Mto1", "MtoN"))
    assert (row["teacher0_chunks"], row["teacher1_chunks"]) == (chunks, 0)
    assert (row["teacher0_share"], row["teacher1_share"]) == (1.0, 0.0)
    assert row["kd"] == pytest.approx(single["kd"], rel=1e-6) and row["ce"] == single["ce"]


@pytest.mark.slow
def test_loss_keep_dtype_reaches_the_loss(trainer_data, trainer_teacher, csd_run, tmp_path):
    """`--loss-reuse-mb --loss-reuse-dtype float16` keeps 16-bit log-probabilities: the first step's CE and KD
    (the forward) are the default run's; the gradient differs only by their rounding, so the loss stays close.
    (Over three steps: on some batches the rounding moves the first step's float32 gradient norm by nothing.)"""
    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss-reuse-mb", "4096",
                                    "--loss-reuse-dtype", "float16"))
    assert config.loss.loss_reuse_dtype == "float16"
    train(config)
    rows, references = metrics(output), metrics(csd_run)
    row, reference = rows[0], references[0]
    assert row["ce"] == pytest.approx(reference["ce"], rel=1e-6) and row["kd"] == pytest.approx(reference["kd"], rel=1e-6)
    for row, reference in zip(rows, references, strict=True):
        assert row["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-2)
    assert [r["grad_norm"] for r in rows] != [r["grad_norm"] for r in references]  # the 16-bit kept chunks were used


@pytest.mark.slow
def test_bf16_parameters_give_the_float32_first_step(trainer_data, trainer_teacher, csd_run, tmp_path):
    # bf16 parameters are the GPU default; on the CPU the same FSDP2 mixed-precision path runs. The layers hand
    # float32 to the final norm, so the head's input must be cast to the head's dtype (make gpu-check found it).
    output = tmp_path / "run"
    train(parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--steps", "1", "--dtype", "bfloat16")))
    rows, reference = metrics(output), metrics(csd_run)[0]
    assert rows[0]["chunks_1to1"] == reference["chunks_1to1"] > 0
    assert rows[0]["ce"] == pytest.approx(reference["ce"], rel=2e-2)  # bf16 rounding of weights and activations
    assert rows[0]["kd"] == pytest.approx(reference["kd"], rel=5e-2)
    assert rows[0]["ce"] != reference["ce"]  # it did run in bf16
    assert all(row["grad_norm"] > 0 for row in rows)
