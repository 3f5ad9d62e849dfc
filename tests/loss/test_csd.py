"""The CSD loss against the float64 brute-force reference, on real tokenizer pairs and real text.

Student logits are random with the true vocabulary sizes (hidden [P, 8] @ W[V, 8]^T, so the
chunked LM-head path is what is checked); teachers are random dense log-probs or their top-k.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from csd_pipeline.errors import CsdError
from csd_pipeline.events.batch import ce_targets, collate_events
from csd_pipeline.events.row_events import build_row_events
from csd_pipeline.loss.csd import csd_divergence, csd_loss
from csd_pipeline.loss.token_logprobs import chunked_token_logprobs, dense_token_logprobs
from tests.csd_cases import (
    ACCEPTED,
    MISMATCH,
    PairCase,
    aligned_row,
    as_float,
    close,
    event_context,
    load_texts,
    row_shapes,
    topk_from_dense,
)
from tests.loss_reference import (
    ReferenceTeacher,
    ReferenceVocab,
    reference_chunk_distributions,
    reference_loss,
)

DATA = Path(__file__).resolve().parents[1] / "data"
TOL = 1e-10
TOP_K = 16
HIDDEN = 64

# student, teacher, texts (indices into csd-loss-texts.jsonl), 1:1 chunks kept for dense teachers
PAIRS = {
    "llama-bpe/qwen2": ("llama-bpe", "qwen2", [2, 3]),  # text 2 alone holds every chunk shape
    "llama-spm/gpt-2": ("llama-spm", "gpt-2", [3, 5, 6, 7]),
}
DENSE_ONE_TO_ONE_PER_ROW = 1  # a dense 1:1 chunk has ~10^5 events; a few keep the reference fast


def _limit_one_to_one(row: dict, keep: int, teacher_index: int = 0) -> dict:
    """Mark all but the first `keep` accepted 1:1 chunks as rejected (dense teachers only)."""
    p = f"teacher{teacher_index}_"
    row = dict(row)
    status = row[p + "chunk_status"].copy()
    seen = 0
    for c, (m, n) in enumerate(zip(row[p + "chunk_student_len"], row[p + "chunk_teacher_len"])):
        if status[c] == ACCEPTED and m == 1 and n == 1:
            seen += 1
            if seen > keep:
                status[c] = MISMATCH
    row[p + "chunk_status"] = status
    return row


class Case(PairCase):
    """Rows, random student (h, W) and teacher log-probs for one tokenizer pair."""

    def __init__(self, tokenizer_path, pair: str, seed: int = 0):
        student, teacher, text_ids = PAIRS[pair]
        super().__init__(tokenizer_path, student, teacher, text_ids, HIDDEN, seed)
        g, vt = self.generator, self.t.vocab.size
        # Like trained models, both sides usually (not always) favour the observed next token, so
        # chain factors and the observed event carry real mass; the rest of each row is random.
        self.hidden, self.dense = [], []
        for r in self.rows:
            s_ids = torch.as_tensor(r["student_ids"].astype(np.int64))
            h = torch.randn(len(s_ids), HIDDEN, generator=g, dtype=torch.float64)
            boost = (torch.rand(len(s_ids) - 1, generator=g) < 0.7).double()[:, None]
            h[:-1] += boost * self.weight[s_ids[1:]]
            self.hidden.append(0.2 * h)
            t_ids = torch.as_tensor(r["teacher0_ids"].astype(np.int64))
            t = torch.randn(len(t_ids), vt, generator=g, dtype=torch.float64) * 2.0
            boost = (torch.rand(len(t_ids) - 1, generator=g) < 0.7).double() * 14.0
            t[torch.arange(len(t_ids) - 1), t_ids[1:]] += boost
            self.dense.append(torch.log_softmax(t, -1).numpy())

    def teacher_rows(self, mode: str):
        if mode == "dense":
            rows = [_limit_one_to_one(r, DENSE_ONE_TO_ONE_PER_ROW) for r in self.rows]
            return rows, list(self.dense)
        return self.rows, [topk_from_dense(r, d, TOP_K) for r, d in zip(self.rows, self.dense)]

    def events(self, rows, teachers, **kw):
        offsets = self.offsets(rows)
        evs = [build_row_events(r, 0, t, self.ctx, **kw) for r, t in zip(rows, teachers)]
        return collate_events(evs, offsets), ce_targets(
            [r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows], offsets
        )


@pytest.fixture(scope="module")
def case_of(tokenizer_path):
    """`case_of(pair)`: the module's Case of a pair, built once."""
    yield functools.cache(lambda pair: Case(tokenizer_path, pair))
    _RUNS.clear()


