"""`make bench-teachers`: what a second teacher buys, in held-out bits per byte, at equal steps, data and seed.

Two real teachers with different tokenizers: SmolLM2-135M-Instruct (49k ids, teacher 0) and Gemma 3
270M (262k ids, teacher 1). The recipe is `bench/bench_quality.py`'s (its REGIMES, TRAIN_ARGS,
WINDOW, and its best arm's flags: `--loss csd --divergence kl --beta 1 --teacher-temperature 1.5`
on the stored top-128). Each regime's corpus is aligned once with both teachers and each teacher's
top-128 stored once; the arms differ only in which teachers the loss reads and how it combines them:

- `ce`: no teacher (the floor the teachers are measured against);
- `smollm2`, `gemma3`: one teacher (`--kd-teachers 0:1`, `1:1`);
- `sum`: both, `--kd-teachers 0:0.5,1:0.5`. Equal weights because the two teachers are about as good
  (issue 17's held-out figures); 0.5 each keeps KD a mean of the two per-teacher KD terms, so it has
  one teacher's magnitude under any `--kd-scale`. With the default dynamic scale only the ratio of
  the weights matters (L = CE + sg(CE/KD) KD), so 1/1 gives the same gradients;
- `select`: both, `--kd-combine select` (per group of chunks, the teacher that covers it and gives its
  text the highest log-probability; docs/TRAINING.md).

Regimes `data-limited` and `data-rich` train the 4-layer student from scratch (Llama 2 tokenizer) as
bench_quality does. Regime `pretrained` continues SmolLM2-135M-Instruct itself as the student (its own
tokenizer) on a King James Bible slice (`bench/corpus/kjv-*`, PRETRAINED: 40 steps of 2 x 256 tokens,
about 0.4 of an epoch, held-out evaluation at the end) with `ce` and CSD from Gemma 3 (`gemma3`;
`gemma3 t1` without the teacher temperature; `gemma3 w0.1` also with a tenth of the KD weight), at a
fine-tuning learning rate; it also measures the
untouched model's held-out bits per byte ("before"), and every run's exported model with the same
command (`csd-pipeline bits-per-byte`).

`--seeds 0,1,2` (default), `--regime` (repeatable), `--arms`, `--quick` (the first records of each
corpus, 20 steps per arm, 3 for `pretrained`: a smoke run, written to teachers-quick.json). Writes bench-results/teachers.json and
prints a table: mean held-out bits per byte over the seeds, half the min-max spread, vs CE, vs the
better single teacher (its mean), seconds per step (mean of the last 10 steps).

    python bench/bench_teachers.py [--quick] [--regime data-limited|data-rich|pretrained] [--arms A,B] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import (  # noqa: E402 - the recipe is bench_quality's
    ARMS,
    BEST_CSD,
    BIN,
    EVAL_POINTS,
    REGIMES,
    ROOT,
    STORED_TOP_K,
    TRAIN_ARGS,
    WARMUP_STEPS,
    WINDOW,
    _env,
    _read_jsonl,
    fresh_run,
    run,
    side_by_side,
)

TEACHERS = (("smollm2", "smollm2-135m-instruct"), ("gemma3", "gemma3-270m"))  # (tokenizer, model), by index
KD = ARMS[BEST_CSD]  # --loss csd --divergence kl --beta 1 --teacher-temperature 1.5
TEACHER_ARMS = {
    "ce": ["--loss", "ce"],
    "smollm2": [*KD, "--kd-teachers", "0:1"],
    "gemma3": [*KD, "--kd-teachers", "1:1"],
    "sum": [*KD, "--kd-teachers", "0:0.5,1:0.5"],
    "select": [*KD, "--kd-teachers", "0:1,1:1", "--kd-combine", "select"],
}
SINGLE = ("smollm2", "gemma3")
# The pretrained student: SmolLM2-135M-Instruct continued on a domain slice, CE or CSD from Gemma 3 (teacher 0 there).
PRETRAINED = {"train": "bench/corpus/kjv-train.jsonl", "heldout": "bench/corpus/kjv-heldout.jsonl", "steps": 40,
              "student": "smollm2-135m-instruct", "tokenizer": "smollm2", "teachers": (TEACHERS[1],),
              "lr": "5e-5", "warmup": 5, "eval_points": 1}
# `gemma3 t1`: the same without the teacher temperature (a pretrained student may not want a softened teacher).
# `gemma3 w0.1`: and with a tenth of the KD weight (a teacher the fine-tuned student overtakes pulls less).
PRETRAINED_ARMS = {"ce": ["--loss", "ce"], "gemma3": [*KD, "--kd-teachers", "0:1"],
                   "gemma3 t1": [*KD[:KD.index("--teacher-temperature")], "--kd-teachers", "0:1"],
                   "gemma3 w0.1": [*KD[:KD.index("--teacher-temperature")], "--kd-teachers", "0:1", "--kd-weight", "0.1"]}
ALL_REGIMES = [*REGIMES, "pretrained"]
# The estimate printed before a run: seconds per step of a one-teacher CSD arm, measured with two runs side by
# side on 2 CPU cores, one thread each (docs/RESULTS.md: 0.40-0.44 s from scratch, 7.8-7.9 s for SmolLM2-135M).
SECONDS_PER_STEP_GUESS = {"data-limited": 0.4, "data-rich": 0.4, "pretrained": 8.0}


def regime_spec(regime: str) -> dict:
    if regime == "pretrained":
        return PRETRAINED
    return {**REGIMES[regime], "student": None, "tokenizer": "llama-spm", "teachers": TEACHERS}


def regime_arms(regime: str) -> dict:
    return PRETRAINED_ARMS if regime == "pretrained" else TEACHER_ARMS


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
        dirs[f"teacher{index}"] = out / regime / f"{tokenizer}-top{STORED_TOP_K}"
        run([pipeline, "teacher-logits", "--aligned", dirs["aligned"], "--teacher", model, "--teacher-index", index,
             "--top-k", STORED_TOP_K, "--output", dirs[f"teacher{index}"], "--quiet"], log)
    return dirs


def bits_per_byte(aligned: Path, model, side: str, threads: int | None = None) -> float:
    """`csd-pipeline bits-per-byte` of a model on a held-out aligned folder, as a user runs it."""
    done = subprocess.run([str(BIN / "csd-pipeline"), "bits-per-byte", "--aligned", str(aligned), "--model", str(model),
                           "--side", side, "--seq-len", str(WINDOW), "--json", "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, env=_env(threads))
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return json.loads(done.stdout)["bits_per_byte"]


def reference_scores(regime: str, dirs: dict) -> dict:
    """Held-out bits per byte of each teacher, and for `pretrained` of the untouched student ("before")."""
    spec = regime_spec(regime)
    scores = {tokenizer: bits_per_byte(dirs["heldout"], model, f"teacher{i}")
              for i, (tokenizer, model) in enumerate(spec["teachers"])}
    if spec["student"]:
        scores["student before"] = bits_per_byte(dirs["heldout"], spec["student"], "student")
    return scores


def _student_args(regime: str) -> list:
    spec = regime_spec(regime)
    if not spec["student"]:
        return ["--student-config", "demo/student-config.json", "--student-tokenizer", spec["tokenizer"], *TRAIN_ARGS]
    args = list(TRAIN_ARGS)
    args[args.index("--lr") + 1] = spec["lr"]  # a pretrained model is fine-tuned, not trained from scratch
    return ["--student", spec["student"], *args]


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    """One training run; with `threads` (runs side by side) its output goes to its own log beside the run."""
    spec = regime_spec(regime)
    target = out / regime / "runs" / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    teachers = [flag for i in range(len(spec["teachers"])) for flag in ("--teacher-logits", dirs[f"teacher{i}"])]
    warmup = min(spec.get("warmup", WARMUP_STEPS), steps // 4)
    points = spec.get("eval_points", EVAL_POINTS)
    eval_every = max(steps // points, 1) if steps >= 4 * points else steps  # a smoke run: at the end only
    started = time.perf_counter()
    run([BIN / "csd-train", "--aligned", dirs["aligned"], *teachers, *_student_args(regime), "--output", target,
         "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout"],
         "--eval-every", eval_every, "--warmup-steps", warmup, *regime_arms(regime)[arm]], log, threads)
    seconds = time.perf_counter() - started
    evals = _read_jsonl(target / "eval.jsonl")
    final = [e for e in evals if e.get("step") == steps] or evals
    tail = _read_jsonl(target / "metrics.jsonl")[-10:]
    record = {"regime": regime, "arm": arm, "seed": seed, "steps": steps, "bits_per_byte": final[-1]["bits_per_byte"],
              "seconds": seconds, "args": regime_arms(regime)[arm], "threads": threads,
              "curve": [[e["step"], e["bits_per_byte"]] for e in evals]}
    for key in ("ce", "kd", "step_time_s", "teacher0_share", "teacher1_share", "teacher0_chunks", "teacher1_chunks"):
        values = [float(m[key]) for m in tail if m.get(key) is not None]
        if values:
            record[f"last10_{key}"] = sum(values) / len(values)
    if spec["student"]:  # the exported model, scored by the command that scored it before training
        record["export_bits_per_byte"] = bits_per_byte(dirs["heldout"], target / "export", "student", threads)
    return record


def _save(path: Path, results: list[dict], scores: dict) -> None:
    """teachers.json: a run replaces the (regime, arm, seed) runs it repeats and keeps the others."""
    if path.is_file():
        previous = json.loads(path.read_text())
        repeated = {(r["regime"], r["arm"], r["seed"]) for r in results}
        results = [r for r in previous.get("results", []) if (r["regime"], r["arm"], r["seed"]) not in repeated] + results
        scores = previous.get("reference_bits_per_byte", {}) | scores
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"results": results, "reference_bits_per_byte": scores}, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def print_table(results: list[dict], scores: dict) -> None:
    """Per regime and arm: mean bits per byte over seeds, half the min-max spread, vs CE, vs the better single
    teacher (lower mean of `smollm2` and `gemma3` alone), seconds per step."""
    print("\n| regime | arm | seeds | bits/byte | ± | vs CE | vs best single | s/step |\n|---|---|---|---|---|---|---|---|")
    for regime in [r for r in ALL_REGIMES if any(x["regime"] == r for x in results)]:
        by_arm: dict[str, list[dict]] = {}
        for r in results:
            if r["regime"] == regime:
                by_arm.setdefault(r["arm"], []).append(r)
        means = {arm: _mean([r["bits_per_byte"] for r in runs]) for arm, runs in by_arm.items()}
        singles = [means[a] for a in SINGLE if a in means and regime != "pretrained"]
        ce, best_single = means.get("ce"), min(singles) if len(singles) == len(SINGLE) else None
        for name, value in sorted((scores.get(regime) or {}).items()):
            print(f"| {regime} | {name} (no training) |  | {value:.4f} |  |  |  |  |")
        for arm in sorted(by_arm, key=means.get):
            runs, m = by_arm[arm], means[arm]
            values = [r["bits_per_byte"] for r in runs]
            spread = f"{(max(values) - min(values)) / 2:.4f}" if len(values) > 1 else ""
            vs_ce = f"{(m - ce) / ce:+.2%}" if ce and arm != "ce" else ""
            vs_single = f"{(m - best_single) / best_single:+.2%}" if best_single and arm in ("sum", "select") else ""
            steps = [r["last10_step_time_s"] for r in runs if r.get("last10_step_time_s")]
            per_step = f"{_mean(steps):.2f}" if steps else ""
            print(f"| {regime} | `{arm}` | {','.join(str(r['seed']) for r in runs)} | {m:.4f} | {spread} | {vs_ce} | "
                  f"{vs_single} | {per_step} |")
        wins = _wins(by_arm)
        if wins:
            print(f"| {regime} | {wins} |  |  |  |  |  |  |")


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-teachers")
    parser.add_argument("--regime", action="append", choices=ALL_REGIMES)
    parser.add_argument("--arms", help="comma-separated subset of the arms (a regime runs those it has)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--quick", action="store_true", help="the first records of each corpus, 20 steps per arm "
                        "(3 pretrained): a smoke run, written to teachers-quick.json")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, each with cores/jobs torch threads "
                        "(2 on 2 cores gives more runs per hour than 1; default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} must be at least 1")
    regimes = args.regime or ALL_REGIMES
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers, e.g. --seeds 0,1,2")
    wanted = [a.strip() for a in args.arms.split(",")] if args.arms else None
    known = set(TEACHER_ARMS) | set(PRETRAINED_ARMS)
    if wanted and set(wanted) - known:
        parser.error(f"--arms: unknown arm(s) {sorted(set(wanted) - known)}; choose from {sorted(known)}")
    arms = {r: [a for a in regime_arms(r) if not wanted or a in wanted] for r in regimes}
    out = ROOT / (args.out + ("-quick" if args.quick else ""))  # a smoke run's folders never mix with a measurement's
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    results_dir = ROOT / "bench-results"
    results_dir.mkdir(exist_ok=True)
    path = results_dir / ("teachers-quick.json" if args.quick else "teachers.json")
    print(f"[teachers] about {estimate_minutes(regimes, arms, seeds, args.quick):.0f} min of training "
          f"(+ aligning and teacher-logits per regime); log: {log}", flush=True)
    started = time.perf_counter()
    results, scores = [], {}
    for regime in regimes:
        prepared = time.perf_counter()
        dirs = prepare(regime, out, log, args.quick)
        scores[regime] = reference_scores(regime, dirs)
        print(f"[teachers] {regime}: prepared in {time.perf_counter() - prepared:.0f} s; no training: "
              + ", ".join(f"{k} {v:.4f}" for k, v in scores[regime].items()), flush=True)
        plan = [(arm, seed) for seed in seeds for arm in arms[regime]]
        train = partial(train_arm, regime, dirs=dirs, out=out, steps=_steps(regime, args.quick), log=log)
        for record in side_by_side(plan, args.jobs, train):
            results.append(record)
            _save(path, results, scores)
            extra = f", export {record['export_bits_per_byte']:.4f}" if "export_bits_per_byte" in record else ""
            print(f"[teachers] {regime:<12} {record['arm']:<8} seed {record['seed']}: {record['bits_per_byte']:.4f} "
                  f"bits/byte{extra} ({record['seconds']:.0f} s, {record.get('last10_step_time_s', 0):.2f} s/step)",
                  flush=True)
    merged = json.loads(path.read_text())
    print_table(merged["results"], merged["reference_bits_per_byte"])
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
