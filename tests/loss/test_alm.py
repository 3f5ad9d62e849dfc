"""`--loss alm` (csd_pipeline/loss/alm.py, csd_pipeline/events/alm_rows.py) against the float64 reference
(tests/loss_reference_alm.py), on real tokenizer pairs and real text.

Student logits are random with the true vocabulary sizes (hidden [P, 16] @ W[V, 16]^T, so the checkpointed
whitespace rows and the chunked gather are what is checked); teachers are random dense log-probs, stored as
their top-16 as the teacher-logits stage stores them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.events.alm_rows import build_alm_rows, collate_alm_rows, space_mask
from csd_pipeline.events.batch import ce_targets
from csd_pipeline.loss.alm import alm_loss
from csd_pipeline.loss.training import build_loss
from tests.csd_cases import PairCase, as_float, close, row_shapes, topk_from_dense
from tests.loss_reference_alm import reference_alm_loss, whitespace_ids

TOL = 1e-10
TOP_K = 16
HIDDEN = 16
PAIRS = {"llama-spm/gpt-2": ("llama-spm", "gpt-2", [5, 7]), "llama-bpe/qwen2": ("llama-bpe", "qwen2", [1, 3])}
OPTIONS = {"kd_combine": "sum", "teacher_temperature": 1.0, "loss_chunk_size": 0, "loss_reuse_mb": 0,
           "loss_reuse_dtype": "float32", "alm_temperature": 100.0, "alm_debias": True}


class Case(PairCase):
    """Two real aligned rows of one tokenizer pair, a random student (h, W) and a random teacher's top-16."""

    def __init__(self, tokenizer_path, pair: str, seed: int = 0):
        student, teacher, text_ids = PAIRS[pair]
        super().__init__(tokenizer_path, student, teacher, text_ids, HIDDEN, seed)
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
            self.tops.append(topk_from_dense(r, torch.log_softmax(t, -1).numpy(), TOP_K))

    def batch(self, tops=None, debias=True):
        offsets = self.offsets(self.rows)
        rows = collate_alm_rows([build_alm_rows(r, 0, t, self.ctx, debias=debias)
                                 for r, t in zip(self.rows, tops or self.tops, strict=True)], offsets)
        return rows, ce_targets([r["student_ids"] for r in self.rows], [r["student_loss_mask"] for r in self.rows],
                                offsets)


@pytest.fixture(scope="module")
def case_of(tokenizer_path):
    return functools.cache(lambda pair: Case(tokenizer_path, pair))


def _check_gradients(case, h, w, logits):
    g_logits = torch.cat([x.grad for x in logits])
    for grad, expected in ((h.grad, g_logits @ case.weight), (w.grad, g_logits.T @ torch.cat(case.hidden))):
        assert float((grad - expected).abs().max()) <= TOL * max(1.0, float(expected.abs().max()))


@pytest.mark.parametrize("pair,temperature,debias", [
    pytest.param("llama-spm/gpt-2", 100.0, True, id="spm-gpt2-tau100"),
    pytest.param("llama-spm/gpt-2", 1.0, True, id="spm-gpt2-tau1"),
    pytest.param("llama-spm/gpt-2", 100.0, False, id="spm-gpt2-no-debias"),
    pytest.param("llama-bpe/qwen2", 100.0, True, id="bpe-qwen2-tau100", marks=pytest.mark.slow),
])
def test_loss_and_gradient_match_the_reference(case_of, pair, temperature, debias):
    case = case_of(pair)
    batch, (cp, ct) = case.batch(debias=debias)
    assert {s for r in case.rows for s in row_shapes(r)} == {"1:1", "1:N", "M:1", "M:N"} and all(batch.shape_counts())
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h, weight=w, temperature=temperature,
                   chunk_size=13, kd_scale=1.0)
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_alm_loss(logits, case.rows, case.tops, case.s_ref, case.t_ref, temperature=temperature,
                             debias=debias)
    ref["loss"].backward()
    assert batch.num_chunks == ref["chunks"] > 20
    for name in ("loss", "ce", "kd"):
        assert close(getattr(out, name), ref[name]), (name, as_float(getattr(out, name)), as_float(ref[name]))
    assert as_float(ref["kd"]) > 1e-4
    if debias:  # the random teacher's top-16 holds whitespace mass at the chunk ends
        assert sum(p > 0 for p in ref["p_t"]) > 20
    _check_gradients(case, h, w, logits)