def _implementation(case: Case, rows, teachers, divergence, spelling):
    batch, (cp, ct) = case.events(rows, teachers, spelling=spelling)
    h = torch.cat(case.hidden).clone().requires_grad_(True)
    w = case.weight.clone().requires_grad_(True)
    out = csd_loss(hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[batch], divergence=divergence, chunk_size=37)
    out.loss.backward()
    return out, batch, h.grad, w.grad


def _reference(case: Case, rows, teachers, divergence, spelling):
    logits = [(h @ case.weight.T).requires_grad_(True) for h in case.hidden]
    ref = reference_loss(
        logits, rows, case.s_ref, [ReferenceTeacher(case.t_ref, teachers)], divergence=divergence, spelling=spelling
    )
    ref["loss"].backward()
    g_logits = torch.cat([x.grad for x in logits])
    # d/dh and d/dW of the same loss through logits = h W^T.
    return ref, g_logits @ case.weight, g_logits.T @ torch.cat(case.hidden)


# (pair, teacher, spelling, divergence): every chunk shape occurs in each pair's rows; every
# divergence is checked with dense and top-k teachers. llama-bpe and qwen2 have no spelling with two
# ids, so "exclude" equals "sum" there and is checked on llama-spm (byte-fallback duplicates).
COMBOS = [
    ("llama-bpe/qwen2", "topk", "sum", "jsd"),
    ("llama-bpe/qwen2", "dense", "sum", "reverse_kl"),
    ("llama-spm/gpt-2", "topk", "sum", "kl"),
    ("llama-spm/gpt-2", "topk", "exclude", "jsd"),
    ("llama-spm/gpt-2", "topk", "exclude", "reverse_kl"),
    ("llama-spm/gpt-2", "dense", "sum", "jsd"),
    ("llama-spm/gpt-2", "dense", "exclude", "kl"),
    ("llama-spm/gpt-2", "dense", "sum", "reverse_kl"),
]
_RUNS: dict = {}
# The fast tier (`pytest -m "not slow"`) keeps one top-k and one dense combination.
FAST_COMBOS = (COMBOS[2], COMBOS[5])


def combo_params(combos):
    return [pytest.param(c, id="-".join(c), marks=() if c in FAST_COMBOS else pytest.mark.slow) for c in combos]


def _run(case_of, combo):
    """Implementation and reference on one combination (memoised: other tests reuse it)."""
    if combo not in _RUNS:
        pair, mode, spelling, divergence = combo
        case = case_of(pair)
        rows, teachers = case.teacher_rows(mode)
        impl = _implementation(case, rows, teachers, divergence, spelling)
        _RUNS[combo] = (case, rows, teachers, impl, _reference(case, rows, teachers, divergence, spelling))
    return _RUNS[combo]


@pytest.mark.parametrize("combo", combo_params(COMBOS))
def test_loss_and_gradient_match_reference(case_of, combo):
    case, rows, teachers, (out, batch, g_h, g_w), (ref, ref_h, ref_w) = _run(case_of, combo)
    assert {s for r in rows for s in row_shapes(r)} == {"1:1", "1:N", "M:1", "M:N"}
    assert batch.num_chunks == ref["chunks"][0] > 0
    for name in ("loss", "ce", "kd"):
        assert close(getattr(out, name), ref[name]), (name, as_float(getattr(out, name)), ref[name])
    assert as_float(ref["kd"]) > 1e-2
    assert float((g_h - ref_h).abs().max()) <= TOL * max(1.0, float(ref_h.abs().max()))
    assert float((g_w - ref_w).abs().max()) <= TOL * max(1.0, float(ref_w.abs().max()))


