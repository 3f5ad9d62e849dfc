"""`make demo`: the four stages on the embedded default, as a user runs them, then a report.

Teacher: SmolLM2-135M-Instruct (ByteLevel BPE, 49,152 ids). Student: a small Llama from scratch
with the Llama 2 SentencePiece tokenizer (byte fallback, 32,000 ids). Corpus: The Devil's
Dictionary (public domain, `demo/corpus`), every tenth document held out. Two students are trained
identically, one with CSD and one with cross-entropy only, and scored in held-out bits per byte
next to the teacher, and on the project's lm-evaluation-harness tasks `csd_next_sentence` and
`csd_heldout_devil` (the students by `csd-train --eval-tasks` on their exports, the teacher by
`csd-pipeline evaluate`).
Every command is printed before it runs so it can be copied.

    python -m demo.run [--out out/demo] [--steps N] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from csd_pipeline.recipes import as_flags, load_store, recipe_flags, recipe_path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TEACHER = "smollm2-135m-instruct"
TEACHER_TOKENIZER = "smollm2"
STUDENT_TOKENIZER = "llama-spm"
WINDOW = 256

# The recipes (shipped: csd_pipeline/recipes/demo/, stores/; docs/ARCHITECTURE.md "Adding a recipe"): the training recipe of both students
# (the benchmark's: batches of 2 windows, more steps for the same tokens helped every arm but CE on limited data),
# the CSD arm's loss, chosen from `make bench-quality` (docs/RESULTS.md, "What CSD buys"), the CE twin's, and the
# store: of the teacher's top-128, the entries at least 0.02 times as likely as each position's first, plus 48
# draws from the rest at estimated probabilities, and of those only the ones the CSD loss turns into events: 89 B
# per position instead of 244 B, and a better student than the whole top-128 in both regimes of the benchmark
# (docs/SCALE.md); the demo trains no baseline, which could read neither the draws nor the event selection.
RECIPES = {"train": "demo/train", "csd": "demo/csd", "ce": "demo/ce", "store": "stores/events-min0.02-s48"}
_STORE = load_store(RECIPES["store"])
TOP_K = _STORE["top_k"]
STORE_ARGS = as_flags({key: value for key, value in _STORE.items() if key != "top_k"})
CSD_ARGS, TRAIN_ARGS = recipe_flags(RECIPES["csd"]), recipe_flags(RECIPES["train"])  # as flags (bench/ reads them)


def recipe_args(arm: str) -> list[str]:
    """`--config` of the training recipe and of the arm's (csd or ce): what the demo's csd-train reads."""
    return ["--config", recipe_path(RECIPES["train"]), "--config", recipe_path(RECIPES[arm])]


# lm-evaluation-harness: the project's offline task (docs/EVALUATION.md); chance is 0.25
TASKS = "csd_next_sentence,csd_heldout_devil"   # and the held-out text in bits per byte


STAGE_SECONDS: dict[str, float] = {}   # stage title -> seconds of its commands (the report's time table)
_stage = ["set-up"]


def stage(title: str) -> None:
    """Start a stage: print its title; the commands that follow count towards its time."""
    _stage[0] = title.split(":")[0]
    print(("\n" if STAGE_SECONDS else "") + f"== {title}", flush=True)
    STAGE_SECONDS.setdefault(_stage[0], 0.0)


def sh(cmd: list[str], *, capture: bool = False) -> str:
    """Print a command the way a user would type it, run it, stop the demo if it fails."""
    shown = " ".join(shlex.quote(str(c)) for c in cmd).replace(str(BIN) + "/", "").replace(str(ROOT) + "/", "")
    print(f"\n$ {shown}", flush=True)
    started = time.perf_counter()
    result = subprocess.run([str(c) for c in cmd], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE if capture else None)
    if result.returncode != 0:
        print(f"demo: the command above failed (exit {result.returncode})", file=sys.stderr)
        sys.exit(result.returncode)
    seconds = time.perf_counter() - started
    STAGE_SECONDS[_stage[0]] = STAGE_SECONDS.get(_stage[0], 0.0) + seconds
    print(f"  ({seconds:.1f} s)", flush=True)
    return result.stdout if capture else ""


def sh_side_by_side(commands: dict[str, list], out: Path) -> None:
    """Run `commands` at once, each with one thread (OMP_NUM_THREADS=1 unless set) and its output in
    OUT/<name>.log; print each command first and its log's last lines after; stop the demo if one fails."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started, running = time.perf_counter(), {}
    for name, cmd in commands.items():
        log = out / f"{name}.log"
        shown = " ".join(shlex.quote(str(c)) for c in cmd).replace(str(BIN) + "/", "").replace(str(ROOT) + "/", "")
        print(f"\n$ OMP_NUM_THREADS={env['OMP_NUM_THREADS']} {shown} > {log}", flush=True)
        handle = open(log, "w", encoding="utf-8")
        running[name] = (subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=handle,
                                          stderr=subprocess.STDOUT, text=True), handle, log)
    failed = None
    for name, (process, handle, log) in running.items():
        code = process.wait()
        handle.close()
        print(f"\n{log}:\n" + "".join(f"  {line}\n" for line in log.read_text(encoding="utf-8").splitlines()[-4:]))
        failed = failed or (code and (name, code, log))
    if failed:
        print(f"demo: {failed[0]} failed (exit {failed[1]}); its output is in {failed[2]}", file=sys.stderr)
        sys.exit(failed[1])
    seconds = time.perf_counter() - started
    STAGE_SECONDS[_stage[0]] = STAGE_SECONDS.get(_stage[0], 0.0) + seconds
    print(f"  ({seconds:.1f} s)", flush=True)


