"""The loss of a training run, built once from its options (`build_loss`), as torchtitan's `TrainSpec` builds it.

A `TrainingLoss` says what the loader must provide (`uses_teachers`: teacher top-k, checked by `check_teacher`),
prepares each window's teacher data on the CPU in the loader workers (`prepare_row`, then `select` and
`collate` per micro-batch) and computes CE + KD on the device (`__call__`). The trainer calls these and never
asks which loss it is. A new loss is one module with a `TrainingLoss` subclass and one line in `LOSSES`
(docs/ARCHITECTURE.md, "Adding a loss"). The objects hold plain option values: they cross process boundaries.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from csd_pipeline.errors import CsdError

TEACHER_RERUN = "csd-pipeline teacher-logits"  # as `csd_pipeline.teacher.store.reader.TEACHER_RERUN` words it

# name -> "module:class" of each `csd-train --loss`, imported when built
LOSSES = {
    "csd": "csd_pipeline.loss.training:CsdLoss",
    "ce": "csd_pipeline.loss.training:CeLoss",
    "csd_1to1": "csd_pipeline.loss.training:CsdLoss",
    "uld": "csd_pipeline.loss.training:BaselineLoss",
    "gold": "csd_pipeline.loss.training:BaselineLoss",
    "strict": "csd_pipeline.loss.training:BaselineLoss",
    "kd": "csd_pipeline.loss.kd:KdLoss",
    "alm": "csd_pipeline.loss.alm:AlmLoss",
    "csd_alm": "csd_pipeline.loss.csd_alm:CsdAlmLoss",
}


@dataclass(frozen=True)
class TrainingLoss:
    """What every loss shares: its name and the options of `csd-train`'s loss component (`LossConfig` values).

    Subclasses set `uses_teachers` and `exact_teacher_values` and implement `prepare_row`, `collate` and
    `__call__`. `options` is a dict of the `LossConfig` fields (plain values)."""

    name: str
    options: dict

    uses_teachers = True         # False: CE alone, no --teacher-logits is opened
    exact_teacher_values = False  # True: reads stored values as log-probabilities of a whole top-k
    weighs_chunks = False        # True: implements --kd-chunk-weight (`loss.chunk_weights`)

    def validate(self) -> None:
        """Raise `CsdError` (naming the option) for options this loss cannot run with."""
        from csd_pipeline.loss.chunk_weights import check_chunk_weighting

        options = self.options
        if "kd_chunk_weight" in options:
            check_chunk_weighting(options["kd_chunk_weight"], options["kd_chunk_weight_scale"],
                                  options["kd_chunk_weight_max"])
            if options["kd_chunk_weight"] != "none" and not self.weighs_chunks:
                raise CsdError(f"--kd-chunk-weight works with --loss csd, csd_1to1 and alm, not with --loss "
                               f"{self.name}; leave it at none")
        if options["kd_combine"] == "select":
            raise CsdError(f"--kd-combine select works with the csd losses and real teacher rows, not with "
                           f"--loss {self.name}; use --kd-combine sum")

    def check_teacher(self, aligned, output) -> None:
        """Raise `CsdError` when the teacher top-k `output` (a `TeacherTopkOutput`) cannot feed this loss."""
        if not self.exact_teacher_values:
            return
        output.require_exact(f"--loss {self.name}", f"use a --loss csd* arm, or re-run `{TEACHER_RERUN}` with only "
                                                    "--top-k, --top-p and --min-p for this loss")

    def prepare_row(self, aligned_row, teacher_index: int, teacher_row, context, source: str = ""):
        """One window's teacher data for this loss (CPU, numpy; row-local positions)."""
        raise NotImplementedError

    def select(self, rows_by_teacher: list[list], aligned_rows: list, teacher_indices: list[int]) -> list[list]:
        """The prepared rows after combining the teachers (default: unchanged)."""
        return rows_by_teacher

    def collate(self, rows: list, row_offsets):
        """One teacher's prepared rows of a micro-batch as one batch (with `num_chunks`, `shape_counts()`, `to`)."""
        raise NotImplementedError

    def kd_denominators(self, chunks: list[float]) -> list[float]:
        """What each teacher's divergence sum is divided by, from the global chunk counts of each teacher."""
        return list(chunks)

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        """CE + KD of one micro-batch (`csd_pipeline.loss.csd.LossOutput`), from hidden states and the LM head
        (`hidden`, `weight`) or from `logits` (tests)."""
        raise NotImplementedError

    def _chunk_size(self):
        return self.options["loss_chunk_size"] or None


