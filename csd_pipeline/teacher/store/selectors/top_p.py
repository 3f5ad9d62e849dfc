"""`teacher-logits --top-p P`: each position keeps its most likely entries until their probabilities reach P.

Per position, the smallest n whose n most likely entries hold probability >= P (float32 log-probs summed in
float64), at least 1, and where the kept top-k holds less than P, all of them. Exact: the kept values are the
teacher's own. Recorded as `config.top_p` (null without it) and the shard metadata `csd.top_p`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from csd_pipeline.teacher.store.selectors import Entries, Selector, check_share


def mass_lengths(logprobs: np.ndarray, top_p: float) -> np.ndarray:
    """Per position, the smallest n whose n most likely entries hold probability >= top_p, at most k.

    logprobs: float [P, k], each row descending (a top-k). Probabilities are summed in float64. The
    first entry always counts (n >= 1); where the k entries hold less than top_p, n = k.
    """
    probs = np.exp(np.asarray(logprobs, dtype=np.float64))
    before = np.zeros_like(probs)  # the mass of the entries more likely than each one
    np.cumsum(probs[:, :-1], axis=1, out=before[:, 1:])
    return np.maximum(np.count_nonzero(before < top_p, axis=1), 1).astype(np.int64)


@dataclass(frozen=True)
class TopP(Selector):
    """The most likely entries of each position until they hold probability `p`."""

    p: float
    name = "top-p"
    order = 20

    @classmethod
    def check_options(cls, config) -> None:
        check_share(config.top_p, "--top-p", "a mass", "0.99")

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> TopP | None:
        return None if config.get("top_p") is None else cls(config["top_p"])

    def identity(self) -> dict:
        return {"top_p": self.p}

    def metadata(self) -> dict:
        return {b"csd.top_p": repr(float(self.p)).encode()}

    def cut(self, entries: Entries, distribution=None) -> Entries:
        return replace(entries, lengths=np.minimum(entries.lengths, mass_lengths(entries.logprobs, self.p)))
