"""`csd-train` configuration: component dataclasses, each validated, behind one flat set of options.

`TrainConfig` holds one small config per component (data, student, optimizer, loss, checkpoints,
evaluation) plus the run-wide seed, device and progress bar. Every option keeps one flat name,
unique across the components (`seq_len` in YAML, `--seq-len` as a flag; `trainer/options.py` reads
them from a YAML file and the command line), and the resolved `OUTPUT/config.yaml` is one flat
mapping of those names. An option's default, help text, choices and whether it changes the
trajectory of a run are written once, on its dataclass field, with the `option()` of every stage
config (`csd_pipeline/runtime/options.py`). Errors name the option to change.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from csd_pipeline.errors import CsdError
from csd_pipeline.events.baseline_rows import TEACHER_CONTROLS
from csd_pipeline.events.batch import DEFAULT_SPELLING, SPELLING_MODES
from csd_pipeline.loss.alm import DEFAULT_ALM_TEMPERATURE
from csd_pipeline.loss.chunk_weights import (
    DEFAULT_CHUNK_WEIGHT_MAX,
    DEFAULT_CHUNK_WEIGHT_SCALE,
    KD_CHUNK_WEIGHTS,
)
from csd_pipeline.loss.csd import DEFAULT_BETA, DEFAULT_DIVERGENCE, DIVERGENCES, KD_COMBINES
from csd_pipeline.loss.token_logprobs import DEFAULT_REUSE_DTYPE, REUSE_DTYPES
from csd_pipeline.loss.training import LOSSES
from csd_pipeline.runtime.model_loading import DEVICES, TRAINING_DTYPES
from csd_pipeline.runtime.options import check_choices, field_default, flag, option

KD_SCALES = ("dynamic", "fixed", "ratio")


def _at_least(component, minimum: int, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(component, name)
        if value < minimum:
            bound = "at least 1" if minimum == 1 else "0 or more"
            raise CsdError(f"--{flag(name)} must be {bound}, got {value}")


@dataclass
class DataConfig:
    """The cached inputs of a run and how their rows are shuffled and batched."""

    aligned: str | None = option(None, "aligned shards directory (output of `csd-pipeline align`)", trajectory=True)
    teacher_logits: list[str] = option([], "teacher top-k directory, one per teacher (repeat the flag)",
                                       trajectory=True)
    seq_len: int = option(2048, "tokens per packed row", trajectory=True)
    batch_size: int = option(8, "packed rows per rank per micro-step", trajectory=True)
    shuffle_block: int = option(4, "shards shuffled together (rows are permuted within a block)", trajectory=True)
    data_lanes: int = option(2, "lanes per rank: each reads its own span of the epoch's shards, and the rank takes "
                              "micro-batches from them in turn; data-loader workers split the lanes (use a --workers "
                              "that divides it)", trajectory=True)
    workers: int = option(2, "data-loader worker processes (0: in the training process)")
    teacher_cache_mb: int = option(1024, "decoded teacher top-k kept per data-loader worker, in MiB; rows are "
                                       "read in shuffled order, so a block that does not stay is decoded again")

    def validate(self) -> None:
        if not self.aligned:
            raise CsdError("--aligned is required: pass the directory written by `csd-pipeline align`")
        _at_least(self, 1, ("seq_len", "batch_size", "shuffle_block", "data_lanes"))
        _at_least(self, 0, ("workers", "teacher_cache_mb"))
        if self.seq_len < 2:
            raise CsdError(f"--seq-len must be at least 2, got {self.seq_len}")


@dataclass
class StudentConfig:
    """The model being trained: fine-tuned from `student` or started from `student_config`."""

    student: str | None = option(None, "student model: a local HF directory or a hub name", trajectory=True)
    student_config: str | None = option(None, "HF config JSON: start the student from scratch", trajectory=True)
    student_tokenizer: str | None = option(None, "student tokenizer (required with --student-config)", trajectory=True)
    trust_remote_code: bool = option(False, "allow model code from the model directory or hub")
    attn_implementation: str = option("sdpa", "attention kernel: sdpa, eager, flash_attention_2, ...")
    dtype: str = option("auto", "parameter dtype in forward/backward: auto (bf16 on GPU), float32, bfloat16",
                      trajectory=True, choices=TRAINING_DTYPES)

    def validate(self) -> None:
        if self.student and self.student_config:
            raise CsdError("--student and --student-config are exclusive: pass a model to fine-tune "
                           "or a config to start from scratch, not both")
        if not self.student and not self.student_config:
            raise CsdError("no student: pass --student (HF directory or hub name) or --student-config "
                           "FILE.json with --student-tokenizer")
        if self.student_config and not self.student_tokenizer:
            raise CsdError("--student-config needs --student-tokenizer: a model started from scratch "
                           "has no tokenizer of its own")
        check_choices(self)


@dataclass
class OptimizerConfig:
    """AdamW and its schedule: linear warm-up, then cosine decay over `steps` optimizer steps."""

    steps: int = option(1000, "optimizer steps")
    grad_accum: int = option(1, "micro-steps per optimizer step", trajectory=True)
    lr: float = option(3e-4, "peak learning rate", trajectory=True)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of --lr (cosine floor)", trajectory=True)
    warmup_steps: int = option(100, "linear warm-up steps", trajectory=True)
    weight_decay: float = option(0.1, "AdamW weight decay", trajectory=True)
    adam_beta1: float = option(0.9, "AdamW beta1", trajectory=True)
    adam_beta2: float = option(0.95, "AdamW beta2", trajectory=True)
    adam_eps: float = option(1e-8, "AdamW epsilon", trajectory=True)
    grad_clip: float = option(1.0, "gradient-norm clip (0: off)", trajectory=True)

    def validate(self) -> None:
        _at_least(self, 1, ("steps", "grad_accum"))
        _at_least(self, 0, ("warmup_steps",))
        if not self.lr > 0:
            raise CsdError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise CsdError(f"--min-lr-ratio must be within [0, 1], got {self.min_lr_ratio}")
        _at_least(self, 0, ("weight_decay", "grad_clip"))
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise CsdError(f"--{flag(name)} must be within [0, 1), got {getattr(self, name)}")


@dataclass
class LossConfig:
    """CE alone or CE + CSD: the divergence, the chunk weights, the KD scale and the teachers' weights."""

    loss: str = option("csd", "csd (default), ce (no KD), csd_1to1 (only 1:1 chunks), a baseline: uld, gold, strict, "
                            "alm (tokenkit's Approximate Likelihood Matching), csd_alm (CSD + --alm-weight x ALM), or kd "
                            "(same-tokenizer KD; docs/LOSSES.md)", trajectory=True, choices=tuple(LOSSES))
    divergence: str = option(DEFAULT_DIVERGENCE, "jsd, kl or reverse_kl", trajectory=True, choices=DIVERGENCES)
    beta: float = option(DEFAULT_BETA, "weight of the non-1:1 chunks in the KD term", trajectory=True)
    kd_scale: str = option("dynamic", "dynamic: L = CE + w*sg(CE/KD)*KD (the paper's); fixed: L = CE + w*KD; "
                                    "ratio: L = (1-w)*CE + w*KD", trajectory=True, choices=KD_SCALES)
    kd_weight: float = option(1.0, "w, the multiplier of the KD term (1 with dynamic is the paper's default)",
                            trajectory=True)
    kd_teachers: str | None = option(None, "teachers and weights, e.g. `0:1.0,1:0.5` (default: all, weight 1)",
                                   trajectory=True)
    kd_combine: str = option("sum", "several teachers: sum (KD = sum of weight x each teacher's mean over its chunks) "
                                  "or select (per group of chunks the teacher that covers it and gives its text the "
                                  "highest log-probability; one mean over the kept chunks; docs/LOSSES.md)",
                           trajectory=True, choices=KD_COMBINES)
    teacher_temperature: float = option(1.0, "T, softens each chunk's teacher distribution (events and REST) to "
                                           "P^(1/T), renormalised (1: the paper's)", trajectory=True)
    spelling: str = option(DEFAULT_SPELLING, "tokens with equal bytes: sum their probabilities or exclude them; prefix: sum, and in 1:1 "
                         "chunks count each token toward the longest common spelling that begins it",
                         trajectory=True, choices=SPELLING_MODES)
    teacher_top_k: int = option(0, "use only the N most likely of the stored teacher top-k entries per position "
                                 "(0: all); compares top-k sizes without re-running the teacher", trajectory=True)
    gold_matched_weight: float | None = option(None, "--loss gold: weight of the direct term on shared spellings "
                                                   "(the sorted term gets 1 - w); default: TRL's adaptive weight",
                                             trajectory=True)
    strict_top_k: int = option(0, "--loss strict: keep the student's N most likely shared spellings (0: all)",
                             trajectory=True)
    strict_divergence: str = option("reverse_kl", "--loss strict: jsd, kl or reverse_kl (CT-OPD's)", trajectory=True,
                                  choices=DIVERGENCES)
    alm_temperature: float = option(DEFAULT_ALM_TEMPERATURE, "--loss alm: the binarisation temperature tau, chunk "
                                    "probabilities compared as Bernoulli(p^(1/tau)) (tokenkit's default 100)",
                                    trajectory=True)
    alm_debias: bool = option(True, "--loss alm: add to each chunk's log-likelihood, on both sides, the log-probability "
                                    "that the next token starts with whitespace (tokenkit's append_space; needs a store "
                                    "of exact top-k entries); --no-alm-debias: the chunks' own tokens only",
                              trajectory=True)
    alm_weight: float = option(1.0, "--loss csd_alm: lambda, KD = KD_csd + lambda x KD_alm", trajectory=True)
    kd_chunk_weight: str = option("none", "weigh each chunk's KD term by the teacher's advantage on its text: advantage "
                                          "(w = clamp((log p_T - log p_S) / scale, 0, max), the student side detached; "
                                          "--loss csd, csd_1to1, alm) or none", trajectory=True,
                                  choices=KD_CHUNK_WEIGHTS)
    kd_chunk_weight_scale: float = option(DEFAULT_CHUNK_WEIGHT_SCALE, "--kd-chunk-weight advantage: the teacher "
                                          "advantage, in nats over the chunk, that weighs 1", trajectory=True)
    kd_chunk_weight_max: float = option(DEFAULT_CHUNK_WEIGHT_MAX, "--kd-chunk-weight advantage: the largest weight",
                                        trajectory=True)
    teacher_control: str = option("none", "shuffled: give each stored teacher row to another position of the batch "
                                        "(a control arm; any loss)", trajectory=True, choices=TEACHER_CONTROLS)
    loss_chunk_size: int = option(0, "positions per row chunk of the student log-softmax (0: auto, 2,048; the "
                                   "vocabulary goes in blocks of about 2^24 logits)")
    loss_reuse_mb: int = option(0, "MiB of student logits the loss holds from forward for the backward to reuse, instead of "
                                "recomputing them (0: none, the least memory; more is faster)")
    loss_reuse_dtype: str = option(DEFAULT_REUSE_DTYPE, "how the reused logits are held: float32 (exact), float16 "
                                                    "or bfloat16 (twice the rows per MiB, rounded: "
                                                    "docs/TRAINING.md)", choices=REUSE_DTYPES)

    def build(self):
        """The loss of this run (`csd_pipeline.loss.training.build_loss`), built from these options and validated."""
        from csd_pipeline.loss.training import build_loss

        return build_loss(self.loss, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def validate(self) -> None:
        check_choices(self)
        _at_least(self, 0, ("beta", "kd_weight", "teacher_top_k", "loss_chunk_size", "loss_reuse_mb", "strict_top_k"))
        if self.kd_scale == "ratio" and self.kd_weight > 1:
            raise CsdError(f"--kd-scale ratio needs a KD loss and --kd-weight within [0, 1], got --loss {self.loss} "
                           f"and --kd-weight {self.kd_weight}")
        if self.gold_matched_weight is not None and not 0 <= self.gold_matched_weight <= 1:
            raise CsdError(f"--gold-matched-weight must be within [0, 1], got {self.gold_matched_weight}")
        if not (self.teacher_temperature > 0 and math.isfinite(self.teacher_temperature)):
            raise CsdError(f"--teacher-temperature must be a positive number, got {self.teacher_temperature}")
        self.build()  # what the loss itself refuses (`TrainingLoss.validate`)
        if self.kd_combine == "select":
            weights = set(self.teacher_weights(0).values())
            if not weights <= {0.0, 1.0}:
                raise CsdError(f"--kd-combine select chooses one teacher per group of chunks and weighs none, but "
                               f"--kd-teachers gives weights {sorted(weights)}; give each teacher weight 1 (0 leaves "
                               "it out), or use --kd-combine sum")

    def teacher_weights(self, num_teachers: int) -> dict[int, float]:
        """Teacher index -> KD weight, from `--kd-teachers` (default: each of `num_teachers`, weight 1)."""
        if self.kd_teachers in (None, ""):
            return {i: 1.0 for i in range(num_teachers)}
        weights: dict[int, float] = {}
        for item in str(self.kd_teachers).split(","):
            index, sep, weight = item.strip().partition(":")
            try:
                key, value = int(index), float(weight) if sep else 1.0
            except ValueError:
                raise CsdError(f"--kd-teachers entry {item.strip()!r} is not INDEX:WEIGHT; "
                               "write e.g. 0:1.0,1:0.5") from None
            if key in weights or key < 0 or value < 0:
                raise CsdError(f"--kd-teachers entry {item.strip()!r} repeats a teacher or is negative; "
                               "give each teacher index once with a weight >= 0")
            weights[key] = value
        return weights


@dataclass
class CheckpointConfig:
    """The output directory, its checkpoints and HF exports, and where a run stops or resumes."""

    output: str | None = option(None, "output directory (checkpoints, metrics, export)")
    save_every: int = option(500, "checkpoint every N steps (0: only at the end)")
    save_total_limit: int = option(2, "how many checkpoints to leave on disk: the latest N")
    save_final: bool = option(True, "checkpoint after the last step (--no-save-final: the export only, a run that "
                                    "cannot be resumed or extended; a --stop-at-step stop still checkpoints)")
    resume: bool = option(False, "continue from the latest complete checkpoint in --output")
    export_every: int = option(0, "also write the HF export every N steps (0: only at the end)")
    stop_at_step: int = option(0, "stop cleanly after this step, as if interrupted (0: run --steps)")

    def validate(self) -> None:
        if not self.output:
            raise CsdError("--output is required: pass the directory for checkpoints, metrics and the export")
        _at_least(self, 1, ("save_total_limit",))
        _at_least(self, 0, ("save_every", "export_every", "stop_at_step"))


@dataclass
class EvaluationConfig:
    """Held-out bits per byte, and lm-evaluation-harness tasks on the export, during and at the end of the run."""

    eval_aligned: str | None = option(None, "held-out aligned directory: report bits per byte")
    eval_every: int = option(0, "evaluate every N steps (0: only at the end)")
    eval_max_rows: int = option(0, "evaluate on at most N held-out rows (0: all)")
    eval_teacher_bits_per_byte: float | None = option(
        None, "the teacher's bits per byte on --eval-aligned (`csd-pipeline bits-per-byte --side teacher0`): each "
              "evaluation records it and warns once the student scores below it (KD then pulls the student back)")
    eval_tasks: list[str] = option([], "lm-evaluation-harness tasks run on the export every --eval-tasks-every steps "
                                       "and at the end (`csd-pipeline evaluate --list-tasks`; e.g. csd_next_sentence; "
                                       "needs the [eval] extra)")
    eval_tasks_every: int = option(0, "run --eval-tasks every N steps (0: only at the end)")
    eval_tasks_limit: int = option(0, "score at most N documents per task (0: all)")
    eval_tasks_include_path: list[str] = option([], "folders of your own task YAML files for --eval-tasks")

    def validate(self) -> None:
        _at_least(self, 0, ("eval_every", "eval_max_rows", "eval_tasks_every", "eval_tasks_limit"))
        if not self.eval_tasks and (self.eval_tasks_every or self.eval_tasks_limit or self.eval_tasks_include_path):
            raise CsdError("--eval-tasks-every, --eval-tasks-limit and --eval-tasks-include-path need --eval-tasks: pass "
                           "task names separated by commas (e.g. --eval-tasks csd_next_sentence)")
        if self.eval_tasks:
            from trainer.task_eval import check_options

            check_options(self)
        teacher = self.eval_teacher_bits_per_byte
        if teacher is not None and not teacher > 0:
            raise CsdError(f"--eval-teacher-bits-per-byte must be positive, got {teacher}; pass the teacher's held-out "
                           "bits per byte from `csd-pipeline bits-per-byte`")
        if teacher is not None and not self.eval_aligned:
            raise CsdError("--eval-teacher-bits-per-byte needs --eval-aligned (the held-out directory it was measured "
                           "on)")


@dataclass
class TrainConfig:
    """The resolved options of one training run (see `docs/TRAINING.md`), one component per part."""

    data: DataConfig = field(default_factory=DataConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    seed: int = option(0, "seed of the initialisation and the data order", trajectory=True)
    device: str = option("auto", "auto, cpu or cuda", choices=DEVICES)
    progress: bool = option(True, "progress bar on stderr (rank 0)")
    report_to: list[str] = option(["jsonl"], "where metrics go, comma-separated: jsonl (metrics.jsonl, always "
                                              "written), tensorboard (OUTPUT/tensorboard/), wandb (W&B; "
                                              "WANDB_MODE=offline for a local run); the trackers are extras: pip "
                                              "install 'csd-pipeline[tensorboard]' / '[wandb]'")

    @classmethod
    def from_options(cls, values: dict) -> TrainConfig:
        """A config from flat option values (`{"seq_len": 512, ...}`; missing ones keep their default)."""
        parts: dict[str | None, dict] = {}
        for name, value in values.items():
            parts.setdefault(OPTIONS[name].component, {})[name] = value
        components = {name: kind(**parts.get(name, {})) for name, kind in COMPONENTS.items()}
        return cls(**components, **parts.get(None, {}))

    def validate(self) -> TrainConfig:
        """Check every option; raise `CsdError` naming the first one to change. Returns self."""
        for name in COMPONENTS:
            getattr(self, name).validate()
        check_choices(self)
        from trainer.trackers import check_installed

        check_installed(self.report_to)
        if self.loss.build().uses_teachers and not self.data.teacher_logits:
            raise CsdError(f"--loss {self.loss.loss} needs teacher top-k: pass --teacher-logits DIR "
                           "(from `csd-pipeline teacher-logits`) or use --loss ce")
        self.teacher_weights()  # parses --kd-teachers
        from csd_pipeline.runtime import storage

        if self.evaluation.eval_tasks and storage.is_url(self.checkpoints.output):
            raise CsdError(f"--eval-tasks runs the harness on a local export, but --output {self.checkpoints.output} "
                           "is an object store: train to a local --output, or run `csd-pipeline evaluate` on a local "
                           "copy of the export")
        return self

    def teacher_weights(self) -> dict[int, float]:
        """Teacher index -> KD weight, from `--kd-teachers` (default: every given teacher, weight 1)."""
        return self.loss.teacher_weights(len(self.data.teacher_logits))

    def to_dict(self) -> dict:
        """The options as one flat mapping of plain YAML/JSON-safe values (the keys of `OPTIONS`)."""
        out = {}
        for name, each in OPTIONS.items():
            owner = self if each.component is None else getattr(self, each.component)
            value = getattr(owner, name)
            out[name] = list(value) if isinstance(value, list) else value
        return out


@dataclass(frozen=True)
class Option:
    """One flat option: its name, the component that owns it (None: `TrainConfig` itself), its field and type."""

    name: str
    component: str | None
    field: dataclasses.Field
    hint: object

    @property
    def default(self):
        return field_default(self.field)


def _options() -> tuple[dict[str, type], dict[str, Option]]:
    hints = typing.get_type_hints(TrainConfig)
    components: dict[str, type] = {}
    options: dict[str, Option] = {}
    owned = []
    for f in dataclasses.fields(TrainConfig):
        if "help" in f.metadata:
            owned.append((None, f, hints[f.name]))
        else:
            components[f.name] = hints[f.name]
            kind_hints = typing.get_type_hints(hints[f.name])
            owned += [(f.name, g, kind_hints[g.name]) for g in dataclasses.fields(hints[f.name])]
    for component, f, hint in owned:
        if f.name in options:
            raise RuntimeError(f"option {f.name} is declared twice (trainer/config.py)")
        options[f.name] = Option(f.name, component, f, hint)
    return components, options


COMPONENTS, OPTIONS = _options()
# Options that change the trajectory of a run: a resumed run must use the values it was started with.
TRAJECTORY_KEYS = tuple(name for name, each in OPTIONS.items() if each.field.metadata.get("trajectory"))


def write_resolved(config: TrainConfig, path: str) -> None:
    """Write the resolved options as flat YAML (atomically)."""
    import yaml

    from csd_pipeline.runtime.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


def check_resume_compatible(config: TrainConfig, saved: dict, where: str) -> None:
    """Refuse a resume whose trajectory options differ from the run that wrote the checkpoint.

    `saved`: the flat options of `OUTPUT/config.yaml` (any version: keys it lacks are not compared).
    """
    current = config.to_dict()
    changed = [k for k in TRAJECTORY_KEYS if k in saved and saved[k] != current[k]]
    if changed:
        first = changed[0]
        raise CsdError(
            f"--resume with changed option(s) {', '.join(changed)} (checkpointed run at {where} used "
            f"{first}={saved[first]!r}, now {current[first]!r}); use the original values or a new --output"
        )
