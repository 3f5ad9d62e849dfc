"""The baseline losses of `csd-train --loss uld|gold|strict`, from the same shards as CSD (docs/LOSSES.md).

They read, per accepted chunk, the teacher's explicit entries at the chunk's final predictor
position (the stored top-k plus the observed token, `events.baseline_rows.BaselineRows`) and the
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
from csd_pipeline.events.baseline_rows import BASELINE_LOSSES
from csd_pipeline.loss.csd import (
    DIVERGENCES,
    KdTerm,
    LossOutput,
    chunk_count_metrics,
    combine_losses,
    divergence_terms,
)
from csd_pipeline.loss.token_logprobs import accumulation_dtype, gather_parts, student_inputs

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
    `logits` [P, V] (tests). teachers: one `BaselineRows` per teacher. divergence: GOLD's direct term
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
    device, ce_positions, ce_tokens, teachers = student_inputs(ce_positions, ce_tokens, teachers, hidden=hidden,
                                                                weight=weight, logits=logits, loss="baseline_loss")
    n_positions = logits.shape[0] if logits is not None else hidden.shape[0]
    # CE at the first teacher's final positions is taken from the rows computed there anyway
    ce_at = torch.full((n_positions,), -1, dtype=torch.int64, device=device)
    ce_at[ce_positions] = ce_tokens
    row_ce = [ce_at[t.final_pos] if i == 0 else torch.full_like(t.final_pos, -1) for i, t in enumerate(teachers)]
    elsewhere = torch.ones(n_positions, dtype=torch.bool, device=device)
    if teachers:
        elsewhere[teachers[0].final_pos] = False
    keep = elsewhere[ce_positions]
    pos_parts = [ce_positions[keep]] + [t.chain_pos for t in teachers]
    tok_parts = [ce_tokens[keep]] + [t.chain_tok for t in teachers]
    pieces = gather_parts(pos_parts, tok_parts, hidden=hidden, weight=weight, logits=logits, chunk_size=chunk_size)
    if logits is not None:
        rows_of, width = partial(_rows_from_logits, logits), logits.shape[1]
    else:
        rows_of, width = partial(_rows_from_hidden, hidden, weight), weight.shape[0]
    options = {"kind": kind, "divergence": divergence, "matched_weight": gold_matched_weight,
               "top_n": int(strict_top_k), "strict_divergence": strict_divergence}
    ce_sum, terms = -pieces[0].sum(), []
    for i, rows in enumerate(teachers):
        size = chunk_size or max(8, _AUTO_ROW_ELEMENTS // max(width, 1))
        term, ce_part = _kd_term(pieces[1 + i], rows, row_ce[i], rows_of, size, options)
        terms.append(term)
        ce_sum = ce_sum - ce_part
    if global_ce_tokens is None:
        global_ce_tokens = int(ce_positions.numel())
    return combine_losses(ce_sum, global_ce_tokens, terms, teacher_weights=teacher_weights,
                          global_chunk_counts=global_chunk_counts, kd_scale=kd_scale)


def _rows_from_logits(logits, positions, fn, chain_s, teacher):
    rows = logits[positions]
    return fn(rows.to(accumulation_dtype(rows.dtype)), chain_s, teacher)


def _hidden_rows(fn, hidden_rows, weight, chain_s, teacher):
    return fn((hidden_rows @ weight.T).to(accumulation_dtype(hidden_rows.dtype)), chain_s, teacher)


def _rows_from_hidden(hidden, weight, positions, fn, chain_s, teacher):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(partial(_hidden_rows, fn), hidden[positions], weight, chain_s, teacher, use_reentrant=False)


_TEACHER_FIELDS = ("teacher_chain_logp", "teacher_logp", "class_id", "class_logp", "class_count", "unshared_logp")


def _kd_term(chain_logprobs, rows, ce_token, rows_of, size: int, options: dict):
    """(KdTerm: the sum over the chunks of `rows` of the baseline's per-chunk loss, with diagnostics; the sum of
    the student's log-probs of `ce_token` [C] at the chunks' final positions, -1: none)."""
    import torch

    n = rows.num_chunks
    if n == 0:
        zero = chain_logprobs.sum() * 0
        return KdTerm(zero, 0, chunk_count_metrics(rows)), zero
    dtype = chain_logprobs.dtype
    chain_s = torch.zeros(n, dtype=dtype, device=chain_logprobs.device).index_add(0, rows.chain_chunk, chain_logprobs)
    losses, tails, ce = [], [], []
    fn = partial(_row_terms, shared=rows.shared, **options)
    for a in range(0, n, size):
        b = min(n, a + size)
        teacher = {k: getattr(rows, k)[a:b] for k in _TEACHER_FIELDS}
        teacher = {k: v.to(dtype) if v.is_floating_point() else v for k, v in teacher.items()}
        teacher["ce_token"] = ce_token[a:b]
        loss, tail, ce_lp = rows_of(rows.final_pos[a:b], fn, chain_s[a:b], teacher)
        losses.append(loss)
        tails.append(tail.detach())
        ce.append(ce_lp)
    per_chunk = torch.cat(losses)
    metrics = chunk_count_metrics(rows)
    metrics.update(
        events_per_chunk=float(torch.isfinite(rows.teacher_logp).sum()) / n,
        teacher_event_mass=torch.exp(rows.teacher_logp).sum(-1).mean().detach(),
        student_rest_mass=torch.cat(tails).mean(),
        divergence_per_chunk=per_chunk.detach().mean(),
    )
    return KdTerm(per_chunk.sum(), n, metrics), torch.cat(ce).sum()


def _row_terms(logits, chain_s, teacher, *, kind, shared, divergence, matched_weight, top_n, strict_divergence):
    """(per-chunk loss [b], the student's tail mass [b], its log-prob of teacher["ce_token"] [b] or 0) from the
    student's logits at the chunks' final positions [b, Vs]."""
    import torch

    lse = torch.logsumexp(logits, dim=-1)
    target = teacher["ce_token"]
    ce = torch.where(target >= 0, logits.gather(1, target.clamp(min=0)[:, None])[:, 0] - lse, torch.zeros_like(lse))
    if kind == "strict":
        return *_strict(logits, lse, teacher, shared, top_n, strict_divergence), ce
    chain_t = teacher["teacher_chain_logp"]
    tail = torch.clamp(1 - torch.exp(teacher["teacher_logp"]).sum(-1), min=0)
    if kind == "uld":
        top = _top_values(logits, teacher["teacher_logp"].shape[1]) - lse[:, None]
        return *_sorted_l1(top, torch.zeros_like(lse), chain_s, chain_t, teacher["teacher_logp"], tail), ce
    return *_gold(logits, lse, chain_s, chain_t, teacher, tail, shared, divergence, matched_weight), ce


def _top_values(logits, width: int):
    return logits.topk(min(width, logits.shape[1]), dim=-1).values if width else logits[:, :0]


def _sorted_l1(s_top, s_excluded, chain_s, chain_t, t_sorted, t_tail):
    """ULD on the top-|E| entries plus one tail bucket.

    s_top: the student's largest log-probs [b, >= W], descending; s_excluded: mass of the student's row that
    is not in play (GOLD's matched classes); t_sorted: the teacher's log-probs [b, W], descending, -inf padding.
    """
    import torch

    width = t_sorted.shape[1]
    keep = torch.arange(width, device=t_sorted.device)[None, :] < torch.isfinite(t_sorted).sum(-1)[:, None]
    top = torch.where(keep, torch.exp(s_top[:, :width]), torch.zeros_like(t_sorted))
    s_tail = torch.clamp(1 - s_excluded - top.sum(-1), min=0)
    cs, ct = torch.exp(chain_s), torch.exp(chain_t)
    head = (cs[:, None] * top - ct[:, None] * torch.exp(t_sorted)).abs().sum(-1)
    return head + (cs * s_tail - ct * t_tail).abs(), s_tail


def _class_logits(logits, class_ids, student_ids):
    """log-sum-exp of the student's logits over the ids of each class: class_ids [b, W] -> [b, W] (-inf padding)."""
    import torch

    b, width = class_ids.shape
    ids = student_ids[class_ids.clamp(min=0)]  # [b, W, L]
    valid = (ids >= 0) & (class_ids >= 0)[..., None]
    values = logits.gather(1, ids.clamp(min=0).reshape(b, -1)).reshape(ids.shape)
    return torch.logsumexp(torch.where(valid, values, torch.full_like(values, -math.inf)), dim=-1), ids, valid


def _gold(logits, lse, chain_s, chain_t, teacher, tail, shared, divergence, matched_weight):
    import torch

    class_id = teacher["class_id"]
    log_class, ids, valid = _class_logits(logits, class_id, shared.class_student_ids)
    log_class = log_class - lse[:, None]
    m = class_id >= 0
    zero = torch.zeros_like(log_class)
    terms = divergence_terms(torch.where(m, chain_t[:, None] + teacher["class_logp"], zero),
                             torch.where(m, chain_s[:, None] + log_class, zero), divergence)
    direct = torch.where(m, terms, zero).sum(-1)
    # the student's largest entries outside the matched classes: the top W3 + (matched ids) holds them
    unshared = teacher["unshared_logp"]
    matched_ids = torch.where(valid, ids, torch.full_like(ids, -1)).reshape(ids.shape[0], -1)
    values, index = logits.topk(min(unshared.shape[1] + matched_ids.shape[1], logits.shape[1]), dim=-1)
    is_matched = (index[:, :, None] == matched_ids[:, None, :]).any(-1)
    order = torch.sort(is_matched.to(torch.int8), dim=1, stable=True).indices
    s_top = values.gather(1, order) - lse[:, None]
    excluded = torch.where(m, torch.exp(log_class), zero).sum(-1)
    sorted_part, s_tail = _sorted_l1(s_top, excluded, chain_s, chain_t, unshared, tail)
    w = adaptive_matched_weight(shared) if matched_weight is None else float(matched_weight)
    return w * direct + (1 - w) * sorted_part, s_tail


def adaptive_matched_weight(shared) -> float:
    """TRL's adaptive GOLD weight: the share of teacher ids that have a shared spelling."""
    return float(shared.class_teacher_size.sum()) / max(1, int(shared.teacher_vocab_size))


def _all_class_logits(logits, student_ids):
    """log-sum-exp of the student's logits over the ids of every shared class [b, K]."""
    import torch

    out = logits.index_select(1, student_ids[:, 0])
    for r in range(1, student_ids.shape[1]):  # classes with more than one id (equal bytes)
        classes = torch.nonzero(student_ids[:, r] >= 0).flatten()
        more = torch.logaddexp(out.index_select(1, classes), logits.index_select(1, student_ids[classes, r]))
        out = out.index_copy(1, classes, more)
    return out


def _strict(logits, lse, teacher, shared, top_n, divergence):
    import torch

    log_s = _all_class_logits(logits, shared.class_student_ids)
    t_logp = teacher["teacher_logp"]
    tail = torch.clamp(1 - torch.exp(t_logp).sum(-1), min=STRICT_TAIL_FLOOR)
    each = tail / (shared.teacher_vocab_size - torch.isfinite(t_logp).sum(-1)).to(logits.dtype)
    t_cls = each[:, None] * shared.class_teacher_size[None, :].to(logits.dtype)
    class_id = teacher["class_id"]
    own = torch.where(class_id >= 0, torch.exp(teacher["class_logp"]) - each[:, None] * teacher["class_count"],
                      torch.zeros_like(teacher["class_logp"]))
    log_t = torch.log(t_cls.scatter_add(1, class_id.clamp(min=0), own))
    k = log_s.shape[1]
    if 0 < top_n < k:
        index = log_s.detach().topk(top_n, dim=-1).indices
        log_s, log_t = log_s.gather(1, index), log_t.gather(1, index)
    support = torch.logsumexp(log_s, dim=-1, keepdim=True)
    log_ps, log_pt = log_s - support, log_t - torch.logsumexp(log_t, dim=-1, keepdim=True)
    rest = 1 - torch.exp(support[:, 0] - lse).detach()
    return _normalised_divergence(log_pt, log_ps, divergence), rest


def _normalised_divergence(log_pt, log_ps, divergence: str):
    """D(P_T, P_S) of two normalised rows with every entry positive (natural log)."""
    import torch

    pt, ps = torch.exp(log_pt), torch.exp(log_ps)
    if divergence == "kl":
        return (pt * (log_pt - log_ps)).sum(-1)
    if divergence == "reverse_kl":
        return (ps * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_pt, log_ps) - math.log(2.0)
    return 0.5 * (pt * (log_pt - log_m)).sum(-1) + 0.5 * (ps * (log_ps - log_m)).sum(-1)
