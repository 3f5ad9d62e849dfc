"""The CSD loss (SPEC §5): divergences over chunk events, combined with the cross-entropy.

The loss side of CSD only gathers the student's log-probabilities at (position, token) pairs
(`loss.token_logprobs`) and sums them per chunk; every event was already enumerated on the CPU
(`events.row_events`).

- `csd_divergence(...)` turns gathered log-probs and a `BatchEvents` into the weighted sum of
  D(P_T, P_S) over the chunks (a `KdTerm`), vectorised (segment sums, no Python loop per chunk).
- `combine_losses(...)` divides by the global counts and applies L = CE + sg(CE/KD) KD.
- `csd_loss(...)` does all of it in one call, for one or several teachers.

torch is imported inside functions so that importing this module is cheap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.token_logprobs import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_REUSE_BYTES,
    DEFAULT_REUSE_DTYPE,
    gather_parts,
    student_inputs,
)
from schemas.aligned import SHAPES

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from csd_pipeline.events.batch import BatchEvents

DIVERGENCES = ("jsd", "kl", "reverse_kl")
DEFAULT_DIVERGENCE = "jsd"  # the paper's
DEFAULT_BETA = 5.0  # the paper's weight of the non-1:1 chunks in the KD term
# Reverse KL's floor on the teacher's REST mass. A stored top-k whose events add up to 1 after
# rounding leaves the teacher a REST of exactly 0, and KL(P_S || P_T) is then infinite for any
# student with REST mass. The stored rows cannot rule out mass outside them, so the floor keeps the
# term finite (at most -log 1e-6 = 13.8 nats per unit of student REST); kl and jsd need no floor.
REVERSE_KL_TEACHER_REST_FLOOR = 1e-6


def check_divergence(divergence: str) -> None:
    """Raise `CsdError` unless `divergence` is one of `DIVERGENCES`."""
    if divergence not in DIVERGENCES:
        raise CsdError(f"unknown divergence {divergence!r}; choose one of {', '.join(DIVERGENCES)}.")


# How several teachers' KD terms combine: a weighted sum of per-teacher means, or one teacher per group
# of chunks (`events.teacher_select`) and one mean over the kept chunks (docs/LOSSES.md).
KD_COMBINES = ("sum", "select")


# ----------------------------------------------------------------------------------------------
# Divergence over events
# ----------------------------------------------------------------------------------------------


def segment_logsumexp(values: torch.Tensor, segment: torch.Tensor, n_segments: int) -> torch.Tensor:
    """logsumexp of `values` grouped by `segment` ids in [0, n_segments); empty segments give -inf."""
    import torch

    neg_inf = torch.full((n_segments,), -math.inf, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return neg_inf
    peak = neg_inf.scatter_reduce(0, segment, values.detach(), reduce="amax", include_self=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros(n_segments, dtype=values.dtype, device=values.device)
    total = total.index_add(0, segment, torch.exp(values - peak[segment]))
    return torch.log(total) + peak


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable; x >= 0 (REST rounded to zero or below) gives -inf."""
    import torch

    empty = x >= 0
    safe = torch.where(empty, torch.full_like(x, -1.0), x)
    near_zero = safe > -math.log(2.0)
    a = torch.log(-torch.expm1(torch.where(near_zero, safe, torch.full_like(x, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -1.0), safe)))
    out = torch.where(near_zero, a, b)
    return torch.where(empty, torch.full_like(x, -math.inf), out)


def divergence_terms(log_p_t: torch.Tensor, log_p_s: torch.Tensor, divergence: str) -> torch.Tensor:
    """Per-entry terms of D(P_T, P_S) from log-probabilities (sum them per chunk).

    0 log 0 = 0: entries with probability 0 contribute nothing and pass no NaN gradient.
    `divergence`: "jsd" (0.5 mixture, natural log), "kl" (KL(P_T||P_S)), "reverse_kl" (KL(P_S||P_T)).
    """
    import torch

    check_divergence(divergence)
    zt = torch.isneginf(log_p_t)
    zs = torch.isneginf(log_p_s)
    zero = torch.zeros_like(log_p_s)
    lt = torch.where(zt, zero, log_p_t)
    ls = torch.where(zs, zero, log_p_s)
    pt = torch.where(zt, zero, torch.exp(lt))
    ps = torch.where(zs, zero, torch.exp(ls))
    if divergence == "kl":
        return torch.where(zt, zero, pt * (lt - log_p_s))
    if divergence == "reverse_kl":
        return torch.where(zs, zero, ps * (ls - log_p_t))
    # jsd: against the mixture M = (P_T + P_S) / 2
    log_m = torch.where(zt, ls, torch.where(zs, lt, torch.logaddexp(lt, ls))) + math.log(0.5)
    log_m = torch.where(zt & zs, zero, log_m)
    return 0.5 * torch.where(zt, zero, pt * (lt - log_m)) + 0.5 * torch.where(zs, zero, ps * (ls - log_m))