def _dense_against_reference(case: Case, **options):
    """The dense-logits path and the reference on the top-k rows of `case` with the same loss options.

    Returns a namespace: out, ref, batch, targets (CE positions, tokens), logits, grad and ref_grad
    (both d loss / d logits).
    """
    from types import SimpleNamespace

    rows, teachers = case.teacher_rows("topk")
    batch, (cp, ct) = case.events(rows, teachers)
    logits = torch.cat([h @ case.weight.T for h in case.hidden]).requires_grad_(True)
    out = csd_loss(logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[batch], **options)
    out.loss.backward()
    ref_logits = [(h @ case.weight.T).requires_grad_(True) for h in case.hidden]
    ref = reference_loss(ref_logits, rows, case.s_ref, [ReferenceTeacher(case.t_ref, teachers)], **options)
    ref["loss"].backward()
    return SimpleNamespace(out=out, ref=ref, batch=batch, targets=(cp, ct), logits=logits.detach(), grad=logits.grad,
                           ref_grad=torch.cat([x.grad for x in ref_logits]))


def test_gradient_wrt_logits_matches_reference(case_of):
    """The dense-logits path: d loss / d logits equals the reference's, entry by entry."""
    run = _dense_against_reference(case_of("llama-spm/gpt-2"), divergence="jsd")
    assert close(run.out.kd, run.ref["kd"])
    assert float((run.grad - run.ref_grad).abs().max()) <= TOL
    # The student's gradient reaches chain positions (not only final positions).
    chain_rows = torch.as_tensor(np.unique(run.batch.chain_pos))
    assert float(run.grad[chain_rows].abs().sum()) > 0


# ------------------------------------------------------------------------------------------------
# The reference catches two wrong implementations


def _wrong_kd(case: Case, rows, teachers, variant: str) -> float:
    """KD (JSD, beta 5) of a wrong implementation, from the reference's own chunk events."""
    from tests.loss_reference import _divergence

    total, count = 0.0, 0
    for h, row, t_row in zip(case.hidden, rows, teachers):
        probs = torch.softmax(h @ case.weight.T, -1)
        for chunk in reference_chunk_distributions(probs, row, 0, t_row, case.s_ref, case.t_ref):
            if variant == "no_chain":
                # Drops the chain factors: the final token alone stands for the chunk.
                p_t = torch.cat([chunk.final_t, (1 - chunk.final_t.sum()).clamp(min=0).reshape(1)])
                p_s = torch.cat([chunk.final_s, (1 - chunk.final_s.sum()).clamp(min=0).reshape(1)])
            else:
                # Renormalises over the kept events instead of keeping REST.
                q_t, q_s = chunk.chain_t * chunk.final_t, chunk.chain_s * chunk.final_s
                p_t, p_s = q_t / q_t.sum(), q_s / q_s.sum()
            d = float(_divergence(p_t, p_s, "jsd"))
            total += d if chunk.shape == "1:1" else 5.0 * d
            count += 1
    return total / count


@pytest.mark.parametrize("combo", combo_params([COMBOS[0], COMBOS[5]]))
def test_reference_catches_wrong_versions(case_of, combo):
    """Dropping the chain factors, or renormalising over the kept events, is visibly wrong."""
    case, rows, teachers, (out, *_), (ref, *_) = _run(case_of, combo)
    assert close(out.kd, ref["kd"])
    for variant in ("no_chain", "renormalised"):
        wrong = _wrong_kd(case, rows, teachers, variant)
        assert abs(wrong - as_float(ref["kd"])) > 1e-3, (variant, wrong, as_float(ref["kd"]))
        assert abs(wrong - as_float(out.kd)) > 1e-3


# ------------------------------------------------------------------------------------------------
# Multi-teacher, global counts, CE-only


