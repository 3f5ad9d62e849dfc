"""The baseline losses (ULD, GOLD, strict) and the shuffled-teacher control, on real tokenizer pairs and text.

Each loss is checked against its own float64 reference (tests/loss_reference_baselines.py) in loss and
gradient, and against CSD on inputs where the two must differ. Student logits are random with the
true vocabulary sizes (hidden [P, 16] @ W[V, 16]^T, so the checkpointed row path is what is
checked); teachers are random dense log-probs, stored as their top-16 like the teacher-logits stage.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.events.baseline_rows import (
    build_baseline_rows,
    collate_baseline_rows,
    shared_vocabulary,
    shuffle_teacher_rows,
)
from csd_pipeline.events.batch import ce_targets, collate_events
from csd_pipeline.events.row_events import build_row_events
from csd_pipeline.loss.baselines import adaptive_matched_weight, baseline_loss
from csd_pipeline.loss.csd import csd_loss
from tests.csd_cases import (
    ACCEPTED,
    MISMATCH,
    PairCase,
    as_float,
    close,
    row_shapes,
    topk_from_dense,
)
from tests.loss_reference_baselines import (
    chunks_of,
    reference_baseline_loss,
    shared_spellings,
    strict_teacher_classes,
)

TOL = 1e-10
TOP_K = 16
HIDDEN = 16
PAIRS = {"llama-spm/gpt-2": ("llama-spm", "gpt-2", [5, 7]), "llama-bpe/qwen2": ("llama-bpe", "qwen2", [1, 3])}


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

    def chunk_rows(self, rows, tops, only_1to1=False):
        offsets = self.offsets(rows)
        batch = collate_baseline_rows([build_baseline_rows(r, 0, t, self.ctx, only_1to1=only_1to1)
                                    for r, t in zip(rows, tops, strict=True)], offsets)
        return batch, ce_targets([r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows], offsets)

    def events(self, rows, tops, only_1to1=False):
        return collate_events([build_row_events(r, 0, t, self.ctx, only_1to1=only_1to1)
                               for r, t in zip(rows, tops, strict=True)], self.offsets(rows))


@pytest.fixture(scope="module")
def case_of(tokenizer_path):
    """`case_of(pair)`: the module's Case of a pair, built once."""
    return functools.cache(lambda pair: Case(tokenizer_path, pair))


COMBOS = [
    ("llama-spm/gpt-2", "uld", {}),
    ("llama-bpe/qwen2", "uld", {}),
    ("llama-spm/gpt-2", "gold", {}),
    ("llama-spm/gpt-2", "gold", {"divergence": "kl", "gold_matched_weight": 0.3}),
    ("llama-bpe/qwen2", "gold", {"divergence": "reverse_kl", "gold_matched_weight": 0.8}),
    ("llama-spm/gpt-2", "strict", {}),
    ("llama-spm/gpt-2", "strict", {"strict_top_k": 4, "strict_divergence": "kl"}),
    ("llama-bpe/qwen2", "strict", {"strict_top_k": 16, "strict_divergence": "jsd"}),
]
# the 128k / 151k vocabularies of llama-bpe / qwen2 make their references slow; the fast tier keeps one
# variant of each kind (the plain one), the full tier all
_PARAMS = [pytest.param(c, id=f"{c[0]}-{c[1]}-{'-'.join(f'{a}={b}' for a, b in c[2].items())}",
                        marks=[pytest.mark.slow] if c[0] == "llama-bpe/qwen2" or c in (COMBOS[3], COMBOS[6]) else [])
           for c in COMBOS]


