"""`--teacher-top-k N`: the N most likely stored entries per position, exactly as a top-N capture."""

from __future__ import annotations

import numpy as np

from csd_pipeline.teacher.store.reader import TeacherTopkRow
from trainer.loader import most_likely_entries


def test_keeps_the_n_most_likely_entries_of_every_position():
    rng = np.random.default_rng(0)
    positions, k = 50, 32
    logits = rng.normal(size=(positions, 1000))
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    full_order = np.argsort(-logprobs, axis=1)
    ids = full_order[:, :k]
    stored = np.take_along_axis(logprobs, ids, axis=1)
    shuffle = rng.permuted(np.tile(np.arange(k), (positions, 1)), axis=1)  # storage order is free
    row = TeacherTopkRow("r", np.take_along_axis(ids, shuffle, axis=1).astype(np.int32),
                         np.take_along_axis(stored, shuffle, axis=1).astype(np.float32),
                         logprobs[np.arange(positions), 0].astype(np.float32))
    kept = most_likely_entries(row, 8)
    assert kept.ids.shape == (positions, 8) and kept.logprobs.shape == (positions, 8)
    for p in range(positions):
        assert set(kept.ids[p].tolist()) == set(full_order[p, :8].tolist())  # a top-8 capture's ids
        np.testing.assert_allclose(kept.logprobs[p], logprobs[p, kept.ids[p]], rtol=1e-6)
    np.testing.assert_array_equal(kept.observed_logprob, row.observed_logprob)
    assert most_likely_entries(row, 32) is row and most_likely_entries(row, 64) is row


def test_variable_length_rows_keep_at_most_their_own_entries():
    """A row written with --top-p: position 0 holds 1 entry, position 1 all 6, position 2 holds 3;
    keeping 4 leaves 1, 4 and 3 entries, padding (id -1, log-prob -inf) after them."""
    ids = np.array([[7, -1, -1, -1, -1, -1], [1, 2, 3, 4, 5, 6], [9, 8, 6, -1, -1, -1]], np.int32)
    logprobs = np.array([[-0.01, -np.inf, -np.inf, -np.inf, -np.inf, -np.inf],
                         [-1.0, -1.5, -2.0, -2.5, -3.0, -3.5],
                         [-0.5, -1.2, -2.9, -np.inf, -np.inf, -np.inf]], np.float32)
    row = TeacherTopkRow("r", ids, logprobs, np.array([-0.01, -1.5, np.nan], np.float32), lengths=np.array([1, 6, 3]))
    kept = most_likely_entries(row, 4)
    assert kept.lengths.tolist() == [1, 4, 3]
    assert [kept.entries(t)[0].tolist() for t in range(3)] == [[7], [1, 2, 3, 4], [9, 8, 6]]
    assert kept.ids[0, 1:].tolist() == [-1, -1, -1] and np.isneginf(kept.logprobs[2, 3])


def test_refused_where_the_stored_entries_are_no_top_k(tmp_path):
    """The one check on what the manifest records (`TeacherTopkOutput.require_exact`): a store of tail draws or
    of CSD's event entries holds no top-N to cut; a top-p or min-p store does (its first entries are the top)."""
    import pytest

    from csd_pipeline.errors import CsdError
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from trainer.data import _check_top_k

    def output(**selectors):
        return TeacherTopkOutput(tmp_path, {"config": {"top_k": 16, "top_p": None, **selectors}, "shards": []})

    _check_top_k(8, output(top_p=0.9, min_p=0.01))
    _check_top_k(0, output(tail_samples=4))  # 0: every stored entry, nothing cut
    for selectors, named in (({"tail_samples": 4}, "--tail-samples"), ({"keep": "csd-events"}, "--keep csd-events")):
        with pytest.raises(CsdError, match=rf"--teacher-top-k 8 reads .* {named}.*pass --teacher-top-k 0"):
            _check_top_k(8, output(**selectors))
