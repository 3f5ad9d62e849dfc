"""`--loss csd_alm` (csd_pipeline/loss/csd_alm.py): CE + KD_csd + lambda x KD_alm against the two float64 references
(tests/loss_reference.py for CSD, tests/loss_reference_alm.py for ALM), on a real tokenizer pair and real text, with
the case of tests/loss/test_alm.py (random student, a random teacher's stored top-16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.training import build_loss
from tests.csd_cases import as_float, close
from tests.loss.test_alm import Case
from tests.loss_reference import ReferenceTeacher, reference_loss
from tests.loss_reference_alm import reference_alm_loss
from trainer.config import LossConfig

TOL = 1e-10


def _options(**overrides) -> dict:
    defaults = {f.name: getattr(LossConfig(), f.name) for f in dataclasses.fields(LossConfig)}
    return defaults | {"loss": "csd_alm", "divergence": "kl", "beta": 1.0} | overrides


@pytest.fixture(scope="module")
def case(tokenizer_path):
    return Case(tokenizer_path, "llama-spm/gpt-2")


def _batch(case, loss):
    from csd_pipeline.events.batch import ce_targets

    offsets = case.offsets(case.rows)
    rows = [loss.prepare_row(r, 0, t, case.ctx) for r, t in zip(case.rows, case.tops, strict=True)]
    targets = ce_targets([r["student_ids"] for r in case.rows], [r["student_loss_mask"] for r in case.rows], offsets)
    return loss.collate(rows, offsets), targets


@pytest.mark.parametrize("lam,temperature", [(0.0, 1.0), (30.0, 1.0), (30.0, 1.5)])
def test_loss_and_gradient_are_csd_plus_lambda_alm(case, lam, temperature):
    loss = build_loss("csd_alm", _options(alm_weight=lam, teacher_temperature=temperature))
    batch, (cp, ct) = _batch(case, loss)
    assert batch.num_chunks == batch.alm.num_chunks > 20
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h, weight=w, kd_scale=0.5)
    out.loss.backward()

    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    csd = reference_loss(logits, case.rows, case.s_ref, [ReferenceTeacher(case.t_ref, case.tops)], divergence="kl",
                         beta=1.0, teacher_temperature=temperature)
    alm = reference_alm_loss(logits, case.rows, case.tops, case.s_ref, case.t_ref, temperature=100.0, debias=True)
    assert csd["chunks"] == [alm["chunks"]] == [batch.num_chunks]
    kd = csd["kd"] + lam * alm["kd"]
    (csd["ce"] + 0.5 * kd).backward()
    assert close(out.ce, csd["ce"]) and close(out.kd, kd) and close(out.loss, csd["ce"] + 0.5 * kd)
    assert as_float(alm["kd"]) > 1e-3 and as_float(csd["kd"]) > 1e-3  # both terms are live
    assert close(out.metrics["kd_alm"], alm["kd"]) and close(out.metrics["kd_csd"], csd["kd"])
    g_logits = torch.cat([x.grad for x in logits])
    for grad, expected in ((h.grad, g_logits @ case.weight), (w.grad, g_logits.T @ torch.cat(case.hidden))):
        assert float((grad - expected).abs().max()) <= TOL * max(1.0, float(expected.abs().max()))


def test_the_dynamic_scale_weighs_the_sum_as_much_as_ce(case):
    loss = build_loss("csd_alm", _options(alm_weight=2.0))
    batch, (cp, ct) = _batch(case, loss)
    h, w = torch.cat(case.hidden), case.weight
    out = loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h, weight=w)
    assert close(out.loss, 2 * out.ce) and close(out.kd, out.metrics["kd_csd"] + 2.0 * out.metrics["kd_alm"])


def test_options_are_refused_in_one_line():
    with pytest.raises(CsdError, match=r"^--alm-weight must be a number >= 0, got -1"):
        build_loss("csd_alm", _options(alm_weight=-1.0))
    with pytest.raises(CsdError, match=r"^--kd-combine select works with --loss csd and csd_1to1, not with"):
        build_loss("csd_alm", _options(kd_combine="select"))
    with pytest.raises(CsdError, match=r"^--alm-temperature must be a positive number"):
        build_loss("csd_alm", _options(alm_temperature=0.0))
    assert build_loss("csd_alm", _options(alm_debias=False)).exact_teacher_values is False


@pytest.mark.slow
def test_csd_train_csd_alm_matches_the_direct_loss(trainer_data, trainer_teacher, tmp_path, one_thread):
    """Two steps of `csd-train --loss csd_alm` (FSDP2, float32) on real teacher top-k (SmolLM2-135M-Instruct): the
    first logs the CE and KD of the direct float64 loss on the same first batch, and the loss of its fixed scale."""
    from tests.trainer_cases import direct_first_batch_loss, kd_run_args, metrics
    from trainer.loop import train
    from trainer.options import parse_args

    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss", "csd_alm", "--alm-weight", "30",
                                    "--divergence", "kl", "--kd-scale", "fixed", "--kd-weight", "0.5", steps=2))
    train(config)
    rows = metrics(output)
    row = rows[0]
    assert len(rows) == 2 and row["kd"] > 0 and row["chunks_1to1"] > 0
    out, _ = direct_first_batch_loss(config)
    assert row["ce"] == pytest.approx(float(out.ce), rel=1e-5) and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert float(out.metrics["kd_alm"]) > 0 and float(out.kd) > float(out.metrics["kd_csd"])
    assert row["loss"] == pytest.approx(row["ce"] + 0.5 * row["kd"], rel=1e-9)
    assert (output / "export" / "model.safetensors").is_file()
