"""Kept chunks stored as 16-bit log-probabilities (`reuse_dtype`), against float64 references.

A kept 16-bit chunk changes only the backward: each probability p is rebuilt as exp(fl(log p)),
where fl rounds to the 16-bit float (unit roundoff u = 2^-11 for float16, 2^-8 for bfloat16;
float16 holds |log p| < 2^-14 as subnormals, absolute error at most 2^-25). So
|dp| <= p (exp(delta) - 1), delta = max(u |log p|, s), and the gradient of the logits,
d = scatter(g) - G p (G: the sum of the upstream gradients at the position), is off by at most
E = |G| p (exp(delta) - 1) per entry; through logits = h W^T the gradients of h and W are off by
at most E |W| and E^T |h|. With float64 inputs everything else is exact to ~1e-15, so these bounds
are the tests' tolerances; the forward values do not change at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import csd_pipeline.loss.token_logprobs as token_logprobs
from csd_pipeline.errors import CsdError
from csd_pipeline.loss.csd import csd_loss
from csd_pipeline.loss.token_logprobs import REUSE_UNIT_ROUNDOFF, chunked_token_logprobs
from tests.loss.test_csd import Case, case_of  # noqa: F401 (a fixture)
from tests.loss_reference import ReferenceTeacher, reference_loss

SUBNORMAL_HALF_SPACING = {"float16": 2.0**-25, "bfloat16": 2.0**-134}
ALL = 1 << 40  # keep every chunk


def _entry_bound(logits: torch.Tensor, g_position: torch.Tensor, reuse_dtype: str) -> torch.Tensor:
    """E[p, v]: the bound on the error of d logits[p, v] (float64) from the 16-bit log-probabilities."""
    logp = torch.log_softmax(logits.double(), -1)
    delta = torch.clamp(REUSE_UNIT_ROUNDOFF[reuse_dtype] * logp.abs(), min=SUBNORMAL_HALF_SPACING[reuse_dtype])
    return g_position.abs()[:, None] * logp.exp() * torch.expm1(delta)


def _chunked(h, w, pos, tok, upstream, chunk, reuse_bytes, reuse_dtype, vocab_block=None):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = chunked_token_logprobs(hh, ww, pos, tok, chunk_size=chunk, reuse_bytes=reuse_bytes, reuse_dtype=reuse_dtype,
                                 vocab_block=vocab_block)
    (out * upstream).sum().backward()
    return out.detach(), hh.grad, ww.grad


def _dense(h, w, pos, tok, upstream):
    hh, ww = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = torch.log_softmax(hh @ ww.T, -1)[pos, tok]
    (out * upstream).sum().backward()
    return out.detach(), hh.grad, ww.grad


def _g_position(pos, upstream, p):
    return torch.zeros(p, dtype=torch.float64).index_add_(0, pos, upstream)


@settings(max_examples=20, deadline=None)
@given(
    p=st.integers(1, 30),
    v=st.integers(2, 400),
    g=st.integers(1, 60),
    chunk=st.integers(1, 40),
    scale=st.sampled_from([0.3, 3.0, 30.0]),
    reuse_dtype=st.sampled_from(["float16", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
    block=st.sampled_from([None, 1, 9]),
)
def test_16bit_kept_gradients_within_the_representation_bound(p, v, g, chunk, scale, reuse_dtype, seed, block):
    """float64 inputs: values equal dense autograd; gradients of h and W within E |W| and E^T |h|."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(p, 6, generator=gen, dtype=torch.float64) * scale
    w = torch.randn(v, 6, generator=gen, dtype=torch.float64)
    pos, tok = torch.randint(0, p, (g,), generator=gen), torch.randint(0, v, (g,), generator=gen)
    upstream = torch.randn(g, generator=gen, dtype=torch.float64)
    out, grad_h, grad_w = _chunked(h, w, pos, tok, upstream, chunk, ALL, reuse_dtype, block)
    ref, ref_h, ref_w = _dense(h, w, pos, tok, upstream)
    bound = _entry_bound(h @ w.T, _g_position(pos, upstream, p), reuse_dtype)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    assert bool(((grad_h - ref_h).abs() <= bound @ w.abs() * (1 + 1e-9) + 1e-12).all())
    assert bool(((grad_w - ref_w).abs() <= bound.T @ h.abs() * (1 + 1e-9) + 1e-12).all())


