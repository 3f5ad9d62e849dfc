"""`csd-train --loss alm`: Approximate Likelihood Matching (Minixhofer, Vulić, Ponti, 2025), from the same shards as CSD.

ALM compares, for every aligned chunk (both tokenizations end on the same byte), only how likely each model
finds the chunk's text: log p(chunk) on each side is the sum of the log-probabilities of its own tokens of the
chunk (the teacher's from the store's observed log-probs, the student's from the step's logits). The two are
compared as two Bernoulli distributions, Bernoulli(p_T^(1/tau)) against Bernoulli(p_S^(1/tau)), by binary
cross-entropy with the binarisation temperature tau (`--alm-temperature`, tokenkit's default 100):

    y = exp(log p / tau - 1e-6)
    D_c = -( y_T log y_S + (1 - y_T) log(1 - y_S) )

D includes the teacher's own binary entropy (a constant for the student), as tokenkit's does. The KD term is the
mean of D_c over the accepted chunks (the global chunk count; every chunk weighs 1, tokenkit's "chunk_count"
numerator and denominator), combined with CE by `--kd-scale` / `--kd-weight` like every loss here.

Debiasing (`--alm-debias`, on by default; tokenkit's `alm_mode` "append_space"): a chunk can end inside a word
of one tokenization's likely continuations, so each side's chunk log-likelihood also gets the log of its
probability that the *next* token starts with whitespace (or is a special token) at the chunk's last token.
The student's comes from its whole next-token row there; the teacher's from the store: its stored entries at
that position plus the observed next token (`events.alm_rows`), a lower bound of the whole row's mass.

Taken from tokenkit (github.com/bminixhofer/tokenkit, commit bcacdef43fb01397ff562ed397bddf9c20273194):
`tokenkit/training/losses.py::compute_alm_loss` (the `binary_ce` difference, its epsilon 1e-6, the clip of
the chunk log-likelihoods at 0, "append_space", the chunk-count mean), `tokenkit/utils.py::get_space_mask`
(mode "space+tab+newline+special") and the defaults of `scripts/cross_tokenizer_distill.py`
(binarization_temp 100). Not taken: tokenkit's "unbiased" and "merge_by_space_prob" chunk merging (they need
its precomputed tokenizer-pair bias matrices, or the teacher's whitespace mass at every chunk end to merge
chunks); the chunks here are its "unconstrained" ones, the aligned shards' minimal chunks. Paper: "Universal
Cross-Tokenizer Distillation via Approximate Likelihood Matching", arXiv:2503.20083 (NeurIPS 2025).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.csd import KdTerm, LossOutput, chunk_count_metrics, combine_losses, log1mexp
from csd_pipeline.loss.token_logprobs import accumulation_dtype, gather_parts, student_inputs
from csd_pipeline.loss.training import TEACHER_RERUN, TrainingLoss

DEFAULT_ALM_TEMPERATURE = 100.0  # tokenkit's binarization_temp
ALM_EPSILON = 1e-6  # tokenkit's epsilon in compute_alm_loss: keeps y below 1, so log(1 - y) stays finite
_AUTO_ROW_ELEMENTS = 1 << 23  # student row elements per checkpointed chunk (32 MiB in float32)


def binary_cross_entropy(log_t, log_s, temperature: float):
    """-(y_T log y_S + (1 - y_T) log(1 - y_S)) with y = exp(log p / temperature - ALM_EPSILON), elementwise, from
    the two sides' log-probabilities (<= 0). A teacher probability of 0 (-inf) gives -log(1 - y_S)."""
    import torch

    lt = log_t / temperature - ALM_EPSILON
    ls = log_s / temperature - ALM_EPSILON
    y_t = torch.exp(lt)
    agree = torch.where(y_t > 0, y_t * ls, torch.zeros_like(ls))
    return -(agree + (-torch.expm1(lt)) * log1mexp(ls))


def _space_rows(rows, mask):
    import torch

    rows = rows.to(accumulation_dtype(rows.dtype))
    return torch.logsumexp(rows.masked_fill(~mask, float("-inf")), dim=-1) - torch.logsumexp(rows, dim=-1)