def test_the_reference_catches_a_loss_without_debiasing(case_of):
    """Mutation: the debiased and plain losses differ far beyond the tolerance, so the whitespace terms are checked."""
    case = case_of("llama-spm/gpt-2")
    h, w = torch.cat(case.hidden), case.weight
    (on, (cp, ct)), (off, _) = case.batch(), case.batch(debias=False)
    with_space = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[on], hidden=h, weight=w, kd_scale=1.0)
    without = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[off], hidden=h, weight=w, kd_scale=1.0)
    assert abs(as_float(with_space.kd) - as_float(without.kd)) > 1e-3 * as_float(without.kd)


def test_whitespace_masks_match_a_scan_of_the_bytes(case_of):
    case = case_of("llama-spm/gpt-2")
    for bundle, ref in ((case.s, case.s_ref), (case.t, case.t_ref)):
        mask = space_mask(bundle.vocab)
        assert np.array_equal(mask, whitespace_ids(ref)) and 0.1 < mask.mean() < 0.9


def test_dense_logits_path_and_float32(case_of):
    """The logits path equals the checkpointed path; float32 inputs stay within 1e-4 of float64."""
    case = case_of("llama-spm/gpt-2")
    batch, (cp, ct) = case.batch()
    h, w = torch.cat(case.hidden), case.weight
    chunked = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h, weight=w, kd_scale=1.0)
    dense = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], logits=h @ w.T, kd_scale=1.0)
    single = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h.float(), weight=w.float(), kd_scale=1.0)
    assert close(chunked.loss, dense.loss) and close(chunked.kd, dense.kd)
    assert single.kd.dtype == torch.float32 and abs(as_float(single.kd) - as_float(chunked.kd)) < 1e-4 * as_float(chunked.kd)


def test_a_teacher_equal_to_the_student_gives_no_kd_gradient(tokenizer_path):
    """One tokenizer, the teacher's stored values the student's own whole distribution: every chunk's two
    probabilities agree, so the KD gradient vanishes (its value is the teacher's binary entropy, not 0)."""
    case = PairCase(tokenizer_path, "llama-spm", "llama-spm", [5], HIDDEN, 3)
    h = torch.randn(len(case.rows[0]["student_ids"]), HIDDEN, generator=case.generator, dtype=torch.float64)
    logp = torch.log_softmax(h @ case.weight.T, -1).numpy()
    tops = [topk_from_dense(case.rows[0], logp, logp.shape[1])]

    def kd_gradient(top):
        batch = collate_alm_rows([build_alm_rows(case.rows[0], 0, top, case.ctx)], [0])
        x = h.clone().requires_grad_(True)
        out = alm_loss(ce_positions=torch.zeros(1, dtype=torch.int64), ce_tokens=torch.zeros(1, dtype=torch.int64),
                       teachers=[batch], hidden=x, weight=case.weight, kd_scale=1.0, temperature=1.0)
        out.kd.backward()
        assert batch.num_chunks > 20 and as_float(out.kd) > 0
        return float(x.grad.abs().max())

    assert kd_gradient(tops[0]) < 1e-9
    # control: a teacher with half the observed log-probs pulls the student, 4 orders of magnitude more
    assert kd_gradient({**tops[0], "observed_logprob": tops[0]["observed_logprob"] * 0.5}) > 1e-5


def test_variable_lengths_rejected_rows_and_empty_batches(case_of):
    """Entries beyond a position's length are padding; a chunk end with no whitespace entry stored gets the floor
    1e-6; a rejected teacher row gives no chunks (CE only)."""
    case = case_of("llama-spm/gpt-2")
    tops = [dict(t) for t in case.tops]
    lengths = np.full(len(tops[0]["ids"]), TOP_K, np.int64)
    lengths[::2] = 1
    tops[0]["lengths"] = lengths
    real = np.arange(TOP_K)[None, :] < lengths[:, None]
    tops[0]["logprobs"] = np.where(real, tops[0]["logprobs"], -np.inf)
    tops[0]["ids"] = np.where(real, tops[0]["ids"], -1)  # as the store pads
    tops[1] = {**tops[1], "status": 1}
    batch, (cp, ct) = case.batch(tops)
    assert batch.stats["rows_teacher_rejected"] == 1
    h, w = torch.cat(case.hidden), case.weight
    out = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], hidden=h, weight=w, kd_scale=1.0)
    ref = reference_alm_loss([x @ w.T for x in case.hidden], case.rows, tops, case.s_ref, case.t_ref)
    assert batch.num_chunks == ref["chunks"] and close(out.kd, ref["kd"]) and close(out.ce, ref["ce"])
    floored = [math.isclose(p, t * 1e-6, rel_tol=1e-9) for p, t in zip(ref["p_t"], ref["p_t_chunk"], strict=True)]
    assert 0 < sum(floored) < len(floored)  # chunk ends whose one stored entry is no whitespace: the floor
    rejected = collate_alm_rows([build_alm_rows(case.rows[1], 0, tops[1], case.ctx)], [0])
    none = alm_loss(ce_positions=cp, ce_tokens=ct, teachers=[rejected], hidden=h, weight=w, kd_scale=1.0)
    assert as_float(none.kd) == 0.0 and close(none.loss, none.ce)