@pytest.mark.slow
def test_multi_teacher_matches_reference(tokenizer_path):
    """Student llama-spm; teacher 0 gpt-2 (top-k), teacher 1 smollm2 (dense); weights and global counts."""
    s, t0, ctx0 = event_context(tokenizer_path, "llama-spm", "gpt-2")
    _, t1, ctx1 = event_context(tokenizer_path, "llama-spm", "smollm2")
    texts = load_texts(DATA / "csd-loss-texts.jsonl")
    rows = []
    for i in (5, 7):
        row = aligned_row(texts[i]["text"], s, t0, f"t{i}", teacher_index=0)
        row1 = aligned_row(texts[i]["text"], s, t1, f"t{i}", teacher_index=1)
        row.update({k: v for k, v in row1.items() if k.startswith("teacher1_")})
        rows.append(row)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(s.vocab.size, HIDDEN, generator=g, dtype=torch.float64)
    hs = [torch.randn(len(r["student_ids"]), HIDDEN, generator=g, dtype=torch.float64) for r in rows]
    dense0 = [torch.log_softmax(2 * torch.randn(len(r["teacher0_ids"]), t0.vocab.size, generator=g, dtype=torch.float64), -1).numpy() for r in rows]
    dense1 = [torch.log_softmax(2 * torch.randn(len(r["teacher1_ids"]), t1.vocab.size, generator=g, dtype=torch.float64), -1).numpy() for r in rows]
    top0 = [topk_from_dense(r, d, 8, teacher_index=0) for r, d in zip(rows, dense0)]
    rows = [_limit_one_to_one(r, 3, teacher_index=1) for r in rows]
    offsets = np.cumsum([0] + [len(r["student_ids"]) for r in rows])[:-1]
    ev0 = collate_events([build_row_events(r, 0, t, ctx0) for r, t in zip(rows, top0)], offsets)
    ev1 = collate_events([build_row_events(r, 1, d, ctx1) for r, d in zip(rows, dense1)], offsets)
    cp, ct = ce_targets([r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows], offsets)
    weights = [0.7, 0.3]
    # As if other ranks / accumulation steps held more tokens and chunks.
    g_tokens, g_chunks = len(cp) * 3, [ev0.num_chunks * 2, ev1.num_chunks * 4]
    h = torch.cat(hs).requires_grad_(True)
    out = csd_loss(
        hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[ev0, ev1], teacher_weights=weights,
        global_ce_tokens=g_tokens, global_chunk_counts=g_chunks, divergence="kl", chunk_size=50,
    )
    out.loss.backward()
    logits = [(x @ w.T).requires_grad_(True) for x in hs]
    teachers = [
        ReferenceTeacher(ReferenceVocab.from_vocabulary(t0.vocab), top0, weights[0]),
        ReferenceTeacher(ReferenceVocab.from_vocabulary(t1.vocab), dense1, weights[1]),
    ]
    ref = reference_loss(
        logits, rows, ReferenceVocab.from_vocabulary(s.vocab), teachers, divergence="kl",
        global_ce_tokens=g_tokens, global_chunk_counts=g_chunks,
    )
    ref["loss"].backward()
    assert ev0.num_chunks == ref["chunks"][0] and ev1.num_chunks == ref["chunks"][1]
    for i in range(2):
        assert close(out.metrics[f"teacher{i}/kd"], ref["kd_parts"][i])
    assert close(out.kd, ref["kd"]) and close(out.ce, ref["ce"]) and close(out.loss, ref["loss"])
    g_ref = torch.cat([x.grad for x in logits]) @ w
    assert float((h.grad - g_ref).abs().max()) <= TOL * max(1.0, float(g_ref.abs().max()))


def test_special_pair_chunk_matches_reference(case_of):
    """Chat mode's end-of-turn pair (two special tokens, no bytes): the observed pair plus REST."""
    case = case_of("llama-spm/gpt-2")
    s_eos, t_eos = case.s.vocab.roles["eos"], case.t.vocab.roles["eos"]
    rows = []
    for r in case.rows[:2]:
        r = dict(r)
        r["student_ids"] = np.append(r["student_ids"], s_eos)
        r["student_loss_mask"] = np.append(r["student_loss_mask"], True)
        r["teacher0_ids"] = np.append(r["teacher0_ids"], t_eos)
        for key, value in (("student_len", 1), ("teacher_len", 1), ("status", ACCEPTED)):
            r[f"teacher0_chunk_{key}"] = np.append(r[f"teacher0_chunk_{key}"], value)
        rows.append(r)
    g = torch.Generator().manual_seed(7)
    hidden = [torch.randn(len(r["student_ids"]), HIDDEN, generator=g, dtype=torch.float64) * 0.3 for r in rows]
    dense = [torch.log_softmax(torch.randn(len(r["teacher0_ids"]), case.t.vocab.size, generator=g, dtype=torch.float64), -1).numpy() for r in rows]
    teachers = [topk_from_dense(r, d, TOP_K) for r, d in zip(rows, dense)]
    offsets = np.cumsum([0] + [len(r["student_ids"]) for r in rows])[:-1]
    batch = collate_events([build_row_events(r, 0, t, case.ctx) for r, t in zip(rows, teachers)], offsets)
    assert batch.stats["chunks_special_pair"] == 2
    cp, ct = ce_targets([r["student_ids"] for r in rows], [r["student_loss_mask"] for r in rows], offsets)
    h = torch.cat(hidden).requires_grad_(True)
    out = csd_loss(hidden=h, weight=case.weight, ce_positions=cp, ce_tokens=ct, teachers=[batch])
    out.loss.backward()
    logits = [(x @ case.weight.T).requires_grad_(True) for x in hidden]
    ref = reference_loss(logits, rows, case.s_ref, [ReferenceTeacher(case.t_ref, teachers)])
    ref["loss"].backward()
    assert ref["chunks"][0] == batch.num_chunks
    assert close(out.kd, ref["kd"])
    g_ref = torch.cat([x.grad for x in logits]) @ case.weight
    assert float((h.grad - g_ref).abs().max()) <= TOL * max(1.0, float(g_ref.abs().max()))


