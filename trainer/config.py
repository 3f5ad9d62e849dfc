"""`csd-train` configuration: one validated dataclass, from YAML + `key=value` + flags.

Every option has one name. In YAML and `key=value` it is written with underscores
(`seq_len=512`), as a flag with dashes (`--seq-len 512`); both spellings are accepted in
`key=value`. Sources apply in order: defaults, the `--config` YAML file, then the command line
from left to right (a later value wins; a repeated list flag such as `--teacher-logits`
appends). Errors name the option to change.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field

from csd_pipeline.errors import CsdError

LOSSES = ("csd", "ce", "csd_1to1", "uld", "gold", "strict")
DIVERGENCES = ("jsd", "kl", "reverse_kl")
SPELLINGS = ("sum", "exclude")
KD_SCALES = ("dynamic", "fixed", "ratio")
TEACHER_CONTROLS = ("none", "shuffled")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")

# Options that change the trajectory of a run: a resumed run must use the values it was started with.
TRAJECTORY_KEYS = (
    "aligned", "teacher_logits", "student", "student_config", "student_tokenizer", "seq_len",
    "batch_size", "grad_accum", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "adam_beta1",
    "adam_beta2", "adam_eps", "grad_clip", "seed", "loss", "divergence", "beta", "kd_scale", "kd_weight", "kd_teachers",
    "teacher_temperature", "spelling", "teacher_top_k", "shuffle_block", "dtype",
    "gold_matched_weight", "strict_top_k", "strict_divergence", "teacher_control",
)


def _opt(default, help_text, **extra):
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass
class TrainConfig:
    """The resolved options of one training run (see `docs/TRAINING.md`)."""

    # data
    aligned: str | None = _opt(None, "aligned shards directory (output of `csd-pipeline align`)")
    teacher_logits: list[str] = field(
        default_factory=list,
        metadata={"help": "teacher top-k directory, one per teacher (repeat the flag)"},
    )
    kd_teachers: str | None = _opt(None, "teachers and weights, e.g. `0:1.0,1:0.5` (default: all, weight 1)")
    # student
    student: str | None = _opt(None, "student model: a local HF directory or a hub name")
    student_config: str | None = _opt(None, "HF config JSON: start the student from scratch")
    student_tokenizer: str | None = _opt(None, "student tokenizer (required with --student-config)")
    trust_remote_code: bool = _opt(False, "allow model code from the model directory or hub")
    attn_implementation: str = _opt("sdpa", "attention kernel: sdpa, eager, flash_attention_2, ...")
    # output
    output: str | None = _opt(None, "output directory (checkpoints, metrics, export)")
    # schedule
    steps: int = _opt(1000, "optimizer steps")
    seq_len: int = _opt(2048, "tokens per packed row")
    batch_size: int = _opt(8, "packed rows per rank per micro-step")
    grad_accum: int = _opt(1, "micro-steps per optimizer step")
    lr: float = _opt(3e-4, "peak learning rate")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of --lr (cosine floor)")
    warmup_steps: int = _opt(100, "linear warm-up steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.95, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    grad_clip: float = _opt(1.0, "gradient-norm clip (0: off)")
    seed: int = _opt(0, "seed of the initialisation and the data order")
    # loss
    loss: str = _opt("csd", "csd (default), ce (no KD), csd_1to1 (only 1:1 chunks), or a baseline: uld, gold, "
                            "strict (docs/TRAINING.md)", choices=LOSSES)
    divergence: str = _opt("jsd", "jsd, kl or reverse_kl", choices=DIVERGENCES)
    beta: float = _opt(5.0, "weight of the non-1:1 chunks in the KD term")
    kd_scale: str = _opt("dynamic", "dynamic: L = CE + w*sg(CE/KD)*KD (the paper's); fixed: L = CE + w*KD; "
                                    "ratio: L = (1-w)*CE + w*KD", choices=KD_SCALES)
    kd_weight: float = _opt(1.0, "w, the multiplier of the KD term (1 with dynamic is the paper's default)")
    teacher_temperature: float = _opt(1.0, "T, softens each chunk's teacher distribution (events and REST) to "
                                           "P^(1/T), renormalised (1: the paper's)")
    spelling: str = _opt("sum", "tokens with equal bytes: sum their probabilities or exclude them",
                         choices=SPELLINGS)
    teacher_top_k: int = _opt(0, "use only the N most likely of the stored teacher top-k entries per position "
                                 "(0: all); compares top-k sizes without re-running the teacher")
    gold_matched_weight: float | None = _opt(None, "--loss gold: weight of the direct term on shared spellings "
                                                   "(the sorted term gets 1 - w); default: TRL's adaptive weight")
    strict_top_k: int = _opt(0, "--loss strict: keep the student's N most likely shared spellings (0: all)")
    strict_divergence: str = _opt("reverse_kl", "--loss strict: jsd, kl or reverse_kl (CT-OPD's)",
                                  choices=DIVERGENCES)
    teacher_control: str = _opt("none", "shuffled: give each stored teacher row to another position of the batch "
                                        "(a control arm; any loss)", choices=TEACHER_CONTROLS)
    loss_chunk_size: int = _opt(0, "positions per chunk of the student log-softmax (0: auto, about 2^25 logits)")
    # checkpoints
    save_every: int = _opt(500, "checkpoint every N steps (0: only at the end)")
    keep_last: int = _opt(2, "keep the latest N checkpoints")
    resume: bool = _opt(False, "continue from the latest complete checkpoint in --output")
    export_every: int = _opt(0, "also write the HF export every N steps (0: only at the end)")
    stop_at_step: int = _opt(0, "stop cleanly after this step, as if interrupted (0: run --steps)")
    # evaluation
    eval_aligned: str | None = _opt(None, "held-out aligned directory: report bits per byte")
    eval_every: int = _opt(0, "evaluate every N steps (0: only at the end)")
    eval_max_rows: int = _opt(0, "evaluate on at most N held-out rows (0: all)")
    # machinery
    workers: int = _opt(2, "data-loader worker processes (0: in the training process)")
    shuffle_block: int = _opt(4, "shards shuffled together (rows are permuted within a block)")
    teacher_cache_mb: int = _opt(1024, "decoded teacher top-k kept per data-loader worker, in MiB; rows are "
                                       "read in shuffled order, so a block that does not stay is decoded again")
    device: str = _opt("auto", "auto, cpu or cuda", choices=DEVICES)
    dtype: str = _opt("auto", "parameter dtype in forward/backward: auto (bf16 on GPU), float32, bfloat16",
                      choices=DTYPES)
    progress: bool = _opt(True, "progress bar on stderr (rank 0)")

    def validate(self) -> TrainConfig:
        """Check every option; raise `CsdError` naming the first one to change. Returns self."""
        if not self.aligned:
            raise CsdError("--aligned is required: pass the directory written by `csd-pipeline align`")
        if not self.output:
            raise CsdError("--output is required: pass the directory for checkpoints, metrics and the export")
        if self.student and self.student_config:
            raise CsdError("--student and --student-config are exclusive: pass a model to fine-tune "
                           "or a config to start from scratch, not both")
        if not self.student and not self.student_config:
            raise CsdError("no student: pass --student (HF directory or hub name) or --student-config "
                           "FILE.json with --student-tokenizer")
        if self.student_config and not self.student_tokenizer:
            raise CsdError("--student-config needs --student-tokenizer: a model started from scratch "
                           "has no tokenizer of its own")
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "keep_last", "shuffle_block"):
            if getattr(self, name) < 1:
                raise CsdError(f"--{_flag(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "eval_every", "export_every", "stop_at_step",
                     "eval_max_rows", "workers", "loss_chunk_size", "teacher_top_k", "teacher_cache_mb",
                     "strict_top_k"):
            if getattr(self, name) < 0:
                raise CsdError(f"--{_flag(name)} must be 0 or more, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise CsdError(f"--seq-len must be at least 2, got {self.seq_len}")
        if not self.lr > 0:
            raise CsdError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise CsdError(f"--min-lr-ratio must be within [0, 1], got {self.min_lr_ratio}")
        nonnegative = ("beta", "kd_weight", "weight_decay", "grad_clip")
        if any(getattr(self, n) < 0 for n in nonnegative):
            bad = next(n for n in nonnegative if getattr(self, n) < 0)
            raise CsdError(f"--{_flag(bad)} must be 0 or more, got {getattr(self, bad)}")
        if self.kd_scale == "ratio" and (self.kd_weight > 1 or self.loss == "ce"):
            raise CsdError(f"--kd-scale ratio needs a KD loss and --kd-weight within [0, 1], got --loss {self.loss} "
                           f"and --kd-weight {self.kd_weight}")
        if self.gold_matched_weight is not None and not 0 <= self.gold_matched_weight <= 1:
            raise CsdError(f"--gold-matched-weight must be within [0, 1], got {self.gold_matched_weight}")
        if self.loss in ("uld", "gold", "strict") and self.teacher_temperature != 1:
            raise CsdError(f"--teacher-temperature applies to the csd losses only; leave it at 1 with --loss {self.loss}")
        if not (self.teacher_temperature > 0 and math.isfinite(self.teacher_temperature)):
            raise CsdError(f"--teacher-temperature must be a positive number, got {self.teacher_temperature}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise CsdError(f"--{_flag(name)} must be within [0, 1), got {getattr(self, name)}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise CsdError(f"--{_flag(f.name)} must be one of {', '.join(choices)}, "
                               f"got {getattr(self, f.name)!r}")
        if self.loss != "ce" and not self.teacher_logits:
            raise CsdError(f"--loss {self.loss} needs teacher top-k: pass --teacher-logits DIR "
                           "(from `csd-pipeline teacher-logits`) or use --loss ce")
        self.teacher_weights()  # parses --kd-teachers
        return self

    def teacher_weights(self) -> dict[int, float]:
        """Teacher index -> KD weight, from `--kd-teachers` (default: every given teacher, weight 1)."""
        if self.kd_teachers in (None, ""):
            return {i: 1.0 for i in range(len(self.teacher_logits))}
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

    def to_dict(self) -> dict:
        """The options as plain YAML/JSON-safe values."""
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _coerce(name: str, value, origin: str):
    """Turn a YAML or command-line value into the option's type; raise naming the option."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and optional else hint
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
        return None
    try:
        if typing.get_origin(base) is list:
            if isinstance(value, str):
                return [v for v in value.split(",") if v]
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            raise TypeError
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    kind = getattr(base, "__name__", str(base))
    raise CsdError(f"option {name} ({origin}) expects {kind}, got {value!r}; fix the value")


