"""`--loss kd` (csd_pipeline/loss/kd.py): same-tokenizer KD against a float64 dense reference, on real text.

The reference below is independent of `kd.py`, the tables and `row_events`: positions come from a plain walk
over the aligned row's chunk lengths and statuses, the student's probabilities from the full softmax of dense
logits, both REST masses from 1 - the sum of the entries, and the KL is written out term by term; gradients
come from torch autograd through these dense operations.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import ce_targets
from csd_pipeline.loss.kd import collate_kd_rows, kd_rows
from csd_pipeline.loss.training import build_loss
from tests.csd_cases import ACCEPTED, PairCase, as_float, close, topk_from_dense

TOL = 1e-10
TOP_K = 16
HIDDEN = 16
OPTIONS = {"kd_combine": "sum", "teacher_temperature": 1.0, "loss_chunk_size": 0, "loss_reuse_mb": 0,
           "loss_reuse_dtype": "float32"}


# ------------------------------------------------------------------------------------------------
# The float64 dense reference


def reference_positions(row: dict) -> list[tuple[int, int]]:
    """(student position, teacher position) before every accepted chunk of one token on each side."""
    out, s, t = [], 0, 0
    for m, n, status in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"],
                            row["teacher0_chunk_status"], strict=True):
        if status == ACCEPTED and m == 1 and n == 1 and s > 0 and t > 0:
            out.append((s - 1, t - 1))
        s, t = s + int(m), t + int(n)
    return out


def reference_kd_loss(logits: list, rows: list, tops: list, *, rest: bool = True) -> dict:
    """{"loss", "ce", "kd", "positions"}: L = CE + KD (kd scale fixed at 1), both means, float64."""
    ce_sum, kd_sum, ce_count, count = 0.0, 0.0, 0, 0
    for x, row, top in zip(logits, rows, tops, strict=True):
        probs = torch.softmax(x, dim=-1)
        ids, mask = row["student_ids"].astype(np.int64), row["student_loss_mask"]
        for j in range(1, len(ids)):
            if mask[j]:
                ce_sum = ce_sum - torch.log(probs[j - 1, ids[j]])
                ce_count += 1
        for s, t in reference_positions(row):
            real = np.isfinite(top["logprobs"][t])  # beyond a position's length: padding (id -1)
            q = np.exp(top["logprobs"][t][real])
            p = probs[s, torch.as_tensor(top["ids"][t][real].astype(np.int64))]
            term = sum(q[i] * (math.log(q[i]) - torch.log(p[i])) for i in range(len(q)) if q[i] > 0)
            q_rest, p_rest = 1.0 - q.sum(), 1.0 - p.sum()
            if rest and q_rest > 0:
                term = term + q_rest * (math.log(q_rest) - torch.log(p_rest))
            kd_sum = kd_sum + term
            count += 1
    ce, kd = ce_sum / ce_count, kd_sum / count
    return {"loss": ce + kd, "ce": ce, "kd": kd, "positions": count}


# ------------------------------------------------------------------------------------------------


class Case(PairCase):
    """Real aligned rows of one tokenizer with itself, a random student (h, W) and a random teacher's top-16."""

    def __init__(self, tokenizer_path, name: str = "llama-spm", seed: int = 0):
        super().__init__(tokenizer_path, name, name, [5, 7], HIDDEN, seed)
        g = self.generator
        self.hidden, self.tops = [], []
        for r in self.rows:
            s_ids = torch.as_tensor(r["student_ids"].astype(np.int64))
            h = torch.randn(len(s_ids), HIDDEN, generator=g, dtype=torch.float64)
            h[:-1] += (torch.rand(len(s_ids) - 1, generator=g) < 0.7).double()[:, None] * self.weight[s_ids[1:]] * 0.5
            self.hidden.append(0.3 * h)
            t = torch.randn(len(s_ids), self.t.vocab.size, generator=g, dtype=torch.float64) * 2.0
            t[torch.arange(len(s_ids) - 1), s_ids[1:]] += (torch.rand(len(s_ids) - 1, generator=g) < 0.7).double() * 12
            self.tops.append(topk_from_dense(r, torch.log_softmax(t, -1).numpy(), TOP_K))

    def batch(self, tops=None):
        offsets = self.offsets(self.rows)
        rows = collate_kd_rows([kd_rows(r, 0, t, self.ctx) for r, t in zip(self.rows, tops or self.tops, strict=True)],
                               offsets)
        return rows, ce_targets([r["student_ids"] for r in self.rows], [r["student_loss_mask"] for r in self.rows],
                                offsets)


@pytest.fixture(scope="module")
def case(tokenizer_path):
    return Case(tokenizer_path)