@dataclass
class KdTerm:
    """One teacher's KD contribution for the local batch (before dividing by the global count).

    divergence_sum: sum over local accepted chunks of w_c * D_c (w = 1 for 1:1, beta otherwise).
    chunk_count: local number of accepted KD chunks (unweighted; all-reduce it for the global count).
    metrics: detached tensors / ints (events per chunk, explicit teacher mass, student REST, shapes).
    """

    divergence_sum: Any
    chunk_count: int
    metrics: dict = field(default_factory=dict)


def csd_divergence(
    chain_logprobs: torch.Tensor,
    final_logprobs: torch.Tensor,
    events: BatchEvents,
    *,
    divergence: str = DEFAULT_DIVERGENCE,
    beta: float = DEFAULT_BETA,
    teacher_temperature: float = 1.0,
    chunk_weight=None,
) -> KdTerm:
    """Weighted sum of D(P_T^c, P_S^c) over the chunks of `events` (SPEC §5).

    chain_logprobs [Gc] / final_logprobs [Gf]: student log-probs gathered at
    (events.chain_pos, events.chain_tok) and (events.final_pos, events.final_tok); `events` must be
    on the same device (`BatchEvents.to`). log q_S(event) = sum of its chunk's chain log-probs +
    logsumexp of its final gathers; REST = 1 - sum of events (both sides; under reverse KL the
    teacher's REST is at least REVERSE_KL_TEACHER_REST_FLOOR). Weighted by 1 for 1:1
    chunks and `beta` otherwise. `teacher_temperature` T (default 1: the paper's) softens the
    teacher's chunk distribution, events and REST together: P_T(e)^(1/T), renormalised over the
    chunk. `chunk_weight` (optional, detached [C]) multiplies each chunk's term as well
    (`loss.chunk_weights`). Returns a KdTerm. Raises CsdError for an unknown divergence or a temperature that is
    not positive.
    """
    import torch

    check_divergence(divergence)
    if not (teacher_temperature > 0 and math.isfinite(teacher_temperature)):
        raise CsdError(f"teacher temperature must be a positive number, got {teacher_temperature}")
    n_chunks = int(events.num_chunks)
    n_events = int(events.event_chunk.shape[0])
    dtype = final_logprobs.dtype
    device = final_logprobs.device
    if n_chunks == 0:
        zero = final_logprobs.sum() * 0 + chain_logprobs.sum() * 0
        return KdTerm(zero, 0, chunk_count_metrics(events))
    chunk_of_event = events.event_chunk
    chain_sum = torch.zeros(n_chunks, dtype=dtype, device=device).index_add(
        0, events.chain_chunk, chain_logprobs.to(dtype)
    )
    log_qs = chain_sum[chunk_of_event] + segment_logsumexp(final_logprobs, events.final_event, n_events)
    log_qt = events.event_teacher_logq.to(dtype)
    log_mass_s = segment_logsumexp(log_qs, chunk_of_event, n_chunks)
    log_mass_t = segment_logsumexp(log_qt, chunk_of_event, n_chunks)
    log_rest_s = log1mexp(log_mass_s)
    log_rest_t = log1mexp(log_mass_t)
    if divergence == "reverse_kl":
        log_rest_t = torch.clamp_min(log_rest_t, math.log(REVERSE_KL_TEACHER_REST_FLOOR))
    entry_chunk = torch.cat([chunk_of_event, torch.arange(n_chunks, device=device)])
    log_pt = torch.cat([log_qt, log_rest_t])
    if teacher_temperature != 1.0:
        log_pt = log_pt / teacher_temperature
        log_pt = log_pt - segment_logsumexp(log_pt, entry_chunk, n_chunks)[entry_chunk]
    terms = divergence_terms(log_pt, torch.cat([log_qs, log_rest_s]), divergence)
    per_chunk = torch.zeros(n_chunks, dtype=dtype, device=device).index_add(0, entry_chunk, terms)
    is_one_to_one = events.chunk_shape == 0
    shape_weight = torch.where(
        is_one_to_one, torch.ones_like(per_chunk), torch.full_like(per_chunk, float(beta))
    )
    if chunk_weight is not None:
        shape_weight = shape_weight * chunk_weight.to(dtype)
    metrics = chunk_count_metrics(events)
    metrics.update(
        events_per_chunk=n_events / n_chunks,
        teacher_event_mass=torch.exp(log_mass_t).mean().detach(),
        student_rest_mass=torch.exp(log_rest_s).mean().detach(),
        divergence_per_chunk=per_chunk.detach().mean(),
    )
    return KdTerm((shape_weight * per_chunk).sum(), n_chunks, metrics)


