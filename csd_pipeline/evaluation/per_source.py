"""Held-out bits per byte per source: each window's nats and bytes, summed by the corpus file it came from.

Packing puts several windows in one row, so the per-token log-probabilities of a batch are summed per
window (`window_nats`: a segment sum over the window's content tokens, in float64) and each window's sum
goes to its row's `source` (`SourceTally`). The overall figure is still computed as before, from the
same log-probabilities; the per-source sums recombine to it up to the rounding of that overall sum
(float64 sums here, a float32 sum in the trainer's loss). `TokenScores` is the held-out CE of
`loss.training.cross_entropy_only` that also hands back the per-token log-probabilities, for the
trainer's sharded evaluation (its forward runs the LM head inside the FSDP root).
"""

from __future__ import annotations

import math

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.training import CeLoss, cross_entropy_only

TOKEN_LOGPROBS = "token_logprobs"  # the key of `TokenScores`'s per-token log-probabilities in its metrics


def window_nats(token_logprobs, window_tokens) -> np.ndarray:
    """Summed -log p per window (float64 [W]) of a batch's per-token log-probabilities, given in window
    order with `window_tokens[w]` tokens each. Raises `CsdError` when the counts do not add up."""
    values = np.asarray(token_logprobs, dtype=np.float64)
    counts = np.asarray(window_tokens, dtype=np.int64)
    if values.shape[0] != int(counts.sum()):
        raise CsdError(f"{values.shape[0]} token log-probabilities for windows of {int(counts.sum())} tokens; "
                       "the held-out batch and its scores do not match")
    return np.bincount(np.repeat(np.arange(counts.shape[0]), counts), weights=-values, minlength=counts.shape[0])


class SourceTally:
    """Nats, bytes, tokens and windows per source, over `sources` (the same sorted list on every rank)."""

    def __init__(self, sources: list[str]):
        self.sources = list(sources)
        self._index = {s: i for i, s in enumerate(self.sources)}
        self.counts = np.zeros((len(self.sources), 4), dtype=np.float64)  # nats, bytes, tokens, windows

    def add(self, batch, token_logprobs) -> None:
        """Add one `HeldOutBatch`'s windows, given its per-token log-probabilities (window order)."""
        nats = window_nats(token_logprobs, batch.window_tokens)
        for source, n, size, tokens in zip(batch.window_sources, nats, batch.window_bytes, batch.window_tokens,
                                           strict=True):
            self.counts[self._index[source]] += (n, size, tokens, 1)

    def flat(self) -> list[float]:
        """The counts as one list of floats (for an all-reduce)."""
        return self.counts.ravel().tolist()

    def load(self, values: list[float]) -> None:
        """Replace the counts with `values` as `flat` lists them (e.g. summed over ranks)."""
        self.counts = np.asarray(values, dtype=np.float64).reshape(len(self.sources), 4)

    def by_source(self) -> dict:
        """{source: {"bits_per_byte", "nats", "bytes", "tokens", "rows"}} of the sources with scored bytes."""
        out = {}
        for source, (nats, n_bytes, tokens, rows) in zip(self.sources, self.counts.tolist(), strict=True):
            if n_bytes:
                out[source] = {"bits_per_byte": nats / n_bytes / math.log(2), "nats": nats, "bytes": int(n_bytes),
                               "tokens": int(tokens), "rows": int(rows)}
        return out


class TokenScores(CeLoss):
    """The held-out CE (`cross_entropy_only`, the same sum to the last bit) plus its per-token log-probabilities
    in `metrics[TOKEN_LOGPROBS]` (detached), so the caller can sum them per window."""

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        import torch

        from csd_pipeline.loss.csd import LossOutput
        from csd_pipeline.loss.token_logprobs import chunked_token_logprobs, dense_token_logprobs

        if teachers:
            raise CsdError("held-out scoring reads no teacher; pass teachers=()")
        device = logits.device if logits is not None else hidden.device
        positions = torch.as_tensor(ce_positions, dtype=torch.int64).to(device)
        tokens = torch.as_tensor(ce_tokens, dtype=torch.int64).to(device)
        options = self.options
        if logits is not None:
            gathered = dense_token_logprobs(logits, positions, tokens)
        else:
            gathered = chunked_token_logprobs(hidden, weight, positions, tokens, chunk_size=self._chunk_size(),
                                              reuse_bytes=options["loss_reuse_mb"] << 20,
                                              reuse_dtype=options["loss_reuse_dtype"])
        count = positions.numel() if global_ce_tokens is None else global_ce_tokens
        ce = -gathered.sum() / float(count)  # as `csd_loss` then `combine_losses` compute it
        return LossOutput(loss=ce, ce=ce, kd=torch.zeros_like(ce), metrics={TOKEN_LOGPROBS: gathered.detach()})


def token_scores(chunk_size: int | None = None) -> TokenScores:
    """`TokenScores` with the options of `cross_entropy_only(chunk_size)`."""
    return TokenScores("ce", cross_entropy_only(chunk_size).options)
