"""`make bench-teachers`: what a second teacher buys, in held-out bits per byte, at equal steps, data and seed.

Two real teachers with different tokenizers: SmolLM2-135M-Instruct (49k ids, teacher 0) and Gemma 3
270M (262k ids, teacher 1). The recipe is `make bench-quality`'s (its REGIMES, its training recipe
experiments.yaml's `bench-train`, and its best arm's flags: `--loss csd --divergence kl --beta 1 --teacher-temperature 1.5`
on the stored top-128). Each regime's corpus is aligned once with both teachers and each teacher's
top-128 stored once; the arms (csd_pipeline/recipes/experiments.yaml, `teachers`) differ only in which
teachers the loss reads and how it combines them:

- `ce`: no teacher (the floor the teachers are measured against);
- `smollm2`, `gemma3`: one teacher (`--kd-teachers 0:1`, `1:1`);
- `sum`: both, `--kd-teachers 0:0.5,1:0.5`. Equal weights because the two teachers are about as good
  (issue 17's held-out figures); 0.5 each keeps KD a mean of the two per-teacher KD terms, so it has
  one teacher's magnitude under any `--kd-scale`. With the default dynamic scale only the ratio of
  the weights matters (L = CE + sg(CE/KD) KD), so 1/1 gives the same gradients;
- `select`: both, `--kd-combine select` (per group of chunks, the teacher that covers it and gives its
  text the highest log-probability; docs/TRAINING.md).

Regimes `data-limited` and `data-rich` train the 4-layer student from scratch (Llama 2 tokenizer) as
`make bench-quality` does. Regime `pretrained` continues SmolLM2-135M-Instruct itself as the student (its own
tokenizer) on a King James Bible slice (`bench/corpus/kjv-*`, PRETRAINED: 40 steps of 2 x 256 tokens,
about 0.4 of an epoch, held-out evaluation at the end) with `ce` and CSD from Gemma 3 (`gemma3`;
`gemma3 t1` without the teacher temperature; `gemma3 w0.1` also with a tenth of the KD weight), at a
fine-tuning learning rate; it also measures the
untouched model's held-out bits per byte ("before"), and every run's exported model with the same
command (`csd-pipeline bits-per-byte`).

`--seeds 0,1,2` (default), `--regime` (repeatable), `--arms`, `--quick` (the first records of each
corpus, 20 steps per arm, 3 for `pretrained`: a smoke run, written to teachers-quick.json). Writes bench-results/teachers.json and
prints a table (`table`; `--table FILE` only prints a results file's): each seed's held-out bits per byte, their
mean, half the min-max spread, vs CE, vs the better single teacher (its mean), seconds per step (mean of the last 10
steps).

    python -m bench.experiments.teachers [--quick] [--regime data-limited|data-rich|pretrained] [--arms A,B] [--seeds 0,1,2]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.experiments.plan import arm_flags, experiment, store_args, train_config_args
from bench.experiments.quality import EVAL_POINTS, WARMUP_STEPS
from bench.experiments.runner import (
    BIN,
    ROOT,
    WINDOW,
    Bench,
    bits_per_byte,
    fresh_run,
    main,
    read_jsonl,
    run,
    runs_by_arm,
    seed_cells,
)

TEACHERS = (("smollm2", "smollm2-135m-instruct"), ("gemma3", "gemma3-270m"))  # (tokenizer, model), by index
SINGLE = ("smollm2", "gemma3")
# The pretrained student: SmolLM2-135M-Instruct continued on a domain slice, CE or CSD from Gemma 3 (teacher 0 there).
# Its data and steps, and its arms (`regime_arms`): csd_pipeline/recipes/experiments.yaml.
PRETRAINED = {**experiment("teachers").regimes["pretrained"], "student": "smollm2-135m-instruct", "tokenizer": "smollm2",
              "teachers": (TEACHERS[1],), "lr": "5e-5", "warmup": 5, "eval_points": 1}
ALL_REGIMES = list(experiment("teachers").regimes)
# The estimate printed before a run: seconds per step of a one-teacher CSD arm, measured with two runs side by
# side on 2 CPU cores, one thread each (docs/results/teachers.md: 0.40-0.44 s from scratch, 7.8-7.9 s for SmolLM2-135M).
SECONDS_PER_STEP_GUESS = {"data-limited": 0.4, "data-rich": 0.4, "pretrained": 8.0}


def regime_spec(regime: str) -> dict:
    if regime == "pretrained":
        return PRETRAINED
    return {**experiment("teachers").regimes[regime], "student": None, "tokenizer": "llama-spm", "teachers": TEACHERS}


QUICK_RECORDS = {"train": 4, "heldout": 2}  # --quick aligns only the first records of each corpus


def _quick_corpus(corpus: str, records: int, folder: Path) -> str:
    """The first `records` records of a .jsonl corpus, copied into `folder` (a --quick run's corpus)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(corpus).name
    text = "".join((ROOT / corpus).read_text(encoding="utf-8").splitlines(keepends=True)[:records])
    if not target.is_file() or target.read_text(encoding="utf-8") != text:  # rewritten, it is another align input
        target.write_text(text, encoding="utf-8")
    return str(target)


def prepare(regime: str, out: Path, log: Path, quick: bool = False) -> dict:
    """Align train and held-out once with every teacher of the regime; store each teacher's top-128 once.
    `quick`: only the first QUICK_RECORDS records of each corpus (a smoke run)."""
    spec = regime_spec(regime)
    pipeline = BIN / "csd-pipeline"
    dirs = {name: out / regime / name for name in ("aligned", "heldout")}
    teacher_flags = [flag for tokenizer, _ in spec["teachers"] for flag in ("--teacher-tokenizer", tokenizer)]
    for name, part in (("aligned", "train"), ("heldout", "heldout")):
        corpus = _quick_corpus(spec[part], QUICK_RECORDS[part], out / regime / "quick-corpus") if quick else spec[part]
        run([pipeline, "align", "--corpus", corpus, "--student-tokenizer", spec["tokenizer"], *teacher_flags,
             "--output", dirs[name], "--max-student-tokens", WINDOW, "--max-teacher-tokens", WINDOW, "--quiet"], log)
    for index, (tokenizer, model) in enumerate(spec["teachers"]):
        store = experiment("teachers").store
        dirs[f"teacher{index}"] = out / regime / f"{tokenizer}-{store}"
        run([pipeline, "teacher-logits", "--aligned", dirs["aligned"], "--teacher", model, "--teacher-index", index,
             *store_args(store), "--output", dirs[f"teacher{index}"], "--quiet"], log)
    return dirs


def reference_scores(regime: str, dirs: dict, previous: dict | None = None) -> dict:
    """{regime: held-out bits per byte of each teacher, and for `pretrained` of the untouched student ("before")}."""
    spec = regime_spec(regime)
    scores = {tokenizer: bits_per_byte(dirs["heldout"], model, f"teacher{i}")
              for i, (tokenizer, model) in enumerate(spec["teachers"])}
    if spec["student"]:
        scores["student before"] = bits_per_byte(dirs["heldout"], spec["student"], "student")
    return {regime: scores}


def _student_args(regime: str) -> list:
    """The student; for `pretrained` also its fine-tuning rate (after the recipes, so it replaces their `lr`)."""
    spec = regime_spec(regime)
    if not spec["student"]:
        return ["--student-config", "demo/student-config.json", "--student-tokenizer", spec["tokenizer"]]
    return ["--student", spec["student"], "--lr", spec["lr"]]  # a pretrained model is fine-tuned, not trained from scratch


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    """One training run; with `threads` (runs side by side) its output goes to its own log beside the run."""
    spec, exp = regime_spec(regime), experiment("teachers")
    recipe = exp.arms_of(regime)[arm]
    target = out / regime / "runs" / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    teachers = [flag for i in range(len(spec["teachers"])) for flag in ("--teacher-logits", dirs[f"teacher{i}"])]
    warmup = min(spec.get("warmup", WARMUP_STEPS), steps // 4)
    points = spec.get("eval_points", EVAL_POINTS)
    eval_every = max(steps // points, 1) if steps >= 4 * points else steps  # a smoke run: at the end only
    started = time.perf_counter()
    run([BIN / "csd-train", *train_config_args(exp, recipe), "--aligned", dirs["aligned"], *teachers, *_student_args(regime), "--output", target, "--no-save-final",
         "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout"],
         "--eval-every", eval_every, "--warmup-steps", warmup], log, threads)
    seconds = time.perf_counter() - started
    evals = read_jsonl(target / "eval.jsonl")
    final = [e for e in evals if e.get("step") == steps] or evals
    tail = read_jsonl(target / "metrics.jsonl")[-10:]
    record = {"regime": regime, "arm": arm, "seed": seed, "steps": steps, "bits_per_byte": final[-1]["bits_per_byte"],
              "seconds": seconds, "args": arm_flags(exp, recipe), "threads": threads,
              "curve": [[e["step"], e["bits_per_byte"]] for e in evals]}
    for key in ("ce", "kd", "step_time_s", "teacher0_share", "teacher1_share", "teacher0_chunks", "teacher1_chunks"):
        values = [float(m[key]) for m in tail if m.get(key) is not None]
        if values:
            record[f"last10_{key}"] = sum(values) / len(values)
    if spec["student"]:  # the exported model, scored by the command that scored it before training
        record["export_bits_per_byte"] = bits_per_byte(dirs["heldout"], target / "export", "student", threads)
    return record


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def table(merged: dict, regimes: list[str] | None = None) -> str:
    """Per regime (`regimes`, default every one in the file) and arm: each seed's bits per byte, their mean, half the
    min-max spread, vs CE, vs the better single teacher (lower mean of `smollm2` and `gemma3` alone), seconds per
    step: a Markdown table."""
    results, scores = merged["results"], merged["reference_bits_per_byte"]
    lines = ["| regime | arm | seeds | bits/byte (per seed) | mean | ± | vs CE | vs best single | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for regime in [r for r in regimes or ALL_REGIMES if any(x["regime"] == r for x in results)]:
        by_arm = runs_by_arm(results, regime)
        cells = {arm: seed_cells(runs) for arm, runs in by_arm.items()}
        means = {arm: c["mean"] for arm, c in cells.items()}
        singles = [means[a] for a in SINGLE if a in means and regime != "pretrained"]
        ce, best_single = means.get("ce"), min(singles) if len(singles) == len(SINGLE) else None
        for name, value in sorted((scores.get(regime) or {}).items()):
            lines.append(f"| {regime} | {name} (no training) |  |  | {value:.4f} |  |  |  |  |")
        for arm in sorted(by_arm, key=means.get):
            c, m = cells[arm], means[arm]
            vs_ce = f"{(m - ce) / ce:+.2%}" if ce and arm != "ce" else ""
            vs_single = f"{(m - best_single) / best_single:+.2%}" if best_single and arm in ("sum", "select") else ""
            steps = [r["last10_step_time_s"] for r in by_arm[arm] if r.get("last10_step_time_s")]
            per_step = f"{_mean(steps):.2f}" if steps else ""
            lines.append(f"| {regime} | `{arm}` | {c['seeds']} | {c['values']} | {m:.4f} | {c['spread']} | "
                         f"{vs_ce} | {vs_single} | {per_step} |")
        wins = _wins(by_arm)
        if wins:
            lines.append(f"| {regime} | {wins} |  |  |  |  |  |  |  |")
    return "\n".join(lines)


def _wins(by_arm: dict) -> str:
    """Per two-teacher arm: on how many seeds it beats both single teachers (the issue's goal: every seed)."""
    if not all(a in by_arm for a in SINGLE):
        return ""
    best = {}
    for arm in SINGLE:
        for r in by_arm[arm]:
            best[r["seed"]] = min(best.get(r["seed"], float("inf")), r["bits_per_byte"])
    parts = []
    for arm in ("sum", "select"):
        runs = [r for r in by_arm.get(arm, []) if r["seed"] in best]
        if runs:
            parts.append(f"`{arm}` beats the better single teacher on {sum(r['bits_per_byte'] < best[r['seed']] for r in runs)}"
                         f"/{len(runs)} seeds")
    return "; ".join(parts)


def estimate_minutes(regimes: list[str], arms: dict, seeds: list[int], quick: bool) -> float:
    """A rough duration of the training runs (from SECONDS_PER_STEP_GUESS; preparation not included)."""
    total = 0.0
    for regime in regimes:
        steps = _steps(regime, quick)
        factor = {"ce": 0.6, "sum": 1.5, "select": 1.4}
        total += sum(steps * SECONDS_PER_STEP_GUESS[regime] * factor.get(a, 1.0) * len(seeds) for a in arms[regime])
    return total / 60


def _steps(regime: str, quick: bool) -> int:
    if quick:
        return 3 if regime == "pretrained" else 20
    return regime_spec(regime)["steps"]


def _before(regimes: list[str], arms: dict, seeds: list[int], quick: bool, log: Path) -> None:
    print(f"[teachers] about {estimate_minutes(regimes, arms, seeds, quick):.0f} min of training "
          f"(+ aligning and teacher-logits per regime); log: {log}", flush=True)


def _line(record: dict) -> str:
    extra = f", export {record['export_bits_per_byte']:.4f}" if "export_bits_per_byte" in record else ""
    return (f"{record['arm']:<8} seed {record['seed']}: {record['bits_per_byte']:.4f} bits/byte{extra} "
            f"({record.get('last10_step_time_s', 0):.2f} s/step)")


BENCH = Bench(name="teachers", doc=__doc__, prepare=prepare, scores=reference_scores, train=train_arm, steps=_steps,
              table=table, line=_line, before=_before, dump={"indent": 2, "sort_keys": True})

if __name__ == "__main__":
    sys.exit(main(BENCH, sys.argv[1:]))
