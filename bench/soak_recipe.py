"""The commands the chaos soak (bench/soak.py) runs: the demo's four stages and two on-policy rounds.

`recipe(options)` gives them in order, as a user types them, each with the folder it writes and the
kind of output it is (a stage output with a manifest, a training run, or the rounds driver). Both the
uninterrupted reference run and the soak run these exact commands in the same folder, so any byte that
differs comes from the kills, not from a path.

`--recipe small` (the default) keeps every stage and both rounds, on fewer documents and steps than the
demo; `--recipe demo` is the demo's own corpus, store and training options (demo/run.py), both arms.
`--no-rounds` and `--no-heldout` (no held-out align, no evaluation) make the short version of the tests.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
STUDENT_TOKENIZER, TEACHER_TOKENIZER, WINDOW = "llama-spm", "smollm2", 256


@dataclass
class Command:
    """One command of the recipe: `argv` (run from the repository root), the folder it writes, its kind."""

    name: str
    argv: list[str]
    output: Path
    kind: str                       # "stage" (shards + manifest), "tables", "train" or "rounds"
    outputs: list[tuple[str, Path]] = field(default_factory=list)  # (kind, folder) of every output it leaves


def _pipeline(*args) -> list[str]:
    return [PYTHON, "-m", "cli.main", *map(str, args)]


def _train(*args) -> list[str]:
    return [PYTHON, "-m", "trainer.main", *map(str, args)]


def write_corpus(corpus: Path, docs: int, heldout_docs: int) -> tuple[Path, Path]:
    """The first `docs` training and `heldout_docs` held-out documents of the demo corpus (0: all), in
    `corpus`; a file already there with that text is kept (stages record its modification time)."""
    corpus.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count in (("devil-train.jsonl", docs), ("devil-heldout.jsonl", heldout_docs)):
        lines = (ROOT / "demo" / "corpus" / name).read_text(encoding="utf-8").splitlines(keepends=True)
        target, text = corpus / name, "".join(lines[:count] if count else lines)
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        paths.append(target)
    for line in paths[0].read_text(encoding="utf-8").splitlines():
        json.loads(line)  # a broken corpus is a soak set-up error, not a kill's
    return paths[0], paths[1]


def recipe(options, work: Path, store=None, engine_args: tuple = ()) -> list[Command]:
    """The soak's commands, writing under `work`; the outputs of align, teacher-logits and csd-train under
    `store` (default `work`; an object-store path with `--storage s3`, and then no rounds), and align and
    teacher-logits on the engine of `engine_args` (bench/soak_backends.py)."""
    from demo.run import CSD_ARGS, STORE_ARGS, TOP_K

    demo = options.recipe == "demo"
    store = work if store is None else store
    train_corpus, heldout_corpus = write_corpus(work.parent / "corpus", 0 if demo else options.docs,
                                                0 if demo else options.heldout_docs)
    tables = work / "tables"
    s2t, t2s = tables / "student_to_teacher.safetensors", tables / "teacher_to_student.safetensors"
    commands = [Command("tables", _pipeline("tables", "build-both", "--student-tokenizer", STUDENT_TOKENIZER,
                                            "--teacher-tokenizer", TEACHER_TOKENIZER, "--output-dir", tables),
                        tables, "tables")]
    shard = ["--shard-mb", str(options.shard_kb / 1024)]
    for name, corpus in (("aligned", train_corpus), ("heldout", heldout_corpus))[:1 if options.no_heldout else 2]:
        commands.append(Command(f"align {name}", _pipeline(
            "align", "--corpus", corpus, "--student-tokenizer", STUDENT_TOKENIZER, "--teacher-tokenizer",
            TEACHER_TOKENIZER, "--tables", s2t, t2s, "--output", store / name, "--max-student-tokens", WINDOW,
            "--max-teacher-tokens", WINDOW, "--quiet", *shard, *engine_args), store / name, "stage"))
    commands.append(Command("teacher-logits", _pipeline(
        "teacher-logits", "--aligned", store / "aligned", "--teacher", options.teacher, "--top-k", TOP_K,
        *STORE_ARGS, "--output", store / "teacher", "--device", "cpu", "--quiet", *engine_args),
        store / "teacher", "stage"))
    steps = 480 if demo else options.steps
    arms = {"csd": CSD_ARGS, "ce": ["--loss", "ce"]} if demo else {"csd": CSD_ARGS}
    for arm, loss_args in arms.items():
        output = store / f"student-{arm}"
        commands.append(Command(f"csd-train {arm}", _train(
            "--aligned", store / "aligned", "--teacher-logits", store / "teacher", "--student-config",
            options.student_config, "--student-tokenizer", STUDENT_TOKENIZER, "--output", output, "--steps", steps,
            *([] if options.no_heldout else ["--eval-aligned", store / "heldout", "--eval-every", max(steps // 2, 1)]),
            "--seq-len", WINDOW,
            "--batch-size", 2, "--lr", "3e-3", "--warmup-steps", min(80, steps // 4), "--seed", 0,
            "--save-every", options.save_every, "--workers", 1, "--device", "cpu", "--progress", "false",
            "--resume", *loss_args), output, "train"))
    if options.no_rounds or store != work:
        for command in commands:
            command.outputs = [(command.kind, command.output)]
        return commands
    rounds_out = work / "onpolicy"
    round_steps = 50 if demo else options.round_steps
    train_arg = f"--batch-size 2 --save-every {options.save_every} --workers 1 --device cpu --progress false --resume"
    commands.append(Command("rounds", _pipeline(
        "rounds", "--student", work / "student-csd" / "export", "--teacher", options.teacher, "--teacher-tokenizer",
        TEACHER_TOKENIZER, "--prompts", train_corpus, "--prompt-field", "text", "--prompt-chars", 200,
        "--max-new-tokens", 64 if demo else options.new_tokens, "--output", rounds_out, "--rounds", 2,
        "--steps", round_steps, "--device", "cpu", "--train-arg", train_arg), rounds_out, "rounds"))
    for command in commands:
        command.outputs = [(command.kind, command.output)]
    commands[-1].outputs = [("train" if part == "train" else "stage", rounds_out / f"round-{r}" / part)
                            for r in (1, 2) for part in ("generated", "aligned", "teacher", "train")]
    return commands
