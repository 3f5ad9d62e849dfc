"""`teacher-logits --top-k K`: each position keeps at most its K most likely entries (the first selector).

The forward itself takes the top-K of the softmax (`TeacherRunner`, on the device, over the tokenizer's ids);
this selector declares that cut and applies it to entries computed wider (a top-128 replayed as a top-32), so a
store keeps the same entries whichever way they were computed. Exact: the kept values are the teacher's own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.selectors import Entries, Selector


@dataclass(frozen=True)
class TopK(Selector):
    """At most the `k` most likely entries of each position."""

    k: int
    name = "top-k"
    order = 10

    @classmethod
    def check_options(cls, config) -> None:
        from csd_pipeline.teacher.store.codec import MAX_K

        if not 1 <= config.top_k <= MAX_K:
            raise CsdError(f"--top-k {config.top_k} is out of range; pass a value in [1, {MAX_K}].")

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> TopK:
        return cls(int(config["top_k"]))  # always set: every store is a top-k first

    def identity(self) -> dict:
        return {"top_k": self.k}

    def width(self, width: int) -> int:
        return self.k

    def cut(self, entries: Entries, distribution=None) -> Entries:
        if entries.ids.shape[1] < self.k:
            raise ValueError(f"a top-{self.k} of entries computed {entries.ids.shape[1]} wide")
        return replace(entries, ids=entries.ids[:, :self.k], logprobs=entries.logprobs[:, :self.k],
                       lengths=np.minimum(entries.lengths, self.k))