@pytest.mark.parametrize("reuse_dtype", ["float16", "bfloat16"])
def test_16bit_kept_near_one_and_tiny_probabilities(reuse_dtype):
    """LM head = identity, so the gradient of h is the gradient of the logits, entry by entry:
    positions with p = 1 - 8e-9 (where d = g (1 - p) cancels), p = 1 - 1e-15 (log p in float16's
    subnormal range), 0.997, and probabilities down to e^-489; each entry stays within its bound,
    the cancelling ones within a small relative error, and the rounding is really there (16-bit,
    not float32)."""
    v = 64
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(6, v, generator=gen, dtype=torch.float64)
    h[0, 3] += 22.0  # p(3) = 1 - 7.6e-9
    h[1, 5] += 40.0  # p(5) = 1 - 1.3e-15: log p a float16 subnormal
    h[2] *= 100.0  # probabilities down to e^-489
    h[3, 9] += 9.0  # p(9) = 0.997
    w = torch.eye(v, dtype=torch.float64)
    pos = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5, 5])
    tok = torch.tensor([3, 7, 5, 0, int(h[2].argmax()), 9, 1, 2, 2])
    upstream = torch.tensor([-1.0, 0.3, -1.0, 0.5, -0.7, -1.0, 2.0, -0.25, -0.25], dtype=torch.float64)
    _, grad_h, _ = _chunked(h, w, pos, tok, upstream, 4, ALL, reuse_dtype)
    _, ref_h, _ = _dense(h, w, pos, tok, upstream)
    bound = _entry_bound(h, _g_position(pos, upstream, 6), reuse_dtype)
    err = (grad_h - ref_h).abs()
    assert bool((err <= bound * (1 + 1e-9) + 1e-15).all())
    # d = g (1 - p) at the confident targets: small, yet accurate relative to itself
    assert float(err[0, 3] / ref_h[0, 3].abs()) < 1e-6
    assert float(err[3, 9] / ref_h[3, 9].abs()) < 60 * REUSE_UNIT_ROUNDOFF[reuse_dtype]
    assert float(err.max()) > 0  # the 16-bit rounding happened


@pytest.fixture(scope="module")
def qwen2_reference(case_of):  # noqa: F811 (the fixture)
    """The llama-bpe / qwen2 top-k case, its events and its float64 reference (loss; d loss / d logits), shared by
    both 16-bit dtypes."""
    case: Case = case_of("llama-bpe/qwen2")
    rows, teachers = case.teacher_rows("topk")
    batch, targets = case.events(rows, teachers)
    logits = [(x @ case.weight.T).requires_grad_(True) for x in case.hidden]
    ref = reference_loss(logits, rows, case.s_ref, [ReferenceTeacher(case.t_ref, teachers)])
    ref["loss"].backward()
    return case, batch, targets, float(ref["loss"].detach()), torch.cat([x.grad for x in logits])


@pytest.mark.slow
@pytest.mark.parametrize("reuse_dtype", ["float16", "bfloat16"])
def test_16bit_kept_csd_loss_against_the_float64_reference(qwen2_reference, reuse_dtype):
    """CE + CSD on real llama-bpe / qwen2 rows (top-k teacher): loss equal to the float64 reference;
    gradients within the bound, G of each position read off the reference's logits gradient."""
    case, batch, (cp, ct), ref_loss, d = qwen2_reference
    h0, w0 = torch.cat(case.hidden), case.weight
    h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    out = csd_loss(hidden=h, weight=w, ce_positions=cp, ce_tokens=ct, teachers=[batch], chunk_size=37,
                   reuse_bytes=ALL, reuse_dtype=reuse_dtype)
    out.loss.backward()
    full = h0 @ w0.T
    probs = torch.softmax(full, -1)
    # d = scatter(g) - G p: where nothing was requested, G = -d / p (the median over the row)
    g_position = (-d / probs).median(dim=-1).values
    bound = _entry_bound(full, g_position, reuse_dtype)
    assert abs(float(out.loss.detach()) - ref_loss) < 1e-10
    assert bool(((h.grad - d @ w0).abs() <= bound @ w0.abs() * (1 + 1e-6) + 1e-12).all())
    assert bool(((w.grad - d.T @ h0).abs() <= bound.T @ h0.abs() * (1 + 1e-6) + 1e-12).all())
    assert float((w.grad - d.T @ h0).abs().max()) > 0