def _loss(case, batch, cp, ct, **inputs):
    loss = build_loss("kd", OPTIONS)
    return loss(ce_positions=cp, ce_tokens=ct, teachers=[batch], kd_scale=1.0, **inputs)


def test_loss_and_gradient_match_the_dense_reference(case):
    batch, (cp, ct) = case.batch()
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = _loss(case, batch, cp, ct, hidden=h, weight=w)
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_kd_loss(logits, case.rows, case.tops)
    ref["loss"].backward()
    assert batch.num_chunks == ref["positions"] > 10 and batch.shape_counts()[1:] == [0, 0, 0]
    for name in ("loss", "ce", "kd"):
        assert close(getattr(out, name), ref[name]), (name, as_float(getattr(out, name)), as_float(ref[name]))
    assert as_float(ref["kd"]) > 1e-2
    g_logits = torch.cat([x.grad for x in logits])
    for grad, expected in ((h.grad, g_logits @ case.weight), (w.grad, g_logits.T @ torch.cat(case.hidden))):
        assert float((grad - expected).abs().max()) <= TOL * max(1.0, float(expected.abs().max()))
    # the dense-logits path and float32 agree
    dense = _loss(case, batch, cp, ct, logits=torch.cat(case.hidden) @ case.weight.T)
    single = _loss(case, batch, cp, ct, hidden=torch.cat(case.hidden).float(), weight=case.weight.float())
    assert close(dense.loss, out.loss) and single.kd.dtype == torch.float32
    assert abs(as_float(single.kd) - as_float(out.kd)) < 1e-4 * max(1.0, as_float(out.kd))


def test_the_reference_catches_a_loss_without_rest(case, monkeypatch):
    """Mutation: an implementation whose REST entries vanish (log(1 - mass) = -inf on both sides) moves KD
    far beyond the tolerance; the reference without REST agrees with it, so the REST term is what is checked."""
    import csd_pipeline.loss.csd as csd

    batch, (cp, ct) = case.batch()
    h, w = torch.cat(case.hidden), case.weight
    monkeypatch.setattr(csd, "log1mexp", lambda x: torch.full_like(x, -math.inf))
    mutated = _loss(case, batch, cp, ct, hidden=h, weight=w)
    logits = [x @ w.T for x in case.hidden]
    assert abs(as_float(mutated.kd) - as_float(reference_kd_loss(logits, case.rows, case.tops)["kd"])) > 1e-3
    assert close(mutated.kd, reference_kd_loss(logits, case.rows, case.tops, rest=False)["kd"])


def test_variable_lengths_rejected_rows_and_empty_batches(case):
    """Entries beyond a position's length are padding; a rejected teacher row gives no positions (CE only)."""
    tops = [dict(t) for t in case.tops]
    lengths = np.full(len(tops[0]["ids"]), TOP_K, np.int64)
    lengths[::2] = 3
    tops[0]["lengths"] = lengths
    real = np.arange(TOP_K)[None, :] < lengths[:, None]
    tops[0]["logprobs"] = np.where(real, tops[0]["logprobs"], -np.inf)
    tops[0]["ids"] = np.where(real, tops[0]["ids"], -1)  # as the store pads
    tops[1] = {**tops[1], "status": 1}
    batch, (cp, ct) = case.batch(tops)
    assert batch.num_chunks == len(reference_positions(case.rows[0])) and batch.stats == {"rows_teacher_rejected": 1}
    h, w = torch.cat(case.hidden), case.weight
    out = _loss(case, batch, cp, ct, hidden=h, weight=w)
    ref = reference_kd_loss([x @ w.T for x in case.hidden[:1]], case.rows[:1], tops[:1])
    assert close(out.kd, ref["kd"])
    empty = collate_kd_rows([], [])
    none = _loss(case, empty, cp, ct, hidden=h, weight=w)
    assert as_float(none.kd) == 0.0 and close(none.loss, none.ce)


def test_options_and_teacher_checks():
    with pytest.raises(CsdError, match="--teacher-temperature"):
        build_loss("kd", {**OPTIONS, "teacher_temperature": 2.0})
    with pytest.raises(CsdError, match="--kd-combine select"):
        build_loss("kd", {**OPTIONS, "kd_combine": "select"})
    loss = build_loss("kd", OPTIONS)
    assert loss.uses_teachers and loss.exact_teacher_values


@functools.cache
def _fake_output(keep="top-k", tail_samples=0):
    """A teacher output whose manifest records these selectors (and no shards)."""
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    config = {"top_k": 8, "top_p": None, "teacher_index": 0, "keep": keep, "tail_samples": tail_samples}
    return TeacherTopkOutput("T", {"config": config, "shards": []})