def _variable_length_rows(case: Case, top_p: float):
    """The case's top-16 rows made variable-length (`--top-p top_p`, every 7th position forced to 1
    entry and every 5th to all 16) and passed through the codec, in three forms: padded as the reader
    yields them (id -1, log-prob -inf after `lengths`), ragged (per position only its entries: what
    the reference reads) and with stale values after `lengths` (the left-out entries, finite)."""
    from csd_pipeline.teacher.store.codec import decode_block, encode_block
    from csd_pipeline.teacher.store.selectors.top_p import mass_lengths

    padded, ragged, stale, counts = [], [], [], []
    for r, d in zip(case.rows, case.dense):
        full = topk_from_dense(r, d, TOP_K)
        lengths = mass_lengths(full["logprobs"], top_p)
        lengths[::7], lengths[3::5] = 1, TOP_K
        observed_ids = np.append(r["teacher0_ids"][1:], -1)
        payload = encode_block(full["ids"], full["logprobs"], observed_ids, full["observed_logprob"], lengths)
        ids, logprobs, observed, decoded_lengths = decode_block(payload, observed_ids >= 0)
        assert decoded_lengths.tolist() == lengths.tolist()
        padded.append({"row_id": r["row_id"], "ids": ids, "logprobs": logprobs, "observed_logprob": observed,
                       "lengths": decoded_lengths})
        ragged.append({"row_id": r["row_id"], "ids": [ids[t, :n] for t, n in enumerate(lengths)],
                       "logprobs": [logprobs[t, :n] for t, n in enumerate(lengths)], "observed_logprob": observed})
        filled_ids, filled_lp = ids.copy(), logprobs.copy()
        for t, n in enumerate(lengths):
            left_out = [j for j in range(TOP_K) if full["ids"][t, j] not in ids[t, :n]]
            filled_ids[t, n:] = full["ids"][t, left_out]
            filled_lp[t, n:] = full["logprobs"][t, left_out]
        stale.append({"row_id": r["row_id"], "ids": filled_ids, "logprobs": filled_lp, "observed_logprob": observed,
                      "lengths": decoded_lengths})
        counts.extend(lengths.tolist())
    return padded, ragged, stale, counts


@pytest.mark.parametrize(("pair", "spelling", "divergence"), [
    pytest.param("llama-bpe/qwen2", "sum", "jsd", marks=pytest.mark.slow),  # fast tier: llama-spm/gpt-2
    ("llama-spm/gpt-2", "exclude", "kl"),
])
def test_variable_length_teacher_rows_match_reference(case_of, pair, spelling, divergence):
    """Rows of a `--top-p` output (1 to 16 entries per position) give the loss and gradient of the
    reference reading only each position's entries; entries after `lengths` are never read."""
    case = case_of(pair)
    padded, ragged, stale, counts = _variable_length_rows(case, top_p=0.9)
    assert 1 in counts and TOP_K in counts and 1 < np.mean(counts) < TOP_K
    ref, ref_h, ref_w = _reference(case, case.rows, ragged, divergence, spelling)
    for teachers in (padded, stale):
        out, batch, g_h, g_w = _implementation(case, case.rows, teachers, divergence, spelling)
        assert batch.num_chunks == ref["chunks"][0] > 0
        for name in ("loss", "ce", "kd"):
            assert close(getattr(out, name), ref[name]), (name, as_float(getattr(out, name)), ref[name])
        assert float((g_h - ref_h).abs().max()) <= TOL * max(1.0, float(ref_h.abs().max()))
        assert float((g_w - ref_w).abs().max()) <= TOL * max(1.0, float(ref_w.abs().max()))
    # The stale entries would change the loss if they were read: the reference on the whole top-16 differs.
    whole, _, _ = _reference(case, case.rows, [dict(t, ids=list(t["ids"]), logprobs=list(t["logprobs"])) for t in stale],
                             divergence, spelling)
    assert abs(as_float(whole["kd"]) - as_float(ref["kd"])) > 1e-4