def chunk_count_metrics(events) -> dict:
    """A KD term's chunk counts per shape (`chunks_1:1`, ...) and in all (`chunks`), of `BatchEvents` or any
    batch with `shape_counts()` and `num_chunks`."""
    counts = events.shape_counts()
    return {f"chunks_{name}": counts[i] for i, name in enumerate(SHAPES)} | {"chunks": events.num_chunks}


# ----------------------------------------------------------------------------------------------
# Combining CE and KD
# ----------------------------------------------------------------------------------------------


@dataclass
class LossOutput:
    """loss = ce + sg(ce/kd) * kd (or ce); ce and kd are divided by the global counts.

    kd_terms: per teacher KdTerm (their divergence sums and local chunk counts); metrics: floats
    or detached 0-dim tensors (call float() when logging).
    """

    loss: Any
    ce: Any
    kd: Any
    kd_terms: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


def kd_multiplier(ce, kd, kd_scale=None):
    """The detached multiplier of KD in L = CE + scale * KD: `kd_scale` when given, else sg(CE/KD) (0 when KD is 0)."""
    import torch

    if kd_scale is not None:
        return torch.as_tensor(kd_scale, dtype=ce.dtype, device=ce.device).detach()
    kd_d = kd.detach()
    nonzero = kd_d != 0
    return torch.where(nonzero, ce.detach() / torch.where(nonzero, kd_d, torch.ones_like(kd_d)), kd_d * 0)


def combine_losses(
    ce_sum: torch.Tensor,
    global_ce_tokens: int | float,
    kd_terms: Sequence[KdTerm],
    *,
    teacher_weights: Sequence[float] | None = None,
    global_chunk_counts: Sequence[int | float] | None = None,
    kd_scale: torch.Tensor | float | None = None,
) -> LossOutput:
    """L = CE + sg(CE/KD)·KD with CE = ce_sum / global_ce_tokens and KD = Σ w_i · sum_i / count_i.

    global_ce_tokens: number of CE target tokens over the whole global batch (all ranks and
    accumulation steps). global_chunk_counts: per teacher, the global number of accepted chunks
    (defaults to each term's local count, i.e. one rank and one step). A teacher with no chunks
    contributes 0. L = CE when KD is 0 or there are no chunks. kd_scale overrides the detached
    CE/KD ratio (e.g. a ratio the trainer all-reduced); by default it is computed from these values.
    Raises CsdError on mismatched list lengths or a non-positive token count.
    """
    import torch

    n = len(kd_terms)
    weights = [1.0] * n if teacher_weights is None else [float(w) for w in teacher_weights]
    if len(weights) != n:
        raise CsdError(f"got {len(weights)} teacher weights for {n} teachers; give one weight per teacher.")
    counts = [t.chunk_count for t in kd_terms] if global_chunk_counts is None else list(global_chunk_counts)
    if len(counts) != n:
        raise CsdError(f"got {len(counts)} global chunk counts for {n} teachers; give one per teacher.")
    if global_ce_tokens is None or float(global_ce_tokens) <= 0:
        raise CsdError(
            f"the global CE token count is {global_ce_tokens}; the batch has no student tokens to train "
            "on, check student_loss_mask in the aligned shards."
        )
    ce = ce_sum / float(global_ce_tokens)
    kd = torch.zeros_like(ce)
    per_teacher = []
    for w, c, term in zip(weights, counts, kd_terms, strict=True):
        kd_i = term.divergence_sum / float(c) if float(c) > 0 else torch.zeros_like(ce)
        per_teacher.append(kd_i)
        kd = kd + w * kd_i
    scale = kd_multiplier(ce, kd, kd_scale)
    loss = ce + scale * kd
    metrics: dict = {"ce": ce.detach(), "kd": kd.detach(), "loss": loss.detach(), "kd_scale": scale}
    for i, (term, kd_i) in enumerate(zip(kd_terms, per_teacher, strict=True)):
        metrics[f"teacher{i}/kd"] = kd_i.detach()
        for key, value in term.metrics.items():
            metrics[f"teacher{i}/{key}"] = value
    return LossOutput(loss=loss, ce=ce, kd=kd, kd_terms=list(kd_terms), metrics=metrics)


