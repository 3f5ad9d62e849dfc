"""The `--min-p` selector: the entries at least r times as likely as the first, against a Python loop."""

from __future__ import annotations

import math

import numpy as np
import pytest

from csd_pipeline.teacher.store.selectors import MinP, chain_from_config


def test_declares_its_part_of_the_store():
    min_p = MinP(0.02)
    assert min_p.identity() == {"min_p": 0.02} and min_p.metadata() == {b"csd.min_p": b"0.02"} and min_p.exact
    assert chain_from_config({"top_k": 32, "min_p": 0.02, "top_p": 0.9}).names == ["top-k", "top-p", "min-p"]


@pytest.mark.parametrize("ratio", [0.005, 0.05, 0.5])
def test_lengths_are_the_python_loop(wide_rows, text_rows, ratio):
    chain = chain_from_config({"top_k": 32, "min_p": ratio})
    for wide, ids in zip(wide_rows, text_rows):
        cut = chain.cut_row(wide, ids)
        expected = [max(sum(math.exp(v - row[0]) >= ratio * (1 - 1e-12) for v in row), 1)
                    for row in wide.logprobs.astype(np.float64).tolist()]
        assert cut.lengths.tolist() == expected


def test_with_top_p_the_fewer_are_kept(wide_rows, text_rows):
    both = chain_from_config({"top_k": 32, "top_p": 0.9, "min_p": 0.05})
    for wide, ids in zip(wide_rows, text_rows):
        alone = [chain_from_config({"top_k": 32, key: value}).cut_row(wide, ids).lengths
                 for key, value in (("top_p", 0.9), ("min_p", 0.05))]
        np.testing.assert_array_equal(both.cut_row(wide, ids).lengths, np.minimum(*alone))