def test_ce_only_and_no_chunks(case_of):
    """loss="ce" (no teachers) and a batch without accepted chunks both give L = CE exactly."""
    case = case_of("llama-spm/gpt-2")
    rows, teachers = case.teacher_rows("topk")
    _, (cp, ct) = case.events(rows, teachers)
    h = torch.cat(case.hidden)
    plain = -dense_token_logprobs(h @ case.weight.T, torch.as_tensor(cp), torch.as_tensor(ct)).mean()
    ce_only = csd_loss(hidden=h, weight=case.weight, ce_positions=cp, ce_tokens=ct, teachers=[])
    assert close(ce_only.loss, plain) and float(ce_only.kd) == 0.0
    no_chunks = [dict(r, teacher0_chunk_status=np.full_like(r["teacher0_chunk_status"], MISMATCH)) for r in rows]
    batch, _ = case.events(no_chunks, teachers)
    assert batch.num_chunks == 0
    out = csd_loss(hidden=h, weight=case.weight, ce_positions=cp, ce_tokens=ct, teachers=[batch])
    assert close(out.loss, plain) and float(out.kd) == 0.0


def test_metrics(case_of):
    case, rows, teachers, (out, batch, *_), _ = _run(case_of, FAST_COMBOS[0])
    expected = {k: 0 for k in ("1:1", "1:N", "M:1", "M:N")}
    for r in rows:
        for shape in row_shapes(r):
            expected[shape] += 1
    m = out.metrics
    assert [m[f"teacher0/chunks_{k}"] for k in expected] == list(expected.values())
    assert m["teacher0/events_per_chunk"] == batch.num_events / batch.num_chunks
    chunks = [
        c
        for h, row, t_row in zip(case.hidden, rows, teachers)
        for c in reference_chunk_distributions(torch.softmax(h @ case.weight.T, -1), row, 0, t_row, case.s_ref, case.t_ref)
    ]
    teacher_mass = np.mean([float((c.chain_t * c.final_t).sum()) for c in chunks])
    student_rest = np.mean([float(c.distributions()[1][-1]) for c in chunks])
    assert close(m["teacher0/teacher_event_mass"], teacher_mass)
    assert close(m["teacher0/student_rest_mass"], student_rest)
    assert close(m["ce"], out.ce) and close(m["kd"], out.kd) and close(m["loss"], out.loss)


def test_beta_and_only_1to1(case_of):
    """beta weighs non-1:1 chunks; only_1to1 (loss "csd_1to1") keeps just the 1:1 chunks."""
    case = case_of("llama-spm/gpt-2")
    rows, teachers = case.teacher_rows("topk")
    batch, (cp, ct) = case.events(rows, teachers)
    h = torch.cat(case.hidden)
    gathered_chain = dense_token_logprobs(h @ case.weight.T, torch.as_tensor(batch.chain_pos), torch.as_tensor(batch.chain_tok))
    gathered_final = dense_token_logprobs(h @ case.weight.T, torch.as_tensor(batch.final_pos), torch.as_tensor(batch.final_tok))
    ev = batch.to("cpu")
    one = csd_divergence(gathered_chain, gathered_final, ev, beta=1.0).divergence_sum
    five = csd_divergence(gathered_chain, gathered_final, ev, beta=5.0).divergence_sum
    only, _ = case.events(rows, teachers, only_1to1=True)
    assert only.num_chunks == sum(s == "1:1" for r in rows for s in row_shapes(r)) < batch.num_chunks
    ev1 = only.to("cpu")
    d11 = csd_divergence(
        dense_token_logprobs(h @ case.weight.T, ev1.chain_pos, ev1.chain_tok),
        dense_token_logprobs(h @ case.weight.T, ev1.final_pos, ev1.final_tok),
        ev1,
    ).divergence_sum
    # five = d11 + 5 * other, one = d11 + other
    assert close(five - d11, 5 * (one - d11))
    assert float(one - d11) > 0


