"""What a generation backend does, whatever runs it (transformers now; vLLM could be added later).

A backend gets prompts as token ids and one seed per sample, and returns the ids each sample wrote.
It must give the same ids for the same (prompt, seed, settings) and the same batch, so that a shard's
bytes depend only on the shard's prompts and the config. `sample_seed` derives a sample's seed from
the run's seed and the prompt's identity, never from its batch or rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn: temperature (0: greedy), top-p, and the stopping rule."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop_ids: tuple[int, ...]  # ids that end a sample (not written into the completion)
    pad_id: int


@dataclass(frozen=True)
class Generation:
    """What one sample wrote: its ids (without the stop id) and why it stopped ("stop" or "length")."""

    ids: list[int]
    finish: str


class GenerationBackend(Protocol):
    """Writes samples for a batch of prompts."""

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Generation]:
        """One `Generation` per prompt (prompts[i] is sampled with seeds[i])."""


def sample_seed(seed: int, source: str, record_index: int, sample: int) -> int:
    """A 63-bit seed for sample `sample` of the prompt (source, record_index)."""
    digest = hashlib.sha256(f"{seed}\0{source}\0{record_index}\0{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
