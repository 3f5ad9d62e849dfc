"""`teacher-logits --min-p R`: each position keeps the entries at least R times as likely as its most likely one.

Log-probs compared in float64 against the first's + log(R), at least 1 entry: a flat position keeps many, a
peaked one few. Exact: the kept values are the teacher's own. Recorded as `config.min_p` and the shard
metadata `csd.min_p` (both absent without it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from csd_pipeline.teacher.store.selectors import Entries, Selector, check_share


def relative_lengths(logprobs: np.ndarray, min_p: float) -> np.ndarray:
    """Per position, how many entries are at least `min_p` times as likely as the most likely one
    (log-prob >= the first's + log(min_p), compared in float64), at least 1.

    logprobs: float [P, k], each row descending (a top-k).
    """
    values = np.asarray(logprobs, dtype=np.float64)
    floor = values[:, :1] + np.log(min_p)
    return np.maximum(np.count_nonzero(values >= floor, axis=1), 1).astype(np.int64)


@dataclass(frozen=True)
class MinP(Selector):
    """The entries of each position at least `ratio` times as likely as its most likely one."""

    ratio: float
    name = "min-p"
    order = 30

    @classmethod
    def check_options(cls, config) -> None:
        check_share(config.min_p, "--min-p", "a ratio", "0.005")

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> MinP | None:
        return None if config.get("min_p") is None else cls(config["min_p"])

    def identity(self) -> dict:
        return {"min_p": self.ratio}

    def metadata(self) -> dict:
        return {b"csd.min_p": repr(float(self.ratio)).encode()}

    def cut(self, entries: Entries, distribution=None) -> Entries:
        return replace(entries, lengths=np.minimum(entries.lengths, relative_lengths(entries.logprobs, self.ratio)))