@pytest.mark.parametrize(("divergence", "temperature"), [
    ("kl", 1.5),
    pytest.param("jsd", 0.7, marks=pytest.mark.slow),
    pytest.param("reverse_kl", 2.0, marks=pytest.mark.slow),
])
def test_teacher_temperature_matches_reference(case_of, divergence, temperature):
    """The tempered teacher chunk distribution (events and REST, P^(1/T) renormalised) equals the
    float64 reference in loss and gradient, and T = 1 is the untempered loss."""
    run = _dense_against_reference(case_of("llama-spm/gpt-2"), divergence=divergence, beta=2.0,
                                   teacher_temperature=temperature)
    out, ref = run.out, run.ref
    assert close(out.kd, ref["kd"]) and close(out.loss, ref["loss"])
    assert float((run.grad - run.ref_grad).abs().max()) <= TOL
    (cp, ct), batch = run.targets, run.batch
    plain = csd_loss(logits=run.logits, ce_positions=cp, ce_tokens=ct, teachers=[batch], divergence=divergence, beta=2.0)
    one = csd_loss(logits=run.logits, ce_positions=cp, ce_tokens=ct, teachers=[batch], divergence=divergence,
                   beta=2.0, teacher_temperature=1.0)
    assert as_float(one.kd) == as_float(plain.kd)
    assert abs(as_float(plain.kd) - as_float(out.kd)) > 1e-3  # the temperature changes the target


def test_teacher_temperature_must_be_positive(case_of):
    case = case_of("llama-spm/gpt-2")
    rows, teachers = case.teacher_rows("topk")
    batch, (cp, ct) = case.events(rows, teachers)
    logits = torch.cat([h @ case.weight.T for h in case.hidden])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(CsdError, match="temperature"):
            csd_loss(logits=logits, ce_positions=cp, ce_tokens=ct, teachers=[batch], teacher_temperature=bad)


# ------------------------------------------------------------------------------------------------
# Chunked student log-probabilities


