"""On-policy rounds: generate with the current student, align, teacher-logits, train, export; R times.

Round r (1-based) writes `DIR/round-r/`: `generated/` (`csd-pipeline generate`), `aligned/`
(`csd-pipeline align` of the samples as prompt/completion records: loss on the completions only),
`teacher/` (`csd-pipeline teacher-logits`) and `train/` (`csd-train --student <previous export>`, whose
`train/export/` is the next round's student). As in GKD (Agarwal et al., "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", ICLR 2024), the student trains on its own samples with the
divergence alone: cross-entropy on them would only reinforce what it already wrote (`--ce` adds it back).
Every step resumes from what is on disk (the stages from their markers; a round's training, which keeps no
checkpoint, starts again) and a finished step is skipped, so re-running the same command continues an
interrupted run. Round r samples with seed `seed + r - 1`.

`--output` may be an object-store URL (`s3://...`): every stage writes there as it does alone, and the
next round's student, a model the stages load from a local folder, is a checked local copy of the
export (`storage.model_copy`, under `--cache-dir` when given).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.options import option


@dataclass
class RoundsConfig:
    """Options of `csd-pipeline rounds`."""

    student: str = option(help="The first round's student: an HF folder (e.g. a csd-train export/).")
    teacher: str = option(help="The teacher model (HF folder, GGUF file or fixture name).")
    teacher_tokenizer: str = option(help="The teacher's tokenizer (fixture name, folder or tokenizer.json).")
    prompts: list[str] = option(help="Prompt corpus (as `csd-pipeline generate --corpus`); repeatable.")
    output: str = option(help="Output directory or object-store URL: round-1/, round-2/, ... (resumable).")
    rounds: int = option(2, "Number of rounds.")
    steps: int = option(50, "csd-train steps per round.")
    prompt_field: str = option("prompt", "The record field that holds the prompt.")
    prompt_chars: int = option(0, "When > 0: prompts are the first N characters of each document (see generate).")
    max_new_tokens: int = option(64, "Tokens the student writes per sample.")
    temperature: float = option(1.0, "Sampling temperature.")
    top_p: float = option(1.0, "Nucleus sampling mass.")
    samples_per_prompt: int = option(1, "Completions per prompt and round.")
    seed: int = option(0, "Round r samples with seed + r - 1 and trains with seed + r - 1.")
    max_student_tokens: int = option(256, "Window of the aligned rows and csd-train --seq-len.")
    top_k: int = option(32, "Teacher top-k stored per position.")
    divergence: str = option("reverse_kl", "CSD divergence (reverse KL is the usual on-policy choice).")
    ce: bool = option(False, "Also train on the samples with cross-entropy (off: L = KD alone, as GKD; csd-train "
                             "--kd-scale ratio --kd-weight 1).")
    train_args: list[str] = option([], "More csd-train flags, as one string each (e.g. '--lr 1e-4'); repeatable.")
    device: str = option("auto", "Device of generate and teacher-logits (csd-train picks its own).")

    def validate(self) -> None:
        if self.rounds < 1 or self.steps < 1:
            raise CsdError("--rounds and --steps must be at least 1.")
        fixed = [flag for flag in ("--kd-scale", "--kd-weight") for arg in self.train_args for part in arg.split()
                 if part == flag or part.startswith(flag + "=")]
        if fixed and not self.ce:
            raise CsdError(f"--train-arg sets {fixed[0]}, but without --ce the rounds train on KD alone (--kd-scale "
                           "ratio --kd-weight 1): drop it from --train-arg, or pass --ce to train with CE + KD.")


def run_rounds(config: RoundsConfig, log=print):
    """Run (or resume) every round; returns the last round's export folder (a `UPath` for a URL --output)."""
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.generate.config import GenerateConfig
    from csd_pipeline.generate.stage import run_generate
    from csd_pipeline.runtime import storage
    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.stage import run_teacher_logits

    config.validate()
    out = storage.location(config.output)
    if storage.is_remote(out):  # a missing bucket or refused credentials fail before round 1
        storage.check_writable(out)
    student = config.student
    tables: list[tuple[str, str]] = []
    for r in range(1, config.rounds + 1):
        folder = out / f"round-{r}"
        export = folder / "train" / "export"
        seed = config.seed + r - 1
        log(f"== round {r}: student {student}")
        run_generate(GenerateConfig(
            model=student, corpus=list(config.prompts), output=str(folder / "generated"),
            prompt_field=config.prompt_field,
            prompt_chars=config.prompt_chars, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            top_p=config.top_p, samples_per_prompt=config.samples_per_prompt, seed=seed, device=config.device), log=log)
        run_align(AlignConfig(
            corpus=[str(folder / "generated")], student_tokenizer=student, teacher_tokenizers=[config.teacher_tokenizer],
            output=str(folder / "aligned"), max_student_tokens=config.max_student_tokens,
            max_teacher_tokens=[config.max_student_tokens], tables=tables), log=log)
        tables = tables or [tuple(str(folder / "aligned" / "tables" / "teacher0" / name) for name in (
            "student_to_teacher.safetensors", "teacher_to_student.safetensors"))]
        run_teacher_logits(TeacherLogitsConfig(
            aligned=str(folder / "aligned"), teacher=config.teacher, output=str(folder / "teacher"), top_k=config.top_k,
            device=config.device), log=log)
        if not (export / "config.json").is_file():
            train(config, student, folder, seed, log)
        student = str(storage.model_copy(export) if storage.is_remote(export) else export)
    return export


def train_command(config: RoundsConfig, student: str, folder: Path, seed: int) -> list[str]:
    """The csd-train command of one round. Only the export is read next, so no checkpoint is kept
    (`--no-save-final`: 1.7 GB less per round for SmolLM2-135M; `--train-arg --save-final` keeps it); a round
    killed before its export trains again from the start on the re-run."""
    extra = [part for arg in config.train_args for part in arg.split()]
    kd_alone = [] if config.ce else ["--kd-scale", "ratio", "--kd-weight", "1"]
    return [sys.executable, "-m", "trainer.main", "--aligned", str(folder / "aligned"),
            "--teacher-logits", str(folder / "teacher"), "--student", student, "--output", str(folder / "train"),
            "--steps", str(config.steps), "--loss", "csd", "--divergence", config.divergence,
            "--seq-len", str(config.max_student_tokens), "--seed", str(seed), "--save-every", "0", "--no-save-final",
            *kd_alone, *extra]


def train(config: RoundsConfig, student: str, folder: Path, seed: int, log) -> None:
    command = train_command(config, student, folder, seed)
    log("$ csd-train " + " ".join(command[3:]))
    from csd_pipeline.runtime.lifetime import popen_options

    result = subprocess.run(command, **popen_options())  # a rounds command killed with -9 takes csd-train with it
    if result.returncode != 0:
        raise CsdError(f"csd-train of {folder} failed (exit {result.returncode}); fix what it printed and re-run "
                       "the same rounds command to resume.")