def test_refuses_a_teacher_with_another_tokenizer(trainer_data):
    """The trainer data aligns llama-spm (student) with smollm2: `--loss kd` says so in one line naming itself."""
    from csd_pipeline.align.output import AlignedOutput

    aligned = AlignedOutput.open(trainer_data["train_short"])
    loss = build_loss("kd", OPTIONS)
    with pytest.raises(CsdError, match=r"--loss kd .* does not have the student's tokenizer; use --loss csd"):
        loss.check_teacher(aligned, _fake_output())
    with pytest.raises(CsdError, match="--keep csd-events"):
        loss.check_teacher(aligned, _fake_output(keep="csd-events"))
    with pytest.raises(CsdError, match="--tail-samples"):
        loss.check_teacher(aligned, _fake_output(tail_samples=4))


def _with_observed_entry(kd_rows_of):
    """`kd_rows` whose positions also hold the observed next token (at its stored log-prob) where the top-k does
    not: the explicit entries CSD compares at a 1:1 chunk."""
    from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks
    from csd_pipeline.loss.kd import KdRows

    def rows_of(aligned_row, teacher_index, teacher_row, context, source=""):
        rows = kd_rows_of(aligned_row, teacher_index, teacher_row, context, source)
        chunks = read_aligned_chunks(aligned_row, teacher_index, context, source)
        keep = ((chunks.status == ACCEPTED) & (chunks.student_len == 1) & (chunks.teacher_len == 1)
                & (chunks.student_start > 0) & (chunks.teacher_start > 0))
        at = chunks.teacher_start[keep]
        observed_id = chunks.teacher_ids[at]
        observed = np.asarray(teacher_row.observed_logprob, np.float64)[at - 1]
        missing = ~(rows.ids == observed_id[:, None]).any(axis=1)
        return KdRows(rows.position, np.concatenate([rows.ids, np.where(missing, observed_id, 0)[:, None]], 1),
                      np.concatenate([rows.logq, np.where(missing, observed, -np.inf)[:, None]], 1), rows.stats)

    return rows_of


@pytest.mark.slow
def test_csd_train_kd_with_a_same_tokenizer_teacher(tmp_path, one_thread, monkeypatch):
    """`csd-train --loss kd` on smollm2 -> smollm2 text with the real SmolLM2 teacher: one step logs the KD of the
    direct float64 loss of its first batch. With one tokenizer every chunk is 1:1 and CSD (`--divergence kl --beta
    1`) is top-k KD with a REST term, except that CSD also compares the observed token where the top-k lacks it:
    with that entry added, KD equals CSD on the same batch to 1e-9; without it, they differ by under 1%."""
    import json

    import csd_pipeline.loss.kd as kd
    from tests.trainer_cases import (
        DATA,
        STUDENT_CONFIG,
        align,
        direct_first_batch_loss,
        kd_run_args,
        make_teacher_topk,
        metrics,
    )
    from trainer.loop import train
    from trainer.options import parse_args

    corpus = tmp_path / "short.txt"
    # two windows of 128 tokens: the one step's batch (the real teacher's forward is the slow part)
    corpus.write_text((DATA / "botchan-slice.txt").read_text(encoding="utf-8")[:1100], encoding="utf-8")
    student = tmp_path / "student.json"
    student.write_text(json.dumps({**STUDENT_CONFIG, "vocab_size": 49152}))
    aligned = align([corpus], tmp_path / "aligned", student_name="smollm2", teacher_name="smollm2")
    data = {"train_short": aligned, "student_config": student}
    teacher = make_teacher_topk(aligned, tmp_path / "topk")

    def config_of(*loss):
        return parse_args(kd_run_args(data, teacher, tmp_path / loss[1], *loss, steps=1, student_tokenizer="smollm2"))

    config = config_of("--loss", "kd")
    train(config)
    row = metrics(tmp_path / "kd")[0]
    out, batch = direct_first_batch_loss(config)
    assert row["chunks_1to1"] == batch.shape_counts[0][0] > 100 and row["kd"] > 0
    assert row["ce"] == pytest.approx(float(out.ce), rel=1e-5) and row["kd"] == pytest.approx(float(out.kd), rel=1e-4)
    csd, csd_batch = direct_first_batch_loss(config_of("--loss", "csd", "--divergence", "kl", "--beta", "1"))
    assert csd_batch.shape_counts[0] == batch.shape_counts[0] and batch.shape_counts[0][1:] == [0, 0, 0]
    assert 0 < abs(float(csd.kd) - float(out.kd)) < 0.01 * float(out.kd)
    monkeypatch.setattr(kd, "kd_rows", _with_observed_entry(kd.kd_rows))
    observed, _ = direct_first_batch_loss(config)
    assert float(observed.kd) == pytest.approx(float(csd.kd), rel=1e-9)
