"""`--kd-chunk-weight advantage` (csd_pipeline/loss/chunk_weights.py) for CSD and ALM against the float64
references (tests/loss_reference.py, tests/loss_reference_alm.py), whose weights come from their own walk over
each chunk's observed tokens; the default (`none`) leaves the losses as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.events.alm_rows import build_alm_rows, collate_alm_rows
from csd_pipeline.events.batch import ce_targets, collate_events
from csd_pipeline.events.row_events import build_row_events
from csd_pipeline.loss.alm import alm_loss
from csd_pipeline.loss.csd import csd_loss
from csd_pipeline.loss.training import build_loss
from tests.csd_cases import PairCase, as_float, close, topk_from_dense
from tests.loss_reference import ReferenceTeacher, observed_chunk_logliks, reference_loss
from tests.loss_reference_alm import reference_alm_loss

TOL = 1e-10
HIDDEN = 16
SCALE, CAP = 1.5, 3.0


def advantage(log_t: float, log_s: float) -> float:
    return min(max((log_t - log_s) / SCALE, 0.0), CAP)


class Case(PairCase):
    """Two real aligned rows (llama-spm student, gpt-2 teacher), a random student and a random teacher's top-16."""

    def __init__(self, tokenizer_path):
        super().__init__(tokenizer_path, "llama-spm", "gpt-2", [5, 7], HIDDEN, 1)
        g = self.generator
        self.hidden, self.tops = [], []
        for r in self.rows:
            s_ids = torch.as_tensor(r["student_ids"].astype(np.int64))
            h = torch.randn(len(s_ids), HIDDEN, generator=g, dtype=torch.float64)
            h[:-1] += (torch.rand(len(s_ids) - 1, generator=g) < 0.7).double()[:, None] * self.weight[s_ids[1:]] * 0.5
            self.hidden.append(0.3 * h)
            t_ids = torch.as_tensor(r["teacher0_ids"].astype(np.int64))
            t = torch.randn(len(t_ids), self.t.vocab.size, generator=g, dtype=torch.float64) * 2.0
            t[torch.arange(len(t_ids) - 1), t_ids[1:]] += (torch.rand(len(t_ids) - 1, generator=g) < 0.7).double() * 12
            self.tops.append(topk_from_dense(r, torch.log_softmax(t, -1).numpy(), 16))
        self.offsets_ = self.offsets(self.rows)
        self.targets = ce_targets([r["student_ids"] for r in self.rows], [r["student_loss_mask"] for r in self.rows],
                                  self.offsets_)


@pytest.fixture(scope="module")
def case(tokenizer_path):
    return Case(tokenizer_path)


def _gradients_match(case, h, w, logits):
    g_logits = torch.cat([x.grad for x in logits])
    for grad, expected in ((h.grad, g_logits @ case.weight), (w.grad, g_logits.T @ torch.cat(case.hidden))):
        assert float((grad - expected).abs().max()) <= TOL * max(1.0, float(expected.abs().max()))


def test_the_weights_spread_over_zero_the_middle_and_the_cap(case):
    """The case is one where the weighting matters: some chunks get 0, some the cap, some in between."""
    weights = [advantage(*pair) for x, r, t in zip(case.hidden, case.rows, case.tops, strict=True)
               for pair in observed_chunk_logliks(torch.softmax(x @ case.weight.T, -1), r, 0, t)]
    assert min(weights) == 0 and max(weights) == CAP and sum(0 < w < CAP for w in weights) > 5


def test_csd_with_advantage_weights_matches_the_reference(case):
    events = collate_events([build_row_events(r, 0, t, case.ctx) for r, t in zip(case.rows, case.tops, strict=True)],
                            case.offsets_)
    cp, ct = case.targets
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = csd_loss(hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[events], divergence="kl", beta=2.0,
                   chunk_size=29, kd_scale=1.0, chunk_weighting=(SCALE, CAP))
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_loss(logits, case.rows, case.s_ref, [ReferenceTeacher(case.t_ref, case.tops)], divergence="kl",
                         beta=2.0, chunk_weights=advantage)
    ref_kd = ref["kd"]
    (ref["ce"] + ref_kd).backward()  # kd scale 1, as the implementation's
    assert events.num_chunks == ref["chunks"][0] > 20
    assert close(out.ce, ref["ce"]) and close(out.kd, ref_kd), (as_float(out.kd), as_float(ref_kd))
    _gradients_match(case, h, w, logits)
    plain = csd_loss(logits=torch.cat(case.hidden) @ case.weight.T, ce_positions=cp, ce_tokens=ct, teachers=[events],
                     divergence="kl", beta=2.0)
    assert abs(as_float(plain.kd) - as_float(out.kd)) > 1e-2 * as_float(plain.kd)