def _advantage(events, ce_positions, ce_logprobs, chunk_weighting):
    """`loss.chunk_weights.advantage_weights` of the chunks of `events`: the teacher's chunk log-likelihood
    (`chunk_teacher_loglik`) against the student's, the sum of its CE log-probs over the chunk's student tokens
    (a token that is no CE target adds nothing: accepted chunks lie inside the loss region)."""
    import torch

    from csd_pipeline.loss.chunk_weights import advantage_weights

    dtype, device = ce_logprobs.dtype, ce_logprobs.device
    if events.num_chunks == 0:
        return torch.zeros(0, dtype=dtype, device=device)
    size = int(max(int(ce_positions.max()) if ce_positions.numel() else 0,
                   int((events.chunk_student_start + events.chunk_student_len).max())) + 1)
    at = torch.zeros(size, dtype=dtype, device=device).index_put((ce_positions,), ce_logprobs.detach())
    total = torch.cat([torch.zeros(1, dtype=dtype, device=device), torch.cumsum(at, 0)])
    start = torch.clamp_min(events.chunk_student_start - 1, 0)  # the position that predicts the chunk's first token
    student = total[start + events.chunk_student_len] - total[start]
    scale, cap = chunk_weighting
    return advantage_weights(events.chunk_teacher_loglik, student, scale=scale, cap=cap)


def csd_loss(
    *,
    ce_positions,
    ce_tokens,
    teachers: Sequence[BatchEvents] = (),
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    teacher_weights: Sequence[float] | None = None,
    global_ce_tokens: int | float | None = None,
    global_chunk_counts: Sequence[int | float] | None = None,
    divergence: str = DEFAULT_DIVERGENCE,
    beta: float = DEFAULT_BETA,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    reuse_bytes: int = DEFAULT_REUSE_BYTES,
    reuse_dtype: str = DEFAULT_REUSE_DTYPE,
    kd_scale: torch.Tensor | float | None = None,
    teacher_temperature: float = 1.0,
    chunk_weighting: tuple[float, float] | None = None,
) -> LossOutput:
    """CE + CSD for one batch, from the student's last hidden states and LM head (or logits).

    Give either `hidden` [P, H] and `weight` [V, H] (chunked path, memory O(chunk_size x V), plus
    up to `reuse_bytes` of logits kept for the backward, stored as `reuse_dtype`:
    `token_logprobs.chunked_token_logprobs`) or
    `logits` [P, V]. ce_positions / ce_tokens: flat CE targets (`events.ce_targets`). teachers: one
    `BatchEvents` per teacher (numpy or already on the device). All (position, token) pairs (CE
    and every teacher's events) are gathered in one pass. global_ce_tokens defaults to the local
    number of CE targets; global_chunk_counts to the local chunk counts (see `combine_losses`).
    An empty `teachers` (loss "ce") gives L = CE. chunk_weighting: (scale, cap) of `--kd-chunk-weight
    advantage` (`loss.chunk_weights`; the student's chunk log-likelihood from the CE gathers), None: every
    chunk weighs as SPEC §5 says. Raises CsdError on bad inputs.
    """
    check_divergence(divergence)
    _, ce_positions, ce_tokens, teachers = student_inputs(ce_positions, ce_tokens, teachers, hidden=hidden,
                                                          weight=weight, logits=logits, loss="csd_loss")
    pos_parts = [ce_positions]
    tok_parts = [ce_tokens]
    for ev in teachers:
        pos_parts += [ev.chain_pos, ev.final_pos]
        tok_parts += [ev.chain_tok, ev.final_tok]
    pieces = gather_parts(pos_parts, tok_parts, hidden=hidden, weight=weight, logits=logits, chunk_size=chunk_size,
                          reuse_bytes=reuse_bytes, reuse_dtype=reuse_dtype)
    ce_sum = -pieces[0].sum()
    terms = [
        csd_divergence(
            pieces[1 + 2 * i],
            pieces[2 + 2 * i],
            ev,
            divergence=divergence,
            beta=beta,
            teacher_temperature=teacher_temperature,
            chunk_weight=None if chunk_weighting is None else _advantage(ev, ce_positions, pieces[0], chunk_weighting),
        )
        for i, ev in enumerate(teachers)
    ]
    if global_ce_tokens is None:
        global_ce_tokens = int(ce_positions.numel())
    return combine_losses(
        ce_sum,
        global_ce_tokens,
        terms,
        teacher_weights=teacher_weights,
        global_chunk_counts=global_chunk_counts,
        kd_scale=kd_scale,
    )