def test_a_corrupt_observed_log_prob_is_one_line(case_of):
    case = case_of("llama-spm/gpt-2")
    top = dict(case.tops[0])
    top["observed_logprob"] = np.full_like(top["observed_logprob"], math.nan)
    with pytest.raises(CsdError, match=r"not finite.*re-run `csd-pipeline teacher-logits`"):
        build_alm_rows(case.rows[0], 0, top, case.ctx)


def test_options_and_teacher_checks():
    with pytest.raises(CsdError, match="--alm-temperature"):
        build_loss("alm", {**OPTIONS, "teacher_temperature": 2.0})
    with pytest.raises(CsdError, match="--alm-temperature must be a positive number"):
        build_loss("alm", {**OPTIONS, "alm_temperature": 0.0})
    with pytest.raises(CsdError, match="--kd-combine select"):
        build_loss("alm", {**OPTIONS, "kd_combine": "select"})
    loss = build_loss("alm", OPTIONS)
    assert loss.uses_teachers and loss.exact_teacher_values
    assert not build_loss("alm", {**OPTIONS, "alm_debias": False}).exact_teacher_values


@functools.cache
def _fake_output(keep="top-k", tail_samples=0):
    """A teacher output whose manifest records these selectors (and no shards)."""
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    config = {"top_k": 8, "top_p": None, "teacher_index": 0, "keep": keep, "tail_samples": tail_samples}
    return TeacherTopkOutput("T", {"config": config, "shards": []})


def test_a_store_without_exact_entries_needs_no_debias():
    """Debiasing reads the stored entries as the teacher's most likely: a `--keep csd-events` or `--tail-samples`
    store is refused in one line naming --no-alm-debias; without debiasing (observed log-probs only) it is read."""
    loss = build_loss("alm", OPTIONS)
    loss.check_teacher(None, _fake_output())
    for output in (_fake_output(keep="csd-events"), _fake_output(tail_samples=4)):
        with pytest.raises(CsdError, match=r"--loss alm .*--no-alm-debias") as err:
            loss.check_teacher(None, output)
        assert "\n" not in str(err.value)
        build_loss("alm", {**OPTIONS, "alm_debias": False}).check_teacher(None, output)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--kd-scale", "fixed", "--kd-weight", "0.5"], ["--no-alm-debias"]],
                         ids=["fixed-0.5", "no-debias"])
def test_csd_train_alm_matches_the_direct_loss(trainer_data, trainer_teacher, tmp_path, one_thread, extra):
    """Two steps of `csd-train --loss alm` (FSDP2, checkpointed whitespace rows, float32) on real teacher top-k
    (SmolLM2-135M-Instruct): the first logs the CE and KD of the direct float64 loss on the same first batch, and
    the loss its --kd-scale says; the student is exported."""
    from tests.trainer_cases import direct_first_batch_loss, kd_run_args, metrics
    from trainer.loop import train
    from trainer.options import parse_args

    output = tmp_path / "run"
    config = parse_args(kd_run_args(trainer_data, trainer_teacher, output, "--loss", "alm", *extra, steps=2))
    train(config)
    rows = metrics(output)
    row = rows[0]
    assert len(rows) == 2 and row["kd"] > 0 and row["chunks_1to1"] > 0
    assert row["chunks_1toN"] + row["chunks_Mto1"] + row["chunks_MtoN"] > 0
    out, batch = direct_first_batch_loss(config)
    assert row["ce"] == pytest.approx(float(out.ce), rel=1e-5) and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    assert row["chunks_1to1"] == batch.shape_counts[0][0]
    scale = config.loss.kd_weight if config.loss.kd_scale == "fixed" else row["ce"] / row["kd"]
    assert row["kd_scale"] == pytest.approx(scale, rel=1e-9)
    assert row["loss"] == pytest.approx(row["ce"] + scale * row["kd"], rel=1e-9)
    assert 0 < row["teacher_event_mass"] < 1 and row["divergence_per_chunk"] > 0
    assert (output / "export" / "model.safetensors").is_file()