def _dense_reference(h, w, pos, tok):
    return torch.log_softmax(h @ w.T, -1)[pos, tok]


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(1, 40),
    v=st.integers(2, 300),
    g=st.integers(0, 80),
    chunk=st.integers(1, 50),
    seed=st.integers(0, 2**31 - 1),
    keep=st.sampled_from([0, 1 << 10, 1 << 14, 1 << 30]),
    block=st.sampled_from([None, 1, 7, 64]),
)
def test_chunked_logprobs_equal_dense_float64(p, v, g, chunk, seed, keep, block):
    """Values and gradients (h and W) of the chunked path equal dense autograd in float64, whether the
    backward recomputes every block, reuses the ones kept within `reuse_bytes`, or all, and whether
    the vocabulary is one block or many (down to one id per block)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(p, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, p, (g,), generator=gen)
    tok = torch.randint(0, v, (g,), generator=gen)
    upstream = torch.randn(g, generator=gen, dtype=torch.float64)
    out = chunked_token_logprobs(h, w, pos, tok, chunk_size=chunk, reuse_bytes=keep, vocab_block=block)
    (out * upstream).sum().backward()
    h2 = h.detach().clone().requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    ref = _dense_reference(h2, w2, pos, tok)
    (ref * upstream).sum().backward()
    assert out.dtype == torch.float64 and out.shape == (g,)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    assert torch.allclose(h.grad, h2.grad, atol=1e-12, rtol=0)
    assert torch.allclose(w.grad, w2.grad, atol=1e-12, rtol=0)


def test_chunked_logprobs_float32():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(300, 64, generator=gen) * 0.5
    w = torch.randn(5000, 64, generator=gen) * 0.5
    pos = torch.arange(300).repeat(3)
    tok = torch.randint(0, 5000, (900,), generator=gen)
    hf, wf = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = chunked_token_logprobs(hf, wf, pos, tok, chunk_size=64)
    out.sum().backward()
    hd, wd = h.double().requires_grad_(True), w.double().requires_grad_(True)
    ref = _dense_reference(hd, wd, pos, tok)
    ref.sum().backward()
    assert out.dtype == torch.float32 and hf.grad.dtype == torch.float32 and wf.grad.dtype == torch.float32
    assert float((out.detach().double() - ref.detach()).abs().max()) < 1e-4
    assert float((hf.grad.double() - hd.grad).abs().max()) < 1e-3
    assert float((wf.grad.double() - wd.grad).abs().max()) < 1e-3


def test_chunked_forward_saves_no_positions_by_vocab_tensor():
    """Autograd keeps only h, W and small per-position/per-request tensors: never [P, V]."""
    p, v = 64, 4000
    h = torch.randn(p, 16, requires_grad=True)
    w = torch.randn(v, 16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = chunked_token_logprobs(h, w, torch.arange(p), torch.randint(0, v, (p,)), chunk_size=16)
    out.sum().backward()
    assert saved and max(saved) <= max(v * 16, p * 16) < p * v


def test_kept_chunks_are_not_recomputed(monkeypatch):
    """reuse_bytes: the forward keeps the first rows that fit (16,000 bytes per row of 4000 float32
    logits) and the backward forms logits only for the others (chunks of 16 rows, one vocabulary
    block); 767,999 bytes keep 47 rows, chunks of 16, 16 and 15, then 16, 16, 16 and 1 are formed
    twice; the results do not change."""
    import csd_pipeline.loss.token_logprobs as token_logprobs

    formed = []
    real = token_logprobs._chunk_logits
    monkeypatch.setattr(token_logprobs, "_chunk_logits", lambda h, w, acc: formed.append(h.shape[0]) or real(h, w, acc))
    gen = torch.Generator().manual_seed(11)
    h, w = torch.randn(96, 16, generator=gen), torch.randn(4000, 16, generator=gen)
    pos, tok = torch.arange(96).repeat(2), torch.randint(0, 4000, (192,), generator=gen)
    results = {}
    for keep, chunks_formed in ((0, 12), (2 * 256_000, 10), (2 * 256_000 + 255_999, 11), (10**9, 6)):
        formed.clear()
        hk, wk = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = chunked_token_logprobs(hk, wk, pos, tok, chunk_size=16, reuse_bytes=keep)
        out.sum().backward()
        assert len(formed) == chunks_formed, (keep, formed)
        results[keep] = (out.detach(), hk.grad, wk.grad)
    for out, grad_h, grad_w in results.values():
        assert torch.allclose(out, results[0][0], atol=1e-5) and torch.allclose(grad_h, results[0][1], atol=1e-5)
        assert torch.allclose(grad_w, results[0][2], atol=1e-5)
    assert token_logprobs.keep_bytes_for(3 * 256_000, 4000, 16) == 2 * 256_000
    assert token_logprobs.keep_bytes_for(100, 4000, 16) == 0
    with pytest.raises(CsdError, match="reuse_bytes"):
        chunked_token_logprobs(h, w, pos, tok, reuse_bytes=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_logprobs_bf16_cuda():
    """bf16 hidden/LM head on GPU: bf16 matmuls, float32 softmax and accumulation."""
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(512, 128, generator=gen) * 0.3).cuda()
    w = (torch.randn(32000, 128, generator=gen) * 0.3).cuda()
    pos = torch.arange(512).cuda()
    tok = torch.randint(0, 32000, (512,), generator=gen).cuda()
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    out = chunked_token_logprobs(hb, wb, pos, tok, chunk_size=128)
    out.sum().backward()
    hd, wd = hb.detach().double().requires_grad_(True), wb.detach().double().requires_grad_(True)
    ref = _dense_reference(hd, wd, pos, tok)
    ref.sum().backward()
    assert out.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16
    assert float((out.double() - ref).abs().max()) < 0.05
    assert float((hb.grad.double() - hd.grad).abs().max()) < 0.05


def test_bad_requests_raise_csd_error():
    h, w = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(CsdError, match="outside"):
        chunked_token_logprobs(h, w, torch.tensor([4]), torch.tensor([0]))
    with pytest.raises(CsdError, match="outside"):
        chunked_token_logprobs(h, w, torch.tensor([0]), torch.tensor([10]))
    with pytest.raises(CsdError, match="hidden"):
        chunked_token_logprobs(h, torch.randn(10, 4), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(CsdError, match="divergence"):
        csd_loss(logits=torch.randn(4, 10), ce_positions=[0], ce_tokens=[1], teachers=[], divergence="l2")
    with pytest.raises(CsdError, match="CE token"):
        csd_loss(logits=torch.randn(4, 10), ce_positions=[], ce_tokens=[], teachers=[])
    assert math.isfinite(float(csd_loss(logits=torch.randn(4, 10), ce_positions=[0], ce_tokens=[1]).loss))