def _space_hidden(hidden_rows, weight, mask):
    return _space_rows(hidden_rows @ weight.T, mask)


def student_space_logmass(positions, mask, *, hidden=None, weight=None, logits=None, chunk_size=None):
    """log of the student's next-token probability on the ids of `mask` (bool [Vs]) at each of `positions`.

    From `logits` [P, V], or from `hidden` [P, H] and `weight` [V, H] a few rows at a time under activation
    checkpointing (the backward forms them again), so memory stays O(chunk_size x V). An LM head wider than the
    tokenizer counts its extra ids as not whitespace."""
    import torch
    from torch.utils.checkpoint import checkpoint

    width = logits.shape[1] if logits is not None else weight.shape[0]
    device = logits.device if logits is not None else hidden.device
    full = torch.zeros(width, dtype=torch.bool, device=device)
    full[:min(width, mask.shape[0])] = mask[:width].to(device)
    size = chunk_size or max(8, _AUTO_ROW_ELEMENTS // max(width, 1))
    parts = []
    for start in range(0, int(positions.numel()), size):
        at = positions[start:start + size]
        if logits is not None:
            parts.append(_space_rows(logits[at], full))
        else:
            parts.append(checkpoint(partial(_space_hidden, mask=full), hidden[at], weight, use_reentrant=False))
    if not parts:
        dtype = accumulation_dtype(logits.dtype if logits is not None else hidden.dtype)
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat(parts)


def alm_divergence(chain_logprobs, student_space, rows, *, temperature: float = DEFAULT_ALM_TEMPERATURE,
                   chunk_weight=None) -> KdTerm:
    """KdTerm of one teacher: the sum over chunks of the binary cross-entropy above.

    chain_logprobs [G]: the student's log-probs at (rows.chain_pos, rows.chain_tok); student_space [C]: its
    whitespace log-mass at rows.end_pos (None unless rows.debias); `rows` (`events.alm_rows.AlmRows`) on the same
    device. chunk_weight: optional [C] multipliers of each chunk's term (detached)."""
    import torch

    count = rows.num_chunks
    if count == 0:
        return KdTerm(chain_logprobs.sum() * 0, 0, chunk_count_metrics(rows))
    dtype, device = chain_logprobs.dtype, chain_logprobs.device
    log_s = torch.zeros(count, dtype=dtype, device=device).index_add(0, rows.chain_chunk, chain_logprobs)
    log_t = rows.teacher_logp.to(dtype)
    log_s, log_t = torch.clamp_max(log_s, 0.0), torch.clamp_max(log_t, 0.0)
    if rows.debias:
        log_s = log_s + torch.clamp_max(student_space.to(dtype), 0.0)
        log_t = log_t + rows.teacher_space_logp.to(dtype)
    per_chunk = binary_cross_entropy(log_t, log_s, temperature)
    weighted = per_chunk if chunk_weight is None else per_chunk * chunk_weight.to(dtype)
    metrics = chunk_count_metrics(rows)
    metrics.update(events_per_chunk=1.0, teacher_event_mass=torch.exp(log_t).mean().detach(),
                   student_rest_mass=(1 - torch.exp(log_s)).mean().detach(),
                   divergence_per_chunk=per_chunk.detach().mean())
    return KdTerm(weighted.sum(), count, metrics)


def alm_loss(*, ce_positions, ce_tokens, teachers: Sequence = (), hidden=None, weight=None, logits=None,
             teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None,
             temperature: float = DEFAULT_ALM_TEMPERATURE, chunk_size=None, reuse_bytes: int = 0,
             reuse_dtype: str = "float32", kd_scale=None, chunk_weighting=None) -> LossOutput:
    """CE + ALM for one batch. teachers: one `AlmRows` per teacher (numpy or on the device). Give either
    `hidden` [P, H] and `weight` [V, H] (chunked path) or `logits` [P, V]. chunk_weighting: (scale, cap) of
    `--kd-chunk-weight advantage` (the chunks' own tokens on both sides, without the whitespace terms), None:
    every chunk weighs 1. Other arguments as `loss.csd.csd_loss`. Raises CsdError on a temperature that is not
    positive or bad inputs."""
    import math

    if not (temperature > 0 and math.isfinite(temperature)):
        raise CsdError(f"--alm-temperature must be a positive number, got {temperature}")
    _, ce_positions, ce_tokens, teachers = student_inputs(ce_positions, ce_tokens, teachers, hidden=hidden,
                                                          weight=weight, logits=logits, loss="the alm loss")
    pieces = gather_parts([ce_positions] + [r.chain_pos for r in teachers],
                          [ce_tokens] + [r.chain_tok for r in teachers], hidden=hidden, weight=weight, logits=logits,
                          chunk_size=chunk_size, reuse_bytes=reuse_bytes, reuse_dtype=reuse_dtype)
    terms = []
    for i, rows in enumerate(teachers):
        space = None
        if rows.debias and rows.num_chunks:
            space = student_space_logmass(rows.end_pos, rows.student_space, hidden=hidden, weight=weight,
                                          logits=logits, chunk_size=chunk_size)
        weight = None
        if chunk_weighting is not None and rows.num_chunks:
            from csd_pipeline.loss.chunk_weights import advantage_weights

            student = pieces[1 + i].new_zeros(rows.num_chunks).index_add(0, rows.chain_chunk, pieces[1 + i])
            weight = advantage_weights(rows.teacher_logp, student, scale=chunk_weighting[0], cap=chunk_weighting[1])
        terms.append(alm_divergence(pieces[1 + i], space, rows, temperature=temperature, chunk_weight=weight))
    if global_ce_tokens is None:
        global_ce_tokens = int(ce_positions.numel())
    return combine_losses(-pieces[0].sum(), global_ce_tokens, terms, teacher_weights=teacher_weights,
                          global_chunk_counts=global_chunk_counts, kd_scale=kd_scale)


class AlmLoss(TrainingLoss):
    """`--loss alm`: CE + Approximate Likelihood Matching of every accepted chunk (`alm_loss`)."""

    weighs_chunks = True

    def validate(self) -> None:
        options = self.options
        if options["teacher_temperature"] != 1:
            raise CsdError("--teacher-temperature applies to the csd losses only; with --loss alm set the binarisation "
                           "temperature with --alm-temperature and leave --teacher-temperature at 1")
        temperature = options.get("alm_temperature", DEFAULT_ALM_TEMPERATURE)
        if not (temperature > 0 and temperature != float("inf")):
            raise CsdError(f"--alm-temperature must be a positive number, got {temperature}")
        super().validate()

    @property
    def exact_teacher_values(self) -> bool:
        # the debiasing reads the stored entries as the teacher's most likely ids; without it only observed log-probs
        return bool(self.options.get("alm_debias", True))

    def check_teacher(self, aligned, output) -> None:
        if self.exact_teacher_values:
            output.require_exact("--loss alm (its whitespace debiasing)",
                                 f"pass --no-alm-debias (ALM then reads only the observed log-probs, which every store "
                                 f"keeps exactly), or re-run `{TEACHER_RERUN}` with only --top-k, --top-p and --min-p")

    def prepare_row(self, aligned_row, teacher_index, teacher_row, context, source=""):
        from csd_pipeline.events.alm_rows import build_alm_rows

        return build_alm_rows(aligned_row, teacher_index, teacher_row, context,
                              debias=self.exact_teacher_values, source=source)

    def collate(self, rows, row_offsets):
        from csd_pipeline.events.alm_rows import collate_alm_rows

        return collate_alm_rows(rows, row_offsets)

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        from csd_pipeline.loss.chunk_weights import chunk_weighting

        options = self.options
        return alm_loss(ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers, hidden=hidden,
                        weight=weight, logits=logits, teacher_weights=teacher_weights,
                        global_ce_tokens=global_ce_tokens, global_chunk_counts=global_chunk_counts,
                        temperature=options.get("alm_temperature", DEFAULT_ALM_TEMPERATURE),
                        chunk_size=self._chunk_size(), reuse_bytes=options["loss_reuse_mb"] << 20,
                        reuse_dtype=options["loss_reuse_dtype"], kd_scale=kd_scale,
                        chunk_weighting=chunk_weighting(options))
