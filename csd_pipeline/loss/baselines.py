"""The baseline losses of `csd-train --loss uld|gold|strict`, from the same shards as CSD (docs/TRAINING.md).

They read, per accepted chunk, the teacher's explicit entries at the chunk's final predictor
position (the stored top-k plus the observed token, `loss.teacher_rows.ChunkRows`) and the
student's whole next-token row there. Student rows are formed a few at a time (`chunk_size`
positions: logits = h W^T, log-softmax) under activation checkpointing, so memory stays bounded
as for CSD's chunked gather; backward recomputes them.

Per chunk c, with chain_S / chain_T the probabilities of the chunk's earlier tokens on each side
(the chain-rule merge of GOLD's `bayesian` strategy; 1 for a single token):

- student merged row S = chain_S * p_S(. | final position), over every student id (not normalised);
- teacher explicit entries T(e) = chain_T * q_T(e), e in E_c, and the teacher's tail
  chain_T * max(0, 1 - sum_E q_T), the mass the stored values do not place.

uld    sum over ranks i <= |E_c| of |S_(i) - T_(i)| (both sorted, largest first) + |student tail -
       teacher tail|, the student's tail being its mass outside its |E_c| largest entries: the
       Wasserstein-1 closed form of ULD on the stored top-k plus one tail bucket per side.
gold   w * sum_{j in M_c} d(T_j, S_j) + (1 - w) * (uld on everything outside M_c); M_c = the shared
       spelling classes among E_c (ids with equal bytes summed), d the elementwise terms of the
       divergence on these unnormalised values; w defaults to the share of teacher ids that have a
       shared spelling (TRL's adaptive weight).
strict 1:1 chunks only. Both rows projected onto the shared spelling classes; a class outside E_c
       gets, per teacher id, the tail mass (at least STRICT_TAIL_FLOOR) spread evenly over the teacher
       ids outside E_c; optionally only the student's top-N classes; both renormalised on that
       support; D(P_T, P_S), reverse KL by default.

The KD term is the sum over chunks divided by the global chunk count (no beta), combined with CE
by `loss.csd.combine_losses`. torch is imported inside functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.csd import (
    DIVERGENCES,
    KdTerm,
    LossOutput,
    _accumulation_dtype,
    _empty_metrics,
    chunked_token_logprobs,
    combine_losses,
    dense_token_logprobs,
    divergence_terms,
)
from csd_pipeline.loss.teacher_rows import BASELINE_LOSSES

STRICT_TAIL_FLOOR = 1e-6
_AUTO_ROW_ELEMENTS = 1 << 23  # student row elements per checkpointed chunk (32 MiB in float32)


def baseline_loss(
    kind: str,
    *,
    ce_positions,
    ce_tokens,
    teachers: Sequence = (),
    hidden=None,
    weight=None,
    logits=None,
    teacher_weights: Sequence[float] | None = None,
    global_ce_tokens: int | float | None = None,
    global_chunk_counts: Sequence[int | float] | None = None,
    divergence: str = "jsd",
    gold_matched_weight: float | None = None,
    strict_top_k: int = 0,
    strict_divergence: str = "reverse_kl",
    chunk_size: int | None = None,
    kd_scale=None,
) -> LossOutput:
    """CE + the `kind` baseline KD term ("uld", "gold" or "strict") for one batch.

    Give either `hidden` [P, H] and `weight` [V, H] (checkpointed rows, memory O(chunk_size x V)) or
    `logits` [P, V] (tests). teachers: one `ChunkRows` per teacher. divergence: GOLD's direct term
    (jsd: TRL's default generalized JSD with beta 0.5); strict_divergence: the strict loss's D;
    gold_matched_weight: w in [0, 1] (None: adaptive); strict_top_k: N (0: every shared class).
    Other arguments as `loss.csd.csd_loss`. Raises CsdError on bad options or inputs.
    """
    import torch

    if kind not in BASELINE_LOSSES:
        raise CsdError(f"unknown baseline loss {kind!r}; choose one of {', '.join(BASELINE_LOSSES)}.")
    for name, value in (("divergence", divergence), ("strict divergence", strict_divergence)):
        if value not in DIVERGENCES:
            raise CsdError(f"unknown {name} {value!r}; choose one of {', '.join(DIVERGENCES)}.")
    if gold_matched_weight is not None and not 0 <= gold_matched_weight <= 1:
        raise CsdError(f"the GOLD matched weight must be within [0, 1], got {gold_matched_weight} (gold_matched_weight).")
    if strict_top_k < 0:
        raise CsdError(f"strict_top_k must be 0 (all shared classes) or more, got {strict_top_k}.")
    if (logits is None) == (hidden is None or weight is None):
        raise CsdError("baseline_loss needs either hidden and weight (chunked path) or logits, not both.")
    device = logits.device if logits is not None else hidden.device
    ce_positions = torch.as_tensor(ce_positions, dtype=torch.int64).to(device)
    ce_tokens = torch.as_tensor(ce_tokens, dtype=torch.int64).to(device)
    teachers = [t.to(device) for t in teachers]
    pos_parts, tok_parts = [ce_positions] + [t.chain_pos for t in teachers], [ce_tokens] + [t.chain_tok for t in teachers]
    positions, tokens = torch.cat(pos_parts), torch.cat(tok_parts)
    if logits is not None:
        gathered = dense_token_logprobs(logits, positions, tokens)
        rows_of = partial(_rows_from_logits, logits)
        width = logits.shape[1]
    else:
        gathered = chunked_token_logprobs(hidden, weight, positions, tokens, chunk_size=chunk_size)
        rows_of = partial(_rows_from_hidden, hidden, weight)
        width = weight.shape[0]
    pieces = torch.split(gathered, [p.numel() for p in pos_parts])
    options = {"kind": kind, "divergence": divergence, "matched_weight": gold_matched_weight,
               "top_n": int(strict_top_k), "strict_divergence": strict_divergence}
    terms = []
    for i, rows in enumerate(teachers):
        size = chunk_size or max(8, _AUTO_ROW_ELEMENTS // max(width, rows.shared.num_classes, 1))
        terms.append(_kd_term(pieces[1 + i], rows, rows_of, size, options))
    if global_ce_tokens is None:
        global_ce_tokens = int(ce_positions.numel())
    return combine_losses(-pieces[0].sum(), global_ce_tokens, terms, teacher_weights=teacher_weights,
                          global_chunk_counts=global_chunk_counts, kd_scale=kd_scale)


def _rows_from_logits(logits, positions, fn, *args):
    import torch

    rows = logits[positions]
    return fn(torch.log_softmax(rows.to(_accumulation_dtype(rows.dtype)), dim=-1), *args)


def _hidden_rows(fn, hidden_rows, weight, *args):
    import torch

    logits = hidden_rows @ weight.T
    return fn(torch.log_softmax(logits.to(_accumulation_dtype(hidden_rows.dtype)), dim=-1), *args)


def _rows_from_hidden(hidden, weight, positions, fn, *args):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(partial(_hidden_rows, fn), hidden[positions], weight, *args, use_reentrant=False)


def _kd_term(chain_logprobs, rows, rows_of, size: int, options: dict) -> KdTerm:
    """Sum over the chunks of `rows` of the baseline's per-chunk loss, with diagnostics."""
    import torch

    n = rows.num_chunks
    if n == 0:
        return KdTerm(chain_logprobs.sum() * 0, 0, _empty_metrics(rows))
    dtype = chain_logprobs.dtype
    chain_s = torch.zeros(n, dtype=dtype, device=chain_logprobs.device).index_add(0, rows.chain_chunk, chain_logprobs)
    losses, tails = [], []
    fn = partial(_row_terms, shared=rows.shared, **options)
    for a in range(0, n, size):
        b = min(n, a + size)
        loss, tail = rows_of(rows.final_pos[a:b], fn, chain_s[a:b], rows.teacher_chain_logp[a:b].to(dtype),
                             rows.teacher_logp[a:b].to(dtype), rows.teacher_class[a:b])
        losses.append(loss)
        tails.append(tail.detach())
    per_chunk = torch.cat(losses)
    explicit = torch.isfinite(rows.teacher_logp)
    metrics = _empty_metrics(rows)
    metrics.update(
        events_per_chunk=float(explicit.sum()) / n,
        teacher_event_mass=torch.exp(rows.teacher_logp).sum(-1).mean().detach(),
        student_rest_mass=torch.cat(tails).mean(),
        divergence_per_chunk=per_chunk.detach().mean(),
    )
    return KdTerm(per_chunk.sum(), n, metrics)


def _row_terms(logp, chain_s, chain_t, t_logp, t_class, *, kind, shared, divergence, matched_weight, top_n,
               strict_divergence):
    """(per-chunk loss [b], the student's tail mass [b]) from student log-softmax rows [b, Vs]."""
    if kind == "uld":
        return _sorted_l1(logp, chain_s, chain_t, t_logp, _teacher_tail(t_logp))
    if kind == "gold":
        return _gold(logp, chain_s, chain_t, t_logp, t_class, shared, divergence, matched_weight)
    return _strict(logp, t_logp, t_class, shared, top_n, strict_divergence)


def _teacher_tail(t_logp):
    import torch

    return torch.clamp(1 - torch.exp(t_logp).sum(-1), min=0)


def _sorted_l1(logp, chain_s, chain_t, t_sorted, t_tail):
    """ULD on the top-|E| entries plus one tail bucket; t_sorted: teacher log-probs, largest first, -inf padding."""
    import torch

    width = t_sorted.shape[1]
    n = torch.isfinite(t_sorted).sum(-1)
    cs, ct = torch.exp(chain_s), torch.exp(chain_t)
    if width:
        top, index = logp.topk(width, dim=-1)
        keep = torch.arange(width, device=logp.device)[None, :] < n[:, None]
        rest = logp.scatter(1, index, torch.where(keep, torch.full_like(top, -math.inf), top))
        s_top = torch.where(keep, torch.exp(top), torch.zeros_like(top))
        head = (cs[:, None] * s_top - ct[:, None] * torch.exp(t_sorted)).abs().sum(-1)
    else:
        rest, head = logp, torch.zeros_like(cs)
    s_tail = torch.exp(torch.logsumexp(rest, dim=-1))
    return head + (cs * s_tail - ct * t_tail).abs(), s_tail


def _class_logsumexp(values, slot, n_classes: int):
    """log of the sum of exp(values) [b, V] per class (slot [b or 1, V] in [0, n_classes]; slot n_classes is dropped)."""
    import torch

    b = values.shape[0]
    slot = slot.expand(b, -1)
    peak = torch.full((b, n_classes + 1), -math.inf, dtype=values.dtype, device=values.device)
    peak = peak.scatter_reduce(1, slot, values.detach(), reduce="amax", include_self=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros_like(peak).scatter_add(1, slot, torch.exp(values - peak.gather(1, slot)))
    return (torch.log(total) + peak)[:, :n_classes]


def _slots(classes, n_classes: int):
    import torch

    return torch.where(classes >= 0, classes, torch.full_like(classes, n_classes))


def _gold(logp, chain_s, chain_t, t_logp, t_class, shared, divergence, matched_weight):
    import torch

    k = shared.num_classes
    s_slot = _slots(shared.student_class, k)[None, :]
    t_slot = _slots(t_class, k)
    log_s = chain_s[:, None] + _class_logsumexp(logp, s_slot, k)
    log_t = chain_t[:, None] + _class_logsumexp(t_logp, t_slot, k)
    shared_entry = (t_class >= 0) & torch.isfinite(t_logp)
    matched = torch.zeros(t_logp.shape[0], k + 1, dtype=logp.dtype, device=logp.device)
    matched = matched.scatter_add(1, t_slot, shared_entry.to(logp.dtype)) > 0
    matched[:, k] = False
    m = matched[:, :k]
    zero = torch.zeros_like(log_s)
    terms = divergence_terms(torch.where(m, log_t, zero), torch.where(m, log_s, zero), divergence)
    direct = torch.where(m, terms, zero).sum(-1)
    unmatched_ids = matched.index_select(1, s_slot[0])
    t_rest = torch.where(t_class < 0, t_logp, torch.full_like(t_logp, -math.inf)).sort(dim=-1, descending=True).values
    sorted_part, s_tail = _sorted_l1(logp.masked_fill(unmatched_ids, -math.inf), chain_s, chain_t, t_rest,
                                     _teacher_tail(t_logp))
    w = adaptive_matched_weight(shared) if matched_weight is None else float(matched_weight)
    return w * direct + (1 - w) * sorted_part, s_tail


def adaptive_matched_weight(shared) -> float:
    """TRL's adaptive GOLD weight: the share of teacher ids that have a shared spelling."""
    return float(shared.class_teacher_size.sum()) / max(1, int(shared.teacher_vocab_size))


def _strict(logp, t_logp, t_class, shared, top_n, divergence):
    import torch

    k = shared.num_classes
    log_s = _class_logsumexp(logp, _slots(shared.student_class, k)[None, :], k)
    explicit = torch.isfinite(t_logp)
    t_prob = torch.exp(t_logp)
    tail = torch.clamp(1 - t_prob.sum(-1), min=STRICT_TAIL_FLOOR)
    each = tail / (shared.teacher_vocab_size - explicit.sum(-1)).to(logp.dtype)
    t_cls = each[:, None] * shared.class_teacher_size[None, :].to(logp.dtype)
    own = torch.where(t_class >= 0, t_prob - each[:, None], torch.zeros_like(t_prob))
    t_cls = t_cls + torch.zeros(t_cls.shape[0], k + 1, dtype=logp.dtype, device=logp.device).scatter_add(
        1, _slots(t_class, k), own)[:, :k]
    log_t = torch.log(t_cls)
    if 0 < top_n < k:
        index = log_s.detach().topk(top_n, dim=-1).indices
        log_s, log_t = log_s.gather(1, index), log_t.gather(1, index)
    support = torch.logsumexp(log_s, dim=-1, keepdim=True)
    log_ps = log_s - support
    log_pt = log_t - torch.logsumexp(log_t, dim=-1, keepdim=True)
    return divergence_terms(log_pt, log_ps, divergence).sum(-1), 1 - torch.exp(support[:, 0])