def tool(name: str) -> str:
    return str(BIN / name)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", help="output folder (default: out/demo)")
    parser.add_argument("--steps", type=int, default=480, help="optimizer steps of each student")
    parser.add_argument("--fresh", action="store_true", help="delete the output folder first")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pipeline, train_cmds = tool("csd-pipeline"), tool("csd-train")

    stage("1. tables: byte-exact sub-token tables, both directions, then validate")
    tables = out / "tables"
    s2t, t2s = tables / "student_to_teacher.safetensors", tables / "teacher_to_student.safetensors"
    sh([pipeline, "tables", "build-both", "--student-tokenizer", STUDENT_TOKENIZER,
        "--teacher-tokenizer", TEACHER_TOKENIZER, "--output-dir", tables])
    table_counts = json.loads(sh([pipeline, "tables", "inspect", s2t, "--json"], capture=True))

    stage("2. align: training and held-out documents, windows of at most 256 student tokens")
    aligned, heldout = out / "aligned", out / "heldout"
    for corpus, target in (("demo/corpus/devil-train.jsonl", aligned), ("demo/corpus/devil-heldout.jsonl", heldout)):
        sh([pipeline, "align", "--corpus", corpus, "--student-tokenizer", STUDENT_TOKENIZER,
            "--teacher-tokenizer", TEACHER_TOKENIZER, "--tables", s2t, t2s, "--output", target,
            "--max-student-tokens", str(WINDOW), "--max-teacher-tokens", str(WINDOW)])
    align_info = json.loads(sh([pipeline, "inspect", aligned, "--json"], capture=True))

    stage(f"3. teacher-logits: the teacher runs once; of its top-{TOP_K} the likeliest, and draws from the rest, "
          "as far as CSD reads them, are stored")
    teacher_dir = out / "teacher"
    sh([pipeline, "teacher-logits", "--aligned", aligned, "--teacher", TEACHER, "--top-k", str(TOP_K), *STORE_ARGS,
        "--output", teacher_dir])
    teacher_info = json.loads(sh([pipeline, "inspect", teacher_dir, "--json"], capture=True))

    stage("4. train: a CSD student and a CE-only twin, identical but for the loss")
    config = "demo/student-config.json"
    # the two students side by side, one thread each (on 2 cores: about 1.6 times faster than one after the other)
    sh_side_by_side({arm: [train_cmds, *recipe_args(arm), "--aligned", aligned, "--teacher-logits", teacher_dir,
                           "--student-config", config, "--student-tokenizer", STUDENT_TOKENIZER,
                           "--output", out / f"student-{arm}", "--steps", str(args.steps), "--eval-aligned", heldout,
                           "--eval-every", str(max(args.steps // 5, 1)), "--eval-tasks", TASKS]
                     for arm in ("csd", "ce")}, out)   # the tasks at the end only

    stage("5. held-out bits per byte (same bytes for every model; a student's is its final evaluation in csd-train, "
          "the same windows, not scored again)")
    scores = {}
    for name, model, side in (("teacher (SmolLM2-135M-Instruct)", TEACHER, "teacher0"),
                              ("student, CSD", out / "student-csd" / "export", "student"),
                              ("student, CE only", out / "student-ce" / "export", "student")):
        scores[name] = final_evaluation(model.parent, args.steps) if side == "student" else None
        if scores[name] is None:
            result = json.loads(sh([pipeline, "bits-per-byte", "--aligned", heldout, "--model", model, "--side", side,
                                    "--seq-len", str(WINDOW), "--json"], capture=True))
            scores[name] = result["bits_per_byte"]

    stage(f"6. {TASKS} (lm-evaluation-harness): the teacher (its scores cached beside the fixtures); the students' "
          f"final exports were scored by csd-train --eval-tasks")
    teacher_tasks = out / "teacher-tasks.json"
    from csd_pipeline.fixtures.names import fixture_dir

    # the same teacher on the same tasks every time: computed once per teacher, task files and lm-eval version
    cache = fixture_dir().parent / "task-scores"
    seed_task_scores(cache)
    sh([pipeline, "evaluate", "--model", TEACHER, "--tasks", TASKS, "--output", teacher_tasks, "--cache-dir", cache])
    from trainer.task_eval import RESULTS_DIR
    from trainer.task_eval import scores as task_scores

    results = {"teacher (SmolLM2-135M-Instruct)": teacher_tasks}
    for arm, name in (("csd", "student, CSD"), ("ce", "student, CE only")):
        results[name] = out / f"student-{arm}" / RESULTS_DIR / f"step-{args.steps:08d}.json"
    tasks = {name: task_scores(json.loads(path.read_text(encoding="utf-8"))) for name, path in results.items()}

    from demo.report import write_report

    summary = {"scores_bits_per_byte": scores, "scores_tasks": tasks, "align": align_info, "teacher": teacher_info,
               "tables": table_counts, "steps": args.steps, "csd_args": CSD_ARGS,
               "seconds": time.perf_counter() - started, "stage_seconds": dict(STAGE_SECONDS)}
    report = write_report(out, summary)
    print_summary(summary, report)
    return 0


def seed_task_scores(cache: Path) -> None:
    """Put the shipped teacher scores (demo/task-scores/, one file per cache key: the fixture teacher's sha256, the
    task files' sha256, the lm-eval version and the options) into the machine's cache where it lacks them.
    `csd-pipeline evaluate --cache-dir` reuses a file only when its whole key matches this machine's, and says so;
    any other teacher, task file or harness version is scored again, as without the seed."""
    for shipped in sorted((ROOT / "demo" / "task-scores").glob("*.json")):
        target = cache / shipped.name
        if not target.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped, target)


def final_evaluation(run: Path, steps: int) -> float | None:
    """The held-out bits per byte csd-train measured at step `steps` (its eval.jsonl; the export's weights, the
    windows `csd-pipeline bits-per-byte --seq-len WINDOW` scores), or None when it did not evaluate there."""
    path = run / "eval.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    return next((r["bits_per_byte"] for r in reversed(records) if r.get("step") == steps), None)


def print_summary(summary: dict, report: Path) -> None:
    scores = summary["scores_bits_per_byte"]
    ce = scores["student, CE only"]
    print("\n== held-out bits per byte (lower is better)")
    for name, value in scores.items():
        delta = f"  ({(value - ce) / ce:+.1%} vs CE only)" if name == "student, CSD" else ""
        print(f"  {name:<34} {value:.4f}{delta}")
    from demo.report import TASK_TABLES, task_rows

    for title, columns in TASK_TABLES:
        print(f"\n== {title}; ± the harness's standard error")
        for name, task, *cells in task_rows(summary["scores_tasks"], columns):
            print(f"  {name:<34} {task:<24} " + "   ".join(f"{label} {cell}" for (_, label), cell in zip(columns, cells)))
    shapes = chunk_shapes(summary["align"])
    total = sum(shapes.values()) or 1
    print("\n== accepted chunks by shape")
    for shape, n in shapes.items():
        print(f"  {shape:<5} {n:>7}  {n / total:6.1%}")
    print("\n== time per stage")
    for name, seconds in summary.get("stage_seconds", {}).items():
        print(f"  {name:<34} {seconds:7.1f} s")
    print(f"\nreport: {report}   ({summary['seconds'] / 60:.1f} min in all)")


def chunk_shapes(align_info: dict) -> dict:
    shapes = align_info.get("chunk_shapes", {})
    return dict(shapes.get("teacher0", shapes))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