@pytest.mark.parametrize("combo", _PARAMS)
def test_loss_and_gradient_match_reference(case_of, combo):
    pair, kind, options = combo
    case = case_of(pair)
    batch, (cp, ct) = case.chunk_rows(case.rows, case.tops, only_1to1=kind == "strict")
    shapes = {s for r in case.rows for s in row_shapes(r)}
    assert shapes == {"1:1", "1:N", "M:1", "M:N"}
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = baseline_loss(kind, hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[batch], chunk_size=13,
                        **options)
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_baseline_loss(kind, logits, case.rows, case.tops, case.s_ref, case.t_ref, **options)
    ref["loss"].backward()
    assert batch.num_chunks == ref["chunks"] > 0
    if kind == "strict":
        assert set(batch.shape_counts()[1:]) == {0}
    else:
        assert all(batch.shape_counts())
    for name in ("loss", "ce", "kd"):
        assert close(getattr(out, name), ref[name]), (name, as_float(getattr(out, name)), ref[name])
    assert as_float(ref["kd"]) > 1e-3
    g_logits = torch.cat([x.grad for x in logits])
    for grad, expected in ((h.grad, g_logits @ case.weight), (w.grad, g_logits.T @ torch.cat(case.hidden))):
        assert float((grad - expected).abs().max()) <= TOL * max(1.0, float(expected.abs().max()))


def test_dense_logits_path_and_float32(case_of):
    """The logits path equals the checkpointed path; float32 inputs stay within 1e-4 of float64."""
    case = case_of("llama-spm/gpt-2")
    batch, (cp, ct) = case.chunk_rows(case.rows, case.tops)
    h, w = torch.cat(case.hidden), case.weight
    for kind in ("uld", "gold", "strict"):
        rows = case.chunk_rows(case.rows, case.tops, only_1to1=kind == "strict")[0]
        chunked = baseline_loss(kind, hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[rows])
        dense = baseline_loss(kind, logits=h @ w.T, ce_positions=cp, ce_tokens=ct, teachers=[rows])
        single = baseline_loss(kind, hidden=h.float(), weight=w.float(), ce_positions=cp, ce_tokens=ct, teachers=[rows])
        assert close(chunked.kd, dense.kd) and close(chunked.loss, dense.loss)
        assert single.kd.dtype == torch.float32
        assert abs(as_float(single.kd) - as_float(dense.kd)) < 1e-4 * max(1, as_float(dense.kd))


# ------------------------------------------------------------------------------------------------
# Inputs on which a baseline and CSD must differ


