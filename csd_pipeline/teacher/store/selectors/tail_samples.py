"""`teacher-logits --tail-samples N`: the kept top-k plus N draws from the rest of the distribution.

A truncated top-k hands the CSD loss the teacher's tail only as one lump, REST. With tail samples
each position also stores a few ids drawn from what the kept entries leave out, each with an
*estimate* of its probability instead of its own value, so that the stored entries carry the
teacher's whole mass in expectation (the importance-sampled KD of sparse logit sampling):

- the tail of a position is every id of the tokenizer outside its kept entries (`--top-k`, `--top-p`,
  `--min-p`) and other than its observed next token (which the loss reads at its exact value anyway);
  its mass m is summed from the softmax over the model's whole output (ids beyond the tokenizer size
  are in the normaliser but never drawn);
- N ids are drawn with replacement, each with probability p_i / m; an id drawn c times is stored once
  with the value log(c * m / N). For every id i of the tail, E[c * m / N] = p_i: an event's mass
  (a sum of entries) is unbiased, and so is REST (1 minus the events). The loss's teacher temperature
  (P^(1/T), renormalised) then acts on the estimates, so a tempered target is not unbiased; measured,
  T = 1.5 still trains better than T = 1 on such a store (docs/SCALE.md);
- where the observed token is not among the stored entries but is more likely than the least likely of
  them, it is stored too, at its exact value: the encoding codes an observed value outside the entries
  as a gap below the position's last stored value (`codec.encode_block`), which must not be negative.

A served teacher (`--teacher-server`) returns only its --server-top-k K' most likely entries of each position:
there the tail is drawn among the K' that are not kept (nor the observed token), each with probability p_i / m as
above, and a draw that falls on the mass beyond the K' (m minus theirs) is dropped (`draw_served_tail`). An id
among the K' is drawn exactly as often as in-process, so its estimate is as unbiased; ids beyond the K' are never
stored, and their mass stays in REST.

Draws come from a `torch.Generator` seeded per block of rows (`TailSamples.block_seed`: `--sample-seed` and the
block's first row id), so a re-run of a shard draws the same ids: the same bytes on the same device (a
GPU batch split after running out of memory draws anew).
The stored values of drawn ids are estimates, not the teacher's log-probabilities: a sampled store
serves the CSD loss; the baselines (which sort or compare whole rows) refuse it (not `exact`).
Recorded as `config.tail_samples` and `config.sample_seed`, and the shard metadata `csd.tail_samples`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.selectors import Distribution, Entries, Selector, ServedTop


def block_seed(sample_seed: int, first_row_id: str) -> int:
    """The generator seed of a block of rows: a function of `--sample-seed` and its first row's id."""
    digest = hashlib.sha256(f"{int(sample_seed)}:{first_row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw_tail(weights, indices, kept, next_ids, total, samples: int, generator, vocab_limit: int):
    """Draw `samples` tail ids per position (torch, on the logits' device).

    weights: float32 [P, V] the unnormalised probabilities exp(logit - peak) of each position, over the
    model's whole output, *overwritten* (the kept entries, the observed token and ids at or beyond the
    tokenizer size become 0); indices: int64 [P, k] the top-k ids, most likely first; kept: int64 [P]
    how many of them are kept (>= 1); next_ids: int64 [P] the observed next token (-1: none);
    total: float32 [P] the sum of `weights` before any was zeroed (exp(lse - peak)); vocab_limit: the
    tokenizer's size.

    Returns (draws int64 [P, samples] with -1 where the tail is empty, log_tail float64 [P] the log of the
    tail's probability, -inf where empty).
    """
    import torch

    positions, k = indices.shape
    weights[:, vocab_limit:] = 0.0
    columns = torch.arange(k, device=indices.device)[None, :]
    weights.scatter_(1, torch.where(columns < kept[:, None], indices, indices[:, :1]), 0.0)
    weights.scatter_(1, torch.where(next_ids >= 0, next_ids, indices[:, 0])[:, None], 0.0)
    tail = weights.sum(dim=-1)
    log_tail = torch.log(tail.double()) - torch.log(total.double())
    draws = torch.full((positions, samples), -1, dtype=torch.long, device=weights.device)
    has_tail = tail > 0
    if bool(has_tail.any()):
        draws[has_tail] = torch.multinomial(weights[has_tail], samples, replacement=True, generator=generator)
    return draws, torch.where(has_tail, log_tail, torch.full_like(log_tail, -np.inf))


def draw_served_tail(top, kept, samples: int):
    """Draw `samples` tail ids per position among a served teacher's K' entries (module docstring).

    top: the row's `ServedTop`; kept: int [P] how many of its first entries the store keeps (>= 1).
    Returns (draws int64 [P, samples], -1 where a draw fell beyond the K' or the tail is empty; log_tail float64
    [P] the log of the tail's probability m, -inf where empty), as `draw_tail` does.
    """
    import torch

    positions, width = top.ids.shape
    probs = np.exp(top.logprobs)
    is_kept = np.arange(width)[None, :] < np.asarray(kept)[:, None]
    is_observed = top.ids == top.next_ids[:, None]
    observed = np.where(np.isnan(top.observed), 0.0, np.exp(top.observed))
    extra = np.where(is_kept | is_observed, 0.0, probs)
    tail = 1.0 - (probs * is_kept).sum(axis=1) - np.where((is_kept & is_observed).any(axis=1), 0.0, observed)
    tail = np.maximum(tail, extra.sum(axis=1))  # the server's rounding must not leave the K' more than the tail
    weights = np.concatenate([extra, (tail - extra.sum(axis=1))[:, None]], axis=1)
    draws = np.full((positions, samples), -1, dtype=np.int64)
    has_tail = tail > 0
    if has_tail.any():
        columns = torch.multinomial(torch.from_numpy(weights[has_tail]), samples, replacement=True,
                                    generator=top.generator).numpy()
        beyond = np.full((int(has_tail.sum()), 1), -1, dtype=np.int64)
        draws[has_tail] = np.take_along_axis(np.concatenate([top.ids[has_tail], beyond], axis=1), columns, axis=1)
    with np.errstate(divide="ignore"):
        return draws, np.where(has_tail, np.log(tail), -np.inf)


def merge_tail(ids, logprobs, kept, draws, log_tail, observed_ids, observed):
    """The stored entries of each position: its `kept` most likely entries, then the distinct drawn ids
    at log(count * tail / N), then (where needed, see the module doc) the observed token; most likely
    first, then padding (id 0 at -inf).

    ids int [P, k], logprobs float32 [P, k] (descending), kept int [P]; draws int64 [P, N] (-1: no tail);
    log_tail float64 [P]; observed_ids int [P] (-1: none); observed float32 [P] their exact log-probs.
    Returns (ids int32 [P, k + N + 1], logprobs float32 [P, k + N + 1], lengths int64 [P]).
    """
    positions, k = ids.shape
    samples = draws.shape[1]
    width = k + samples + 1
    out_ids = np.full((positions, width), -1, dtype=np.int64)
    out_lp = np.full((positions, width), -np.inf, dtype=np.float64)
    top = np.arange(k)[None, :] < kept[:, None]
    out_ids[:, :k] = np.where(top, ids, -1)
    out_lp[:, :k] = np.where(top, logprobs, -np.inf)
    # distinct draws of each position and how often each was drawn
    ordered = np.sort(draws, axis=1)
    first = np.ones_like(ordered, dtype=bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    slot = np.cumsum(first, axis=1) - 1
    counts = np.zeros((positions, samples), dtype=np.int64)
    np.add.at(counts, (np.arange(positions)[:, None].repeat(samples, 1), slot), 1)
    distinct = np.full((positions, samples), -1, dtype=np.int64)
    distinct[np.arange(positions)[:, None].repeat(samples, 1), slot] = ordered
    drawn = (counts > 0) & (distinct >= 0)
    estimate = np.log(np.maximum(counts, 1)) + log_tail[:, None] - np.log(samples)
    out_ids[:, k:k + samples] = np.where(drawn, distinct, -1)
    out_lp[:, k:k + samples] = np.where(drawn, estimate, -np.inf)
    # the observed token, where its gap below the last stored value would be negative
    stored = out_ids >= 0
    least = np.where(stored, out_lp, np.inf).min(axis=1)
    among = ((out_ids == np.asarray(observed_ids)[:, None]) & stored).any(axis=1)
    add = (np.asarray(observed_ids) >= 0) & ~among & (np.asarray(observed, dtype=np.float64) > least)
    out_ids[add, -1] = np.asarray(observed_ids)[add]
    out_lp[add, -1] = np.asarray(observed, dtype=np.float64)[add]
    order = np.argsort(-out_lp, axis=1, kind="stable")
    out_ids = np.take_along_axis(out_ids, order, axis=1)
    out_lp = np.take_along_axis(out_lp, order, axis=1)
    lengths = (out_ids >= 0).sum(axis=1).astype(np.int64)
    # padding: id 0 at -inf (the encoder checks every id; it stores only each position's `lengths`)
    return np.maximum(out_ids, 0).astype(np.int32), out_lp.astype(np.float32), lengths


@dataclass(frozen=True)
class TailSamples(Selector):
    """`samples` draws from the rest of each position's distribution, at estimated values (`seed`: --sample-seed)."""

    samples: int
    seed: int = 0
    name = "tail-samples"
    order = 40
    exact = False
    inexact = "holds --tail-samples draws at estimated values (teacher-logits --tail-samples)"
    needs_distribution = True
    served = True

    @classmethod
    def check_options(cls, config) -> None:
        from csd_pipeline.teacher.store.codec import MAX_K

        if not 0 <= config.tail_samples <= MAX_K - 1 - config.top_k:
            raise CsdError(f"--tail-samples {config.tail_samples} is out of range with --top-k {config.top_k}; pass 0 "
                           f"(none) up to {max(MAX_K - 1 - config.top_k, 0)} (--top-k + --tail-samples + 1 <= {MAX_K}).")

    @classmethod
    def from_config(cls, config: dict, aligned=None) -> TailSamples | None:
        samples = int(config.get("tail_samples") or 0)
        return cls(samples, int(config.get("sample_seed") or 0)) if samples else None

    def identity(self) -> dict:
        return {"tail_samples": self.samples, "sample_seed": self.seed}

    def metadata(self) -> dict:
        return {b"csd.tail_samples": str(int(self.samples)).encode()}

    def width(self, width: int) -> int:
        return width + self.samples + 1  # the draws and the observed token

    def block_seed(self, first_row_id: str) -> int:
        return block_seed(self.seed, first_row_id)

    def cut(self, entries: Entries, distribution: Distribution | None) -> Entries:
        import torch

        if distribution is None:
            raise ValueError("tail samples are drawn from the teacher's whole distribution, inside the forward")
        if isinstance(distribution, ServedTop):
            draws, log_tail = draw_served_tail(distribution, entries.lengths, self.samples)
        else:
            kept = torch.from_numpy(entries.lengths).to(distribution.indices.device)
            draws, log_tail = draw_tail(distribution.weights, distribution.indices, kept, distribution.next_ids,
                                        distribution.total, self.samples, distribution.generator,
                                        distribution.vocab_limit)
            draws, log_tail = draws.cpu().numpy(), log_tail.cpu().numpy()
        ids, logprobs, lengths = merge_tail(entries.ids, entries.logprobs, entries.lengths, draws, log_tail,
                                            entries.next_ids, entries.observed)
        return replace(entries, ids=ids, logprobs=logprobs, lengths=lengths)
