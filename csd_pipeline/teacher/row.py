"""One teacher row: the teacher's log-probabilities at each position of one aligned row, the one type that the
runner produces, the store reads back and the losses' CPU preparation checks (`events.row_events.teacher_positions`).

Position t predicts teacher token t+1. `ids` int [T, k] and `logprobs` float [T, k] are the stored entries of each
position, most likely first; the first `lengths[t]` are real, the rest padding (id -1, log-prob -inf: never an
index). `observed_logprob` float [T]: the log-probability of token t+1 (NaN at the last position). `status`
(`csd_pipeline.teacher.store.schema.RowStatus`): 0 OK; a rejected row (non-finite values) must be left out of the KD loss (the
store keeps it with empty [0, k] arrays). `row_id`: the aligned row's id (None where the runner has not paired it
yet). Tests may give dense log-probs of the whole vocabulary instead: `ids` None and `logprobs` [T, V].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TeacherTopkRow:
    """The teacher's values for one aligned row (see the module docstring)."""

    row_id: str | None
    ids: np.ndarray | None
    logprobs: np.ndarray
    observed_logprob: np.ndarray
    status: int = 0
    lengths: np.ndarray | None = None  # int64 [T]; None: every position holds all k entries

    def __post_init__(self):
        if self.lengths is None and self.ids is not None:
            self.lengths = np.full(self.ids.shape[0], self.ids.shape[1], np.int64)

    @property
    def ok(self) -> bool:
        """True when the row holds values (status 0); rejected rows must be left out of the KD loss."""
        return self.status == 0

    @property
    def dense(self) -> bool:
        """True for dense log-probs of the whole vocabulary (tests), False for stored entries."""
        return self.ids is None

    def entries(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, log-probs) of the real entries of position t, most likely first (no padding)."""
        n = int(self.lengths[t])
        return self.ids[t, :n], self.logprobs[t, :n]