def _keep_shapes(row: dict, shapes: set[str]) -> dict:
    """The row with every accepted chunk of another shape marked rejected."""
    row = dict(row)
    status = row["teacher0_chunk_status"].copy()
    for c, (m, n) in enumerate(zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"], strict=True)):
        shape = "1:1" if m == 1 and n == 1 else "1:N" if m == 1 else "M:1" if n == 1 else "M:N"
        if status[c] == ACCEPTED and shape not in shapes:
            status[c] = MISMATCH
    row["teacher0_chunk_status"] = status
    return row


def _student_logits(case: Case, rows, build_row) -> list:
    """Random student logits, except at each chunk's final position, where `build_row(chunk)` sets the probabilities."""
    out = []
    for x, row, top in zip(case.hidden, rows, case.tops, strict=True):
        logits = (x @ case.weight.T).clone()
        for chunk in chunks_of(torch.zeros(len(x), 1), row, top):
            probs = build_row(chunk)
            assert abs(probs.sum() - 1) < 1e-12 and probs.min() > 0
            logits[chunk.final] = torch.log(torch.as_tensor(probs))
        out.append(logits)
    return out


def _both(case, rows, logits, kind, csd_divergence="kl", only_1to1=False, **options):
    """(baseline KD, CSD KD) of the same rows and student logits."""
    offsets = case.offsets(rows)
    cp, ct = ce_targets([r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows], offsets)
    flat = torch.cat(logits)
    rows_b = collate_baseline_rows([build_baseline_rows(r, 0, t, case.ctx, only_1to1=kind == "strict")
                                 for r, t in zip(rows, case.tops, strict=True)], offsets)
    base = baseline_loss(kind, logits=flat, ce_positions=cp, ce_tokens=ct, teachers=[rows_b], **options)
    csd = csd_loss(logits=flat, ce_positions=cp, ce_tokens=ct, teachers=[case.events(rows, case.tops, only_1to1)],
                   divergence=csd_divergence)
    return as_float(base.kd), as_float(csd.kd)


def _observed_stored(row: dict, top: dict) -> dict:
    """The row with every accepted chunk whose observed teacher token is outside the stored top-k rejected."""
    row = dict(row)
    status = row["teacher0_chunk_status"].copy()
    t0 = np.cumsum(row["teacher0_chunk_teacher_len"]) - row["teacher0_chunk_teacher_len"]
    for c in np.flatnonzero(status == ACCEPTED):
        n = int(row["teacher0_chunk_teacher_len"][c])
        if t0[c] and row["teacher0_ids"][t0[c] + n - 1] not in top["ids"][t0[c] + n - 2]:
            status[c] = MISMATCH
    row["teacher0_chunk_status"] = status
    return row


def test_uld_cannot_see_which_tokens_get_the_mass(case_of):
    """A student that gives the teacher's top-k probabilities to the wrong tokens scores ULD 0; CSD sees it.
    (Chunks whose observed token is outside the stored top-k are left out: its small probability would have
    to be one of the student's largest.)"""
    case = case_of("llama-spm/gpt-2")
    rows = [_observed_stored(_keep_shapes(r, {"1:1"}), t) for r, t in zip(case.rows, case.tops, strict=True)]
    assert sum(s == "1:1" for r in rows for s in row_shapes(r)) >= 10
    vs = case.s.vocab.size
    rng = np.random.default_rng(0)

    def wrong_tokens(chunk):
        values = np.asarray(sorted(chunk.explicit.values(), reverse=True))
        ids = rng.choice(vs, size=len(values), replace=False)  # unrelated to the teacher's tokens
        probs = np.full(vs, (1 - values.sum()) / (vs - len(values)))
        assert probs[0] < values[-1]  # the chosen ids are the student's largest entries
        probs[ids] = values
        return probs

    uld, csd = _both(case, rows, _student_logits(case, rows, wrong_tokens), "uld")
    assert abs(uld) < 1e-12 and csd > 0.5


def test_strict_ignores_mass_off_the_shared_vocabulary(case_of):
    """A student that matches the teacher on the shared spellings up to scale (80% of its mass elsewhere) scores
    strict 0 with or without a top-N support; csd_1to1 (events plus REST, no renormalisation) does not."""
    case = case_of("llama-spm/gpt-2")
    rows = [_keep_shapes(r, {"1:1"}) for r in case.rows]
    shared = shared_spellings(case.s_ref, case.t_ref)
    vs, vt = case.s.vocab.size, case.t.vocab.size
    class_size = np.bincount(shared.s_cls, minlength=shared.count)
    others = np.setdiff1d(np.arange(vs), shared.s_ids)

    def scaled(chunk):
        target = strict_teacher_classes(chunk, shared, vt)
        probs = np.zeros(vs)
        probs[shared.s_ids] = 0.2 * (target / target.sum())[shared.s_cls] / class_size[shared.s_cls]
        probs[others] = 0.8 / len(others)
        return probs

    logits = _student_logits(case, rows, scaled)
    for options in ({}, {"strict_top_k": 16}, {"strict_divergence": "jsd"}):
        strict, csd = _both(case, rows, logits, "strict", only_1to1=True, **options)
        assert abs(strict) < 1e-12 and csd > 0.05


def test_gold_compares_a_split_chunk_with_the_wrong_student_events(case_of):
    """GOLD's direct term pairs the teacher's last piece of a 1:N chunk with the student token of the same
    bytes: a student built to match it scores GOLD 0, while CSD (the teacher's piece paired with the student
    token that spells the whole chunk) sees the difference. 1:1 chunks agree under both."""
    case = case_of("llama-spm/gpt-2")
    rows = [_keep_shapes(r, {"1:1", "1:N"}) for r in case.rows]
    assert sum(s == "1:N" for r in rows for s in row_shapes(r)) >= 3
    shared = shared_spellings(case.s_ref, case.t_ref)
    vs = case.s.vocab.size
    class_size = np.bincount(shared.s_cls, minlength=shared.count)

    def gold_match(chunk):
        mass = np.zeros(shared.count)
        for v, p in chunk.explicit.items():
            if v in shared.teacher_of_id:
                mass[shared.teacher_of_id[v]] += chunk.chain_t * p
        probs = np.zeros(vs)
        probs[shared.s_ids] = (mass / class_size)[shared.s_cls]
        free = probs == 0
        probs[free] = (1 - probs.sum()) / free.sum()
        return probs

    logits = _student_logits(case, rows, gold_match)
    gold, csd = _both(case, rows, logits, "gold", gold_matched_weight=1.0)
    assert abs(gold) < 1e-12 and csd > 0.05
    only_1to1 = [_keep_shapes(r, {"1:1"}) for r in rows]
    assert abs(_both(case, only_1to1, logits, "gold", gold_matched_weight=1.0)[1]) < 1e-12  # CSD agrees on 1:1


# ------------------------------------------------------------------------------------------------
# The chunk rows and the control


def test_chunk_rows_hold_the_same_chunks_as_csd_events(case_of):
    case = case_of("llama-spm/gpt-2")
    for only in (False, True):
        batch, _ = case.chunk_rows(case.rows, case.tops, only_1to1=only)
        assert batch.shape_counts() == case.events(case.rows, case.tops, only).shape_counts()
    batch, _ = case.chunk_rows(case.rows, case.tops)
    lp = batch.teacher_logp
    explicit = np.isfinite(lp)
    assert (np.diff(np.where(explicit, lp, -1e300), axis=1) <= 0).all()  # descending, padding last
    assert ((explicit.sum(1) == TOP_K) | (explicit.sum(1) == TOP_K + 1)).all()  # + the observed token when outside
    shared = shared_vocabulary(case.ctx)
    sv = shared_spellings(case.s_ref, case.t_ref)
    assert shared.num_classes == sv.count and adaptive_matched_weight(shared) == len(sv.t_ids) / case.t.vocab.size
    assert (batch.teacher_class[~explicit] == -1).all() and (batch.teacher_class[explicit] >= 0).any()
    for c in range(batch.num_chunks):  # the same entries grouped by shared class, and the unshared ones
        values, classes = lp[c][explicit[c]], batch.teacher_class[c][explicit[c]]
        ids = batch.class_id[c][batch.class_id[c] >= 0]
        assert sorted(ids.tolist()) == sorted(set(classes[classes >= 0].tolist()))
        for k, logp, count in zip(ids, batch.class_logp[c], batch.class_count[c], strict=False):
            assert np.isclose(logp, np.logaddexp.reduce(values[classes == k])) and count == (classes == k).sum()
        unshared = batch.unshared_logp[c][np.isfinite(batch.unshared_logp[c])]
        assert (unshared == values[classes < 0]).all()


def test_shuffled_control_moves_every_stored_row(case_of):
    case = case_of("llama-spm/gpt-2")
    rejected = dict(case.tops[0], status=2)
    tops = [case.tops[1], rejected, case.tops[0]]
    out = shuffle_teacher_rows(tops, np.random.default_rng(3))
    again = shuffle_teacher_rows(tops, np.random.default_rng(3))
    assert out[1] is rejected
    before = [(tuple(t["ids"][j]), t["observed_logprob"][j]) for t in (tops[0], tops[2])
              for j in range(len(t["ids"])) if np.isfinite(t["observed_logprob"][j])]
    after = [(tuple(t["ids"][j]), t["observed_logprob"][j]) for t in (out[0], out[2])
             for j in range(len(t["ids"])) if np.isfinite(t["observed_logprob"][j])]
    assert sorted(before) == sorted(after)  # the same stored rows, entropy and mass kept
    assert all(a != b for a, b in zip(before, after, strict=True))  # none at its own position
    for new, old in ((out[0], tops[0]), (out[2], tops[2])):
        assert np.isnan(new["observed_logprob"][-1]) and (new["ids"][-1] == old["ids"][-1]).all()
    assert all((a["ids"] == b["ids"]).all() for a, b in zip(out[::2], again[::2], strict=True))


@pytest.mark.parametrize("kind", ["csd", "uld"])
def test_shuffled_teacher_changes_the_kd_term(case_of, kind):
    """With shuffled rows, events and chunk rows build without error and the KD term moves."""
    case = case_of("llama-spm/gpt-2")
    shuffled = shuffle_teacher_rows(case.tops, np.random.default_rng(0))
    offsets = case.offsets(case.rows)
    cp, ct = ce_targets([r["student_ids"] for r in case.rows], [r["student_loss_mask"] for r in case.rows], offsets)
    logits = torch.cat([h @ case.weight.T for h in case.hidden])
    values = []
    for tops in (case.tops, shuffled):
        if kind == "csd":
            out = csd_loss(logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[case.events(case.rows, tops)])
        else:
            batch = case.chunk_rows(case.rows, tops)[0]
            out = baseline_loss("uld", logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[batch])
        values.append((as_float(out.ce), as_float(out.kd)))
    assert values[0][0] == values[1][0] and abs(values[0][1] - values[1][1]) > 1e-2


def test_bad_options_raise_csd_error(case_of):
    case = case_of("llama-spm/gpt-2")
    batch, (cp, ct) = case.chunk_rows(case.rows, case.tops)
    logits = torch.cat([h @ case.weight.T for h in case.hidden])
    for kind, options, match in (("ot", {}, "unknown baseline"), ("gold", {"divergence": "l2"}, "divergence"),
                                 ("gold", {"gold_matched_weight": 1.5}, "matched weight"),
                                 ("strict", {"strict_top_k": -1}, "strict_top_k")):
        with pytest.raises(CsdError, match=match):
            baseline_loss(kind, logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[batch], **options)
    dense = dict(case.rows[0])
    with pytest.raises(CsdError, match="stored top-k"):
        build_baseline_rows(dense, 0, np.zeros((len(dense["teacher0_ids"]), case.t.vocab.size)), case.ctx)


def _ragged(top: dict, rng) -> tuple[dict, dict]:
    """(a --top-p style row: 1 to k entries per position, padding id -1 / log-prob -inf, the same row with
    stale real entries left beyond each position's count) of a fixed top-k row."""
    ids, logprobs = np.array(top["ids"]), np.array(top["logprobs"], dtype=np.float32)
    k = ids.shape[1]
    lengths = rng.integers(1, k + 1, size=len(ids)).astype(np.int64)
    beyond = np.arange(k)[None, :] >= lengths[:, None]
    clean = dict(top, ids=np.where(beyond, -1, ids), logprobs=np.where(beyond, -np.inf, logprobs), lengths=lengths)
    return clean, dict(top, ids=ids, logprobs=logprobs, lengths=lengths)


def test_baseline_rows_read_only_each_positions_entries(case_of):
    case = case_of("llama-spm/gpt-2")
    rng = np.random.default_rng(5)
    for row, top in zip(case.rows, case.tops, strict=True):
        clean, stale = _ragged(top, rng)
        a, b = build_baseline_rows(row, 0, clean, case.ctx), build_baseline_rows(row, 0, stale, case.ctx)
        full = build_baseline_rows(row, 0, top, case.ctx)
        assert a.num_chunks == b.num_chunks == full.num_chunks > 0
        for name in ("class_id", "class_logp", "class_count", "unshared_logp"):
            assert np.array_equal(getattr(a, name), getattr(b, name))
        # fewer entries than the fixed top-k: the explicit mass can only shrink
        assert np.isfinite(a.class_logp).sum() + np.isfinite(a.unshared_logp).sum() <= \
            np.isfinite(full.class_logp).sum() + np.isfinite(full.unshared_logp).sum()


def test_shuffled_control_moves_each_positions_entry_count(case_of):
    case = case_of("llama-spm/gpt-2")
    rng = np.random.default_rng(7)
    tops = [_ragged(top, rng)[0] for top in case.tops]
    out = shuffle_teacher_rows(tops, np.random.default_rng(3))

    def stored(rows):
        return sorted((tuple(t["ids"][j][:t["lengths"][j]]), int(t["lengths"][j])) for t in rows
                      for j in range(len(t["ids"])) if np.isfinite(t["observed_logprob"][j]))

    assert stored(tops) == stored(out)  # each position's entries travel with their count
    for t in out:
        width = t["ids"].shape[1]
        assert ((t["ids"] >= 0) == (np.arange(width)[None, :] < t["lengths"][:, None])).all()
