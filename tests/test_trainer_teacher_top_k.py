"""`--teacher-top-k N`: the N most likely stored entries per position, exactly as a top-N capture."""

from __future__ import annotations

import numpy as np

from csd_pipeline.teacher.reader import TeacherTopkRow
from trainer.loader import keep_most_likely


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
    kept = keep_most_likely(row, 8)
    assert kept.ids.shape == (positions, 8) and kept.logprobs.shape == (positions, 8)
    for p in range(positions):
        assert set(kept.ids[p].tolist()) == set(full_order[p, :8].tolist())  # a top-8 capture's ids
        np.testing.assert_allclose(kept.logprobs[p], logprobs[p, kept.ids[p]], rtol=1e-6)
    np.testing.assert_array_equal(kept.observed_logprob, row.observed_logprob)
    assert keep_most_likely(row, 32) is row and keep_most_likely(row, 64) is row
