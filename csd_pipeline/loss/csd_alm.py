"""`csd-train --loss csd_alm`: CSD's distribution events plus ALM's observed-chunk term, from the same shards.

CSD compares, per aligned chunk, the two models' distributions over the events both can express; most of its
gradient goes to the alternatives and to REST (docs/LOSSES.md). ALM (`loss/alm.py`) compares only how likely each
model finds the chunk's observed text, which is where a pretrained student gains within an epoch. This loss adds
the two per teacher:

    KD = KD_csd + lambda * KD_alm        (lambda: `--alm-weight`)

each term as its own loss computes it (the same options: `--divergence`, `--beta`, `--teacher-temperature`,
`--spelling` for CSD; `--alm-temperature`, `--alm-debias` for ALM; `--kd-chunk-weight` for both), both means over
the same accepted chunks (the trainer's global chunk count: the two row builders accept the same chunks, which
`collate` checks). `--kd-scale` / `--kd-weight` then combine KD with CE as for every loss. The two terms read the
student's log-probabilities at the same positions; each gathers its own (the ALM gather repeats the CE rows, so
the loss costs about twice CSD's on the LM head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from csd_pipeline.errors import CsdError
from csd_pipeline.loss.alm import AlmLoss
from csd_pipeline.loss.training import CsdLoss, TrainingLoss

DEFAULT_ALM_WEIGHT = 1.0


@dataclass
class CsdAlmRows:
    """One teacher's CSD events and ALM rows of the same row or batch, with the CSD events' chunk counts."""

    csd: Any
    alm: Any

    @property
    def num_chunks(self) -> int:
        return self.csd.num_chunks

    def shape_counts(self) -> list[int]:
        return self.csd.shape_counts()

    @property
    def stats(self) -> dict:
        return self.csd.stats

    def to(self, device) -> CsdAlmRows:
        return CsdAlmRows(self.csd.to(device), self.alm.to(device))


class CsdAlmLoss(TrainingLoss):
    """`--loss csd_alm`: CE + CSD's KD + `--alm-weight` x ALM's KD (module docstring)."""

    weighs_chunks = True

    @property
    def _csd(self) -> CsdLoss:
        return CsdLoss("csd", self.options)

    @property
    def _alm(self) -> AlmLoss:
        return AlmLoss("alm", {**self.options, "teacher_temperature": 1.0})

    @property
    def exact_teacher_values(self) -> bool:
        return self._alm.exact_teacher_values

    def validate(self) -> None:
        weight = self.options.get("alm_weight", DEFAULT_ALM_WEIGHT)
        if not (weight >= 0 and weight != float("inf")):
            raise CsdError(f"--alm-weight must be a number >= 0, got {weight}")
        if self.options["kd_combine"] == "select":
            raise CsdError("--kd-combine select works with --loss csd and csd_1to1, not with --loss csd_alm; use "
                           "--kd-combine sum")
        self._csd.validate()
        self._alm.validate()

    def check_teacher(self, aligned, output) -> None:
        self._csd.check_teacher(aligned, output)
        self._alm.check_teacher(aligned, output)

    def prepare_row(self, aligned_row, teacher_index, teacher_row, context, source=""):
        return CsdAlmRows(self._csd.prepare_row(aligned_row, teacher_index, teacher_row, context, source=source),
                          self._alm.prepare_row(aligned_row, teacher_index, teacher_row, context, source=source))

    def collate(self, rows, row_offsets):
        batch = CsdAlmRows(self._csd.collate([r.csd for r in rows], row_offsets),
                           self._alm.collate([r.alm for r in rows], row_offsets))
        if batch.csd.num_chunks != batch.alm.num_chunks:
            raise CsdError(f"--loss csd_alm: the CSD events hold {batch.csd.num_chunks} chunks and the ALM rows "
                           f"{batch.alm.num_chunks} of the same rows; the two terms must share one chunk count "
                           "(a bug: report it with the aligned shard)")
        return batch

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        shared = dict(ce_positions=ce_positions, ce_tokens=ce_tokens, hidden=hidden, weight=weight, logits=logits,
                      teacher_weights=teacher_weights, global_ce_tokens=global_ce_tokens,
                      global_chunk_counts=global_chunk_counts, kd_scale=1.0)
        csd = self._csd(teachers=[t.csd for t in teachers], **shared)
        alm = self._alm(teachers=[t.alm for t in teachers], **shared)
        lam = float(self.options.get("alm_weight", DEFAULT_ALM_WEIGHT))
        return combined_output(csd, alm, lam, kd_scale)


def combined_output(csd, alm, lam: float, kd_scale=None):
    """The `LossOutput` of CE + scale x (KD_csd + lam x KD_alm) from the two losses' outputs on the same batch
    (their CE is the same; CSD's is kept). kd_scale None: the dynamic sg(CE/KD)."""

    from csd_pipeline.loss.csd import LossOutput, kd_multiplier

    kd = csd.kd + lam * alm.kd
    scale = kd_multiplier(csd.ce, kd, kd_scale)
    metrics = dict(csd.metrics)
    metrics.update({"kd_csd": csd.kd.detach(), "kd_alm": alm.kd.detach(), "kd_scale": scale})
    return LossOutput(loss=csd.ce + scale * kd, ce=csd.ce, kd=kd, kd_terms=csd.kd_terms + alm.kd_terms,
                      metrics=metrics)