class CsdLoss(TrainingLoss):
    """`--loss csd` and `csd_1to1` (only the 1:1 chunks): CSD events (SPEC §5) and `csd_loss`."""

    weighs_chunks = True

    def validate(self) -> None:
        from csd_pipeline.loss.chunk_weights import check_chunk_weighting

        options = self.options
        if "kd_chunk_weight" in options:
            check_chunk_weighting(options["kd_chunk_weight"], options["kd_chunk_weight_scale"],
                                  options["kd_chunk_weight_max"])
        if options["kd_combine"] == "select" and options["teacher_control"] != "none":
            raise CsdError(f"--kd-combine select works with the csd losses and real teacher rows, not with "
                           f"--teacher-control {options['teacher_control']}; use --kd-combine sum")

    def check_teacher(self, aligned, output) -> None:
        if self.options["spelling"] == "prefix" and output.keep == "csd-events":
            raise CsdError(f"--spelling prefix also reads teacher entries that extend a common spelling, but "
                           f"{output.directory} keeps only the entries of the sum rule (teacher-logits --keep "
                           f"csd-events); use --spelling sum, or re-run `{TEACHER_RERUN}` with --keep top-k")

    def prepare_row(self, aligned_row, teacher_index, teacher_row, context, source=""):
        from csd_pipeline.events.row_events import build_row_events

        return build_row_events(aligned_row, teacher_index, teacher_row, context, spelling=self.options["spelling"],
                                only_1to1=self.name == "csd_1to1", source=source)

    def select(self, rows_by_teacher, aligned_rows, teacher_indices):
        if self.options["kd_combine"] != "select":
            return rows_by_teacher
        from csd_pipeline.events.teacher_select import chunk_boundaries, select_windows

        boundaries = [[chunk_boundaries(row, index) for row in aligned_rows] for index in teacher_indices]
        return select_windows(rows_by_teacher, boundaries)

    def collate(self, rows, row_offsets):
        from csd_pipeline.events.batch import collate_events

        return collate_events(rows, row_offsets)

    def kd_denominators(self, chunks):
        # select: KD is one mean over the chunks kept of all teachers
        return [sum(chunks)] * len(chunks) if self.options["kd_combine"] == "select" else list(chunks)

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        from csd_pipeline.loss.chunk_weights import chunk_weighting
        from csd_pipeline.loss.csd import csd_loss

        options = self.options
        return csd_loss(ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers, hidden=hidden,
                        weight=weight, logits=logits, teacher_weights=teacher_weights,
                        global_ce_tokens=global_ce_tokens, global_chunk_counts=global_chunk_counts,
                        divergence=options["divergence"], beta=options["beta"],
                        teacher_temperature=options["teacher_temperature"], chunk_size=self._chunk_size(),
                        reuse_bytes=options["loss_reuse_mb"] << 20, reuse_dtype=options["loss_reuse_dtype"],
                        kd_scale=kd_scale, chunk_weighting=chunk_weighting(options))


class CeLoss(CsdLoss):
    """`--loss ce`: the cross-entropy alone (CSD's loss with no teacher)."""

    uses_teachers = False

    def validate(self) -> None:
        if self.options.get("kd_chunk_weight", "none") != "none":
            raise CsdError(f"--kd-chunk-weight weighs KD chunks; --loss {self.name} has none, leave it at none")
        if self.options["kd_scale"] == "ratio":
            raise CsdError(f"--kd-scale ratio needs a KD loss and --kd-weight within [0, 1], got --loss {self.name} "
                           f"and --kd-weight {self.options['kd_weight']}")
        super().validate()


class BaselineLoss(TrainingLoss):
    """`--loss uld|gold|strict`: the other cross-tokenizer methods (`baselines.baseline_loss`) on per-chunk rows."""

    exact_teacher_values = True

    def validate(self) -> None:
        if self.options["teacher_temperature"] != 1:
            raise CsdError(f"--teacher-temperature applies to the csd losses only; leave it at 1 with --loss {self.name}")
        super().validate()

    def prepare_row(self, aligned_row, teacher_index, teacher_row, context, source=""):
        from csd_pipeline.events.baseline_rows import build_baseline_rows

        return build_baseline_rows(aligned_row, teacher_index, teacher_row, context, only_1to1=self.name == "strict",
                                source=source)

    def collate(self, rows, row_offsets):
        from csd_pipeline.events.baseline_rows import collate_baseline_rows

        return collate_baseline_rows(rows, row_offsets)

    def __call__(self, *, ce_positions, ce_tokens, teachers, hidden=None, weight=None, logits=None,
                 teacher_weights=None, global_ce_tokens=None, global_chunk_counts=None, kd_scale=None):
        from csd_pipeline.loss.baselines import baseline_loss

        options = self.options
        return baseline_loss(self.name, ce_positions=ce_positions, ce_tokens=ce_tokens, teachers=teachers,
                             hidden=hidden, weight=weight, logits=logits, teacher_weights=teacher_weights,
                             global_ce_tokens=global_ce_tokens, global_chunk_counts=global_chunk_counts,
                             divergence=options["divergence"], gold_matched_weight=options["gold_matched_weight"],
                             strict_top_k=options["strict_top_k"], strict_divergence=options["strict_divergence"],
                             chunk_size=self._chunk_size(), kd_scale=kd_scale)


def cross_entropy_only(chunk_size: int | None = None) -> TrainingLoss:
    """The CE alone with the default loss options and `chunk_size` positions per row chunk (held-out scoring)."""
    from csd_pipeline.loss.csd import DEFAULT_BETA, DEFAULT_DIVERGENCE
    from csd_pipeline.loss.token_logprobs import DEFAULT_REUSE_DTYPE

    return CeLoss("ce", {"divergence": DEFAULT_DIVERGENCE, "beta": DEFAULT_BETA, "teacher_temperature": 1.0,
                         "loss_chunk_size": chunk_size or 0, "loss_reuse_mb": 0, "loss_reuse_dtype": DEFAULT_REUSE_DTYPE})


def build_loss(name: str, options: dict) -> TrainingLoss:
    """The `TrainingLoss` of `--loss name` with the loss options `options` (a dict of `LossConfig` fields),
    validated. Raises `CsdError` for an unknown name or options that loss cannot run with."""
    if name not in LOSSES:
        raise CsdError(f"--loss {name!r} is not a loss; choose one of {', '.join(LOSSES)}")
    module, _, cls = LOSSES[name].partition(":")
    loss = getattr(importlib.import_module(module), cls)(name, dict(options))
    loss.validate()
    return loss