def _known(name: str, origin: str) -> str:
    key = name.replace("-", "_")
    if key not in _FIELDS:
        close = [k for k in _FIELDS if k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise CsdError(f"unknown option {name!r} in {origin}{hint}; run `csd-train --help` for the list")
    return key


def load_yaml(path: str) -> dict:
    """Read a YAML mapping of options; raise `CsdError` for a missing or malformed file."""
    import yaml

    if not os.path.isfile(path):
        raise CsdError(f"config file {path} does not exist; pass an existing YAML file to --config")
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0] if str(err) else "parse error"
            raise CsdError(f"config file {path} is not valid YAML ({first}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CsdError(f"config file {path} must hold a mapping of option: value, not {type(data).__name__}")
    return data


def parse_args(argv: list[str]) -> TrainConfig:
    """Resolve defaults, `--config FILE.yaml`, flags and `key=value` into a validated `TrainConfig`."""
    values: dict = {}
    explicit_lists: set[str] = set()
    argv = list(argv)
    # The YAML file applies first, wherever --config appears on the line.
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if "=" in token:
                path = token.split("=", 1)[1]
            elif i + 1 < len(argv):
                path = argv[i + 1]
                i += 1
            else:
                raise CsdError("--config needs a YAML file path")
            for key, value in load_yaml(path).items():
                name = _known(str(key), f"config file {path}")
                values[name] = _coerce(name, value, f"config file {path}")
        else:
            rest.append(token)
        i += 1
    i = 0
    while i < len(rest):
        token = rest[i]
        if token.startswith("--"):
            raw, has_value, inline = token[2:].partition("=")
            negated = raw.startswith("no-") and raw[3:].replace("-", "_") in _FIELDS
            name = _known(raw[3:] if negated else raw, "the command line")
            hint = _HINTS[name]
            if hint is bool and not has_value:
                values[name] = not negated
            else:
                if negated:
                    raise CsdError(f"--{raw} takes no value; use --{_flag(name)} VALUE")
                if not has_value:
                    if i + 1 >= len(rest):
                        raise CsdError(f"--{_flag(name)} needs a value")
                    inline = rest[i + 1]
                    i += 1
                value = _coerce(name, inline, f"--{_flag(name)}")
                if typing.get_origin(hint) is list:
                    if name not in explicit_lists:
                        values[name] = []
                        explicit_lists.add(name)
                    values[name] = values[name] + value
                else:
                    values[name] = value
        elif "=" in token:
            key, _, value = token.partition("=")
            name = _known(key, f"override {token!r}")
            values[name] = _coerce(name, value, f"override {token!r}")
        else:
            raise CsdError(f"unexpected argument {token!r}; options are --flag VALUE or key=value")
        i += 1
    return TrainConfig(**values).validate()


def help_text() -> str:
    """The `csd-train --help` text, generated from the dataclass."""
    lines = [
        "usage: csd-train [--config FILE.yaml] [key=value ...] [--option VALUE ...]",
        "",
        "Train a student with Common-Support Distillation from cached aligned + teacher top-k shards.",
        "Single process: `csd-train ...`; N ranks: `torchrun --nproc-per-node N --no-python csd-train ...`.",
        "",
        "options (YAML key / key=value use underscores, flags use dashes):",
    ]
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{_flag(f.name):22s} {f.metadata.get('help', '')} [default: {default}]")
    return "\n".join(lines)


def write_resolved(config: TrainConfig, path: str) -> None:
    """Write the resolved options as YAML (atomically)."""
    import yaml

    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        yaml.safe_dump(config.to_dict(), handle, sort_keys=False)
    os.replace(tmp, path)


def check_resume_compatible(config: TrainConfig, saved: dict, where: str) -> None:
    """Refuse a resume whose trajectory options differ from the run that wrote the checkpoint."""
    changed = [k for k in TRAJECTORY_KEYS if k in saved and saved[k] != getattr(config, k)]
    if changed:
        first = changed[0]
        raise CsdError(
            f"--resume with changed option(s) {', '.join(changed)} (checkpointed run at {where} used "
            f"{first}={saved[first]!r}, now {getattr(config, first)!r}); use the original values or a new --output"
        )