def test_alm_with_advantage_weights_matches_the_reference(case):
    rows = collate_alm_rows([build_alm_rows(r, 0, t, case.ctx) for r, t in zip(case.rows, case.tops, strict=True)],
                            case.offsets_)
    cp, ct = case.targets
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[rows], hidden=h, weight=w, temperature=10.0,
                   chunk_size=29, kd_scale=1.0, chunk_weighting=(SCALE, CAP))
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_alm_loss(logits, case.rows, case.tops, case.s_ref, case.t_ref, temperature=10.0,
                             chunk_weights=advantage)
    ref["loss"].backward()
    assert rows.num_chunks == ref["chunks"] and close(out.kd, ref["kd"]) and close(out.loss, ref["loss"])
    _gradients_match(case, h, w, logits)


OPTIONS = {"kd_combine": "sum", "teacher_temperature": 1.0, "teacher_control": "none", "spelling": "sum",
           "divergence": "kl", "beta": 1.0, "kd_scale": "fixed", "kd_weight": 0.5, "loss_chunk_size": 0,
           "loss_reuse_mb": 0, "loss_reuse_dtype": "float32", "alm_temperature": 100.0, "alm_debias": True,
           "gold_matched_weight": None, "strict_top_k": 0, "strict_divergence": "reverse_kl",
           "kd_chunk_weight": "advantage", "kd_chunk_weight_scale": SCALE, "kd_chunk_weight_max": CAP}


def test_the_training_losses_pass_the_weighting(case):
    """`build_loss` with --kd-chunk-weight advantage gives the weighted loss; none gives the unweighted one."""
    events = collate_events([build_row_events(r, 0, t, case.ctx) for r, t in zip(case.rows, case.tops, strict=True)],
                            case.offsets_)
    cp, ct = case.targets
    logits = torch.cat(case.hidden) @ case.weight.T
    direct = csd_loss(logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[events], divergence="kl", beta=1.0,
                      chunk_weighting=(SCALE, CAP))
    built = build_loss("csd", OPTIONS)(ce_positions=cp, ce_tokens=ct, teachers=[events], logits=logits)
    unweighted = build_loss("csd", {**OPTIONS, "kd_chunk_weight": "none"})(ce_positions=cp, ce_tokens=ct,
                                                                           teachers=[events], logits=logits)
    assert as_float(built.kd) == as_float(direct.kd) != as_float(unweighted.kd)
    assert as_float(unweighted.kd) == as_float(csd_loss(logits=logits, ce_positions=cp, ce_tokens=ct,
                                                        teachers=[events], divergence="kl", beta=1.0).kd)


REFUSALS = {
    "uld": r"--kd-chunk-weight works with --loss csd, csd_1to1 and alm, not with --loss uld",
    "kd": r"--kd-chunk-weight works with --loss csd, csd_1to1 and alm, not with --loss kd",
    "ce": r"--kd-chunk-weight weighs KD chunks; --loss ce has none",
}


@pytest.mark.parametrize("loss", ["uld", "kd", "ce"])
def test_losses_without_chunk_weights_refuse_it(loss):
    with pytest.raises(CsdError, match=REFUSALS[loss]):
        build_loss(loss, {**OPTIONS, "kd_scale": "fixed"})


@pytest.mark.parametrize(("key", "value", "flag"), [("kd_chunk_weight", "sigmoid", "--kd-chunk-weight 'sigmoid'"),
                                                    ("kd_chunk_weight_scale", 0.0, "--kd-chunk-weight-scale"),
                                                    ("kd_chunk_weight_max", -1.0, "--kd-chunk-weight-max")])
def test_bad_chunk_weight_options_name_the_flag(key, value, flag):
    with pytest.raises(CsdError, match=flag):
        build_loss("alm", {**OPTIONS, key: value})


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["csd", "alm"])
def test_csd_train_with_advantage_weights_matches_the_direct_loss(trainer_data, trainer_teacher, tmp_path, one_thread,
                                                                  loss):
    """One step of `csd-train --kd-chunk-weight advantage` (FSDP2, float32) logs the KD of the direct float64 loss
    of its first batch, which differs from the unweighted one."""
    from tests.trainer_cases import direct_first_batch_loss, kd_run_args, metrics
    from trainer.loop import train
    from trainer.options import parse_args

    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss", loss, "--kd-chunk-weight",
                                    "advantage", "--kd-chunk-weight-scale", "2", steps=1))
    train(config)
    row = metrics(output)[0]
    out, _ = direct_first_batch_loss(config)
    plain, _ = direct_first_batch_loss(config, kd_chunk_weight="none")
    assert row["kd"] > 0 and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert abs(float(plain.kd) - float(out.kd)) > 1e-3 * float(plain.kd)
