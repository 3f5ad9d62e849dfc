"""The `--top-k` selector: at most the k most likely entries, whichever width they were computed at."""

from __future__ import annotations

import numpy as np

from csd_pipeline.teacher.store.selectors import SelectorChain, TopK, chain_from_config
from tests.teacher.test_stage import float64_reference


def test_declares_its_part_of_the_store():
    top_k = TopK(8)
    assert top_k.identity() == {"top_k": 8} and top_k.metadata() == {} and top_k.exact
    assert top_k.width(255) == 8 and not top_k.needs_distribution and not top_k.reads_aligned
    chain = chain_from_config({"top_k": 8, "top_p": None, "keep": "top-k", "tail_samples": 0})
    assert chain == SelectorChain((top_k,)) and chain.identity() == {"top_k": 8, "top_p": None}  # as version 2 records


def test_a_top_8_of_a_top_32_is_the_forward_top_8(tiny_runner, text_rows, wide_rows, tiny_teacher):
    """Cut from the top-32 or taken by the forward, the entries are the 8 most likely of the float64 softmax."""
    chain = chain_from_config({"top_k": 8})
    forward = tiny_runner(chain.position_selectors(), top_k=8).run(text_rows)
    for wide, direct, ids in zip(wide_rows, forward, text_rows):
        cut = chain.cut_row(wide, ids)
        assert cut.ids.shape == (len(ids), 8) and (cut.lengths == 8).all()
        np.testing.assert_array_equal(cut.logprobs, direct.logprobs)
        np.testing.assert_array_equal(cut.observed_logprob, direct.observed_logprob)
        reference = float64_reference(tiny_teacher, ids)[:, :49152]
        eighth = np.sort(reference, axis=1)[:, -8]  # the 8th largest log-prob of each position
        chosen = np.take_along_axis(reference, cut.ids.astype(np.int64), axis=1)
        assert (chosen >= eighth[:, None] - 1e-4).all()  # only ties to float noise may swap an id
        np.testing.assert_allclose(cut.logprobs, chosen, atol=1e-4, rtol=0)
