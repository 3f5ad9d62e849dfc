"""The `--top-p` selector: the most likely entries until their probabilities reach p, against a Python loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from csd_pipeline.teacher.store.selectors import TopP, chain_from_config


def loop_lengths(logprobs: np.ndarray, mass: float) -> list[int]:
    """Per position: add entries, most likely first, while the mass of those already added is below `mass`."""
    counts = []
    for row in logprobs.tolist():
        total, n = 0.0, 0
        for value in row:
            if total >= mass:
                break
            total += math.exp(value)
            n += 1
        counts.append(max(n, 1))
    return counts


def test_declares_its_part_of_the_store():
    top_p = TopP(0.9)
    assert top_p.identity() == {"top_p": 0.9} and top_p.metadata() == {b"csd.top_p": b"0.9"} and top_p.exact
    assert top_p.width(32) == 32 and chain_from_config({"top_k": 32, "top_p": 0.9}).names == ["top-k", "top-p"]


@pytest.mark.parametrize("mass", [0.5, 0.9, 0.999])
def test_lengths_are_the_python_loop(wide_rows, text_rows, mass):
    chain = chain_from_config({"top_k": 32, "top_p": mass})
    capped = 0
    for wide, ids in zip(wide_rows, text_rows):
        cut = chain.cut_row(wide, ids)
        expected = loop_lengths(wide.logprobs, mass)
        assert cut.lengths.tolist() == expected
        np.testing.assert_array_equal(cut.logprobs, wide.logprobs)  # a top-p only says how many to keep
        capped += sum(n == 32 for n in expected)
    if mass == 0.999:
        assert capped > 0  # the top-32 holds less than the mass somewhere: all 32 kept there