def test_float32_kept_path_arithmetic():
    """reuse_dtype float32 (the default) is the arithmetic of the module docstring, bit for bit: one row
    chunk, one vocabulary block, kept (z - m, then exp((z - m) + (m - max) - log sum exp(z - max))) or formed
    again,
    against that arithmetic written out here."""
    gen = torch.Generator().manual_seed(2)
    h, w = torch.randn(40, 16, generator=gen), torch.randn(900, 16, generator=gen)
    pos = torch.arange(40).repeat(2)
    tok = torch.randint(0, 900, (80,), generator=gen)
    upstream = torch.randn(80, generator=gen)
    order = torch.argsort(pos, stable=True)
    logits = h @ w.T
    picked = logits[pos[order], tok[order]]
    peak = logits.amax(dim=-1)
    log_total = logits.sub(peak[:, None]).exp().sum(dim=-1).log()
    lse = peak + log_total
    want_out = torch.empty(80)
    want_out[order] = picked - lse[pos[order]]
    g_row = torch.zeros(40).index_add_(0, pos[order], upstream[order])
    for reuse_bytes in (0, ALL):
        if reuse_bytes:
            p = (logits - peak[:, None]).add_(-log_total[:, None]).exp_()
        else:
            p = (h @ w.T).sub_(lse[:, None]).exp_()
        d = p.mul_(-g_row[:, None])
        d.index_put_((pos[order], tok[order]), upstream[order], accumulate=True)
        want_w = torch.zeros(900, 16).addmm_(d.T, h)
        want_h = torch.zeros(40, 16).index_add_(0, torch.arange(40), torch.zeros(40, 16).addmm_(d, w))
        for kwargs in ({}, {"reuse_dtype": "float32"}):
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = chunked_token_logprobs(hh, ww, pos, tok, chunk_size=40, reuse_bytes=reuse_bytes, **kwargs)
            (out * upstream).sum().backward()
            assert torch.equal(out, want_out) and torch.equal(ww.grad, want_w) and torch.equal(hh.grad, want_h)


def test_16bit_keeps_twice_the_chunks(monkeypatch):
    """The same budget holds twice the 16-bit chunks: 6 chunks of 16 x 4000 (256,000 bytes in
    float32, 128,000 in 16 bits) and a budget of 512,000 bytes keep 2 (float32) or 4 (16-bit)."""
    formed = []
    real = token_logprobs._chunk_logits
    monkeypatch.setattr(token_logprobs, "_chunk_logits", lambda h, w, acc: formed.append(h.shape[0]) or real(h, w, acc))
    gen = torch.Generator().manual_seed(11)
    h, w = torch.randn(96, 16, generator=gen), torch.randn(4000, 16, generator=gen)
    pos, tok = torch.arange(96).repeat(2), torch.randint(0, 4000, (192,), generator=gen)
    for reuse_dtype, chunks_formed in (("float32", 10), ("float16", 8), ("bfloat16", 8)):
        formed.clear()
        out = chunked_token_logprobs(h.clone().requires_grad_(True), w.clone().requires_grad_(True), pos, tok,
                                     chunk_size=16, reuse_bytes=512_000, reuse_dtype=reuse_dtype)
        out.sum().backward()
        assert len(formed) == chunks_formed, (reuse_dtype, formed)
    with pytest.raises(CsdError, match="--loss-reuse-dtype"):
        chunked_token_logprobs(h, w, pos, tok, reuse_dtype="float8")


def test_16bit_kept_float32_inputs_close_to_float64():
    """float32 inputs with float16 kept chunks: within the float16 bound plus the float32 path's own error."""
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(300, 64, generator=gen, dtype=torch.float64) * 0.5
    w = torch.randn(5000, 64, generator=gen, dtype=torch.float64) * 0.5
    pos, tok = torch.arange(300).repeat(3), torch.randint(0, 5000, (900,), generator=gen)
    upstream = torch.randn(900, generator=gen, dtype=torch.float64)
    _, ref_h, ref_w = _dense(h, w, pos, tok, upstream)
    bound = _entry_bound(h @ w.T, _g_position(pos, upstream, 300), "float16")
    errors = {}
    for reuse_dtype in ("float32", "float16"):
        _, grad_h, grad_w = _chunked(h.float(), w.float(), pos, tok, upstream.float(), 64, ALL, reuse_dtype)
        errors[reuse_dtype] = ((grad_h.double() - ref_h).abs(), (grad_w.double() - ref_w).abs())
    float32_h, float32_w = (float(e.max()) for e in errors["float32"])
    assert bool((errors["float16"][0] <= bound @ w.abs() + 4 * float32_h).all())
    assert bool((errors["float16"][1] <= bound.T @ h.abs() + 4 * float32_w).all())
    assert not np.isclose(float(errors["float16"][1].max()), float32_w, rtol=1e-3)
