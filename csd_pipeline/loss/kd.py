"""`csd-train --loss kd`: same-tokenizer KD, as same-vocabulary distillation toolkits do it.

For each student position that predicts a token (every accepted 1:1 chunk of a row whose teacher has the
student's tokenizer), the forward KL between the teacher's stored entries plus one REST entry (1 - their
mass) and the student's probabilities of the same ids plus the student's REST:

    KD_j = sum_i q_i (log q_i - log p_i) + q_R (log q_R - log p_R),   q_R = 1 - sum_i q_i, p_R = 1 - sum_i p_i

with 0 log 0 = 0. The KD term is the mean over those positions (global count), combined with the CE like the
other losses (`--kd-scale`, `--kd-weight`). `KdRows` are prepared on the CPU in the loader workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.training import TrainingLoss


@dataclass
class KdRows:
    """The teacher entries at the student positions of one row or one batch (numpy, or torch after `.to`).

    position: int64 [G] the student position that predicts (row-local, or in the packed batch after
    `collate`); ids: int64 [G, k] the teacher's stored ids there; logq: float64 [G, k] their log-probs
    (-inf: no entry, id 0). stats: counters for logging."""

    position: Any
    ids: Any
    logq: Any
    stats: dict = field(default_factory=dict)

    @property
    def num_chunks(self) -> int:
        return int(self.position.shape[0])

    def shape_counts(self) -> list[int]:
        """Positions count as 1:1 chunks: [G, 0, 0, 0]."""
        return [self.num_chunks, 0, 0, 0]

    def to(self, device) -> KdRows:
        import torch

        return KdRows(*(torch.as_tensor(v).to(device) for v in (self.position, self.ids, self.logq)), dict(self.stats))


def _empty_rows(stats: dict | None = None, k: int = 0) -> KdRows:
    return KdRows(np.zeros(0, np.int64), np.zeros((0, k), np.int64), np.zeros((0, k)), dict(stats or {}))


def kd_rows(aligned_row, teacher_index: int, teacher_row, context, source: str = "") -> KdRows:
    """The KD rows of one aligned row for teacher `teacher_index` (row-local positions).

    Every accepted chunk of one student and one teacher token that has a predictor (a token before it on
    both sides) gives the student position before it and the teacher's entries at the teacher position
    before it. A teacher row with a non-zero status gives none. Raises `CsdError` like `build_row_events`."""
    from csd_pipeline.events.row_events import ACCEPTED, read_aligned_chunks, teacher_positions

    row = read_aligned_chunks(aligned_row, teacher_index, context, source)
    status = teacher_row.get("status", 0) if isinstance(teacher_row, dict) else getattr(teacher_row, "status", 0)
    if status:
        return _empty_rows({"rows_teacher_rejected": 1})
    teacher = teacher_positions(teacher_row, row)
    if teacher.dense:
        raise CsdError("--loss kd reads a teacher top-k, not dense log-probs")
    keep = ((row.status == ACCEPTED) & (row.student_len == 1) & (row.teacher_len == 1)
            & (row.student_start > 0) & (row.teacher_start > 0))
    at = row.teacher_start[keep] - 1
    logq = teacher.logprobs[at]
    ids = np.where(np.isfinite(logq), teacher.ids[at], 0)
    return KdRows(row.student_start[keep] - 1, ids.astype(np.int64), logq, {})


def collate_kd_rows(rows: list[KdRows], row_offsets) -> KdRows:
    """One batch of the rows of several windows: row i's positions + row_offsets[i], entries padded to the
    largest k (id 0, log-prob -inf)."""
    k = max((r.ids.shape[1] for r in rows), default=0)
    stats: dict = {}
    for r in rows:
        for key, value in r.stats.items():
            stats[key] = stats.get(key, 0) + value
    if not rows:
        return _empty_rows(stats, k)

    def pad(values, fill):
        return np.pad(values, ((0, 0), (0, k - values.shape[1])), constant_values=fill)

    return KdRows(np.concatenate([r.position + int(o) for r, o in zip(rows, row_offsets, strict=True)]),
                  np.concatenate([pad(r.ids, 0) for r in rows]), np.concatenate([pad(r.logq, -np.inf) for r in rows]),
                  stats)


def kd_divergence(entry_logprobs, rows: KdRows):
    """KdTerm of one teacher: the sum over positions of KL(teacher entries + REST || student same ids + REST).

    entry_logprobs: the student's log-probs at (rows.position, rows.ids) of the valid entries (logq finite), in
    row-major order; `rows` on the same device."""
    import torch

    from csd_pipeline.loss.csd import KdTerm, chunk_count_metrics, divergence_terms, log1mexp

    count = rows.num_chunks
    if count == 0:
        return KdTerm(entry_logprobs.sum() * 0, 0, chunk_count_metrics(rows))
    dtype = entry_logprobs.dtype
    valid = torch.isfinite(rows.logq)
    log_ps = torch.full(rows.logq.shape, -torch.inf, dtype=dtype, device=entry_logprobs.device)
    log_ps = log_ps.masked_scatter(valid, entry_logprobs)
    log_qt = rows.logq.to(dtype)
    rest_t = log1mexp(torch.logsumexp(log_qt, dim=1))
    rest_s = log1mexp(torch.logsumexp(log_ps, dim=1))
    terms = divergence_terms(torch.cat([log_qt, rest_t[:, None]], 1), torch.cat([log_ps, rest_s[:, None]], 1), "kl")
    per_position = terms.sum(1)
    metrics = chunk_count_metrics(rows)
    metrics.update(events_per_chunk=float(valid.sum()) / count,
                   teacher_event_mass=(1 - torch.exp(rest_t)).mean().detach(),
                   student_rest_mass=torch.exp(rest_s).mean().detach(),
                   divergence_per_chunk=per_position.detach().mean())
    return KdTerm(per_position.sum(), count, metrics)


class KdLoss(TrainingLoss):
    """`--loss kd`: CE + the forward KL above, for a teacher with the student's tokenizer."""

    exact_teacher_values = True

    def validate(self) -> None:
        if self.options["teacher_temperature"] != 1:
            raise CsdError("--teacher-temperature applies to the csd losses only; leave it at 1 with --loss kd")
        super().validate()

    def check_teacher(self, aligned, output) -> None:
        super().check_teacher(aligned, output)
        teacher = aligned.teacher_tokenizer(output.teacher_index)
        try:
            aligned.require_tokenizer("student", teacher.fingerprint)
        except CsdError:
            raise CsdError(f"--loss kd compares the teacher's and the student's probabilities of the same ids, but "
                           f"teacher {output.teacher_index} ({teacher.name}) of {aligned.directory} does not have the "
                           f"student's tokenizer; use --loss csd for a teacher with another tokenizer") from None

    def prepare_row(self, aligned_row, teacher_index, teacher_row, context, source=""):
        return kd_rows(aligned_row, teacher_index, teacher_row, context, source)

    def collate(self, rows, row_offsets):
        return collate_kd_rows(rows, row_offsets)

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        import torch

        from csd_pipeline.loss.csd import combine_losses
        from csd_pipeline.loss.token_logprobs import gather_parts, student_inputs

        _, ce_positions, ce_tokens, teachers = student_inputs(ce_positions, ce_tokens, teachers, hidden=hidden,
                                                              weight=weight, logits=logits, loss="the kd loss")
        pos_parts, tok_parts = [ce_positions], [ce_tokens]
        for rows in teachers:
            valid = torch.isfinite(rows.logq)
            pos_parts.append(rows.position[:, None].expand_as(rows.ids)[valid])
            tok_parts.append(rows.ids[valid])
        pieces = gather_parts(pos_parts, tok_parts, hidden=hidden, weight=weight, logits=logits,
                              chunk_size=self._chunk_size(), reuse_bytes=self.options["loss_reuse_mb"] << 20,
                              reuse_dtype=self.options["loss_reuse_dtype"])
        terms = [kd_divergence(pieces[1 + i], rows) for i, rows in enumerate(teachers)]
        if global_ce_tokens is None:
            global_ce_tokens = int(ce_positions.numel())
        return combine_losses(-pieces[0].sum(), global_ce_tokens, terms, teacher_weights=teacher_weights,
                              global_chunk_counts=global_chunk_counts, kd_scale=kd_scale)
