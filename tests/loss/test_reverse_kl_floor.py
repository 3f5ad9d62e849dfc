"""Reverse KL with a teacher whose events hold all of its mass: finite, with the REST floor."""

from __future__ import annotations

import math

import numpy as np
import pytest

from csd_pipeline.events.batch import BatchEvents
from csd_pipeline.loss.csd import REVERSE_KL_TEACHER_REST_FLOOR, csd_divergence


def _one_chunk(teacher_logq) -> BatchEvents:
    """One 1:1 chunk at position 0 whose events are student tokens 0 and 1."""
    i64 = lambda values: np.asarray(values, dtype=np.int64)  # noqa: E731
    empty = i64([])
    return BatchEvents(empty, empty, empty, i64([0, 0]), i64([0, 1]), i64([0, 1]), i64([0, 0]),
                       np.asarray(teacher_logq, dtype=np.float64), i64([0]), chunk_student_start=i64([1]),
                       chunk_student_len=i64([1]), chunk_teacher_loglik=np.asarray([math.log(0.75)]))


@pytest.mark.parametrize("divergence", ["reverse_kl", "kl", "jsd"])
def test_teacher_without_rest_mass(divergence):
    import torch

    logits = torch.tensor([[0.3, -0.2, 1.1]], dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(logits, dim=-1)
    events = _one_chunk([math.log(0.25), math.log(0.75)]).to("cpu")
    term = csd_divergence(logp.new_zeros(0), logp[0, :2], events, divergence=divergence, beta=1.0)
    term.divergence_sum.backward()
    # the brute-force value, float64, from the explicit distributions
    p_s = torch.softmax(logits.detach(), dim=-1)[0].tolist()
    rest_t = REVERSE_KL_TEACHER_REST_FLOOR if divergence == "reverse_kl" else 0.0
    p_t = [0.25, 0.75, rest_t]
    if divergence == "reverse_kl":
        expected = sum(s * math.log(s / t) for s, t in zip(p_s, p_t))
    elif divergence == "kl":
        expected = sum(t * math.log(t / s) for s, t in zip(p_s, p_t) if t > 0)
    else:
        m = [(s + t) / 2 for s, t in zip(p_s, p_t)]
        expected = 0.5 * sum(t * math.log(t / x) for t, x in zip(p_t, m) if t > 0) + 0.5 * sum(
            s * math.log(s / x) for s, x in zip(p_s, m))
    assert math.isfinite(float(term.divergence_sum))
    assert float(term.divergence_sum) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert torch.isfinite(logits.grad).all()
