"""`make bench-quality`: what CSD buys, in held-out bits per byte, at equal steps, data and seed.

Teacher SmolLM2-135M-Instruct (real), student a 4-layer 128-wide Llama from scratch with the
Llama 2 SentencePiece tokenizer. Two regimes:

- data-limited: `demo/corpus` (~32k student training tokens), ~9 epochs in 600 steps;
- data-rich: `bench/corpus/rich-*` (~165k student training tokens), ~2 epochs in 680 steps.

Every arm uses the same recipe: batches of 2 windows of <= 256 tokens, learning rate 3e-3, 80 warm-up
steps, cosine decay. Smaller batches (more steps for the same tokens) made CE better with plentiful
data and CSD better in both regimes; CE with limited data over-fits whatever the batch (docs/results/quality.md).

The teacher's top-128 is stored once per regime; arms that use fewer entries keep the most likely
ones (`teacher_top_k`, equal to a smaller capture up to ties on the log-prob grid). Default arms
(`default_arms` in csd_pipeline/recipes/experiments.yaml, about an hour on 2 CPU cores for both regimes): ce; csd under JSD with
the top-32 (beta 5, the paper's defaults; beta 1); csd with forward KL, beta 5, top-32 and top-8;
csd_1to1 and csd with forward KL, beta 1, the top-128 and teacher temperature 1.5; then ce and the
best arm again with a second seed to show seed noise. `--arms` also takes the other arms of `quality` in
csd_pipeline/recipes/experiments.yaml (each its csd-train options, and the store it reads); `--seeds 0,1,2` runs
every chosen arm with each seed. The arms `csd kl b1 p0.99 t1.5`, `p0.90` and `p0.99k64` are the best
arm reading a mass-adaptive store (`teacher-logits --top-p`), `events128`, `events72` and
`events68` a store of only the entries CSD reads (`--top-k 128` / `72` / `68 --keep csd-events`), `min0.004`,
`min0.0035` and `min0.003` of those only the ones at least that many times as likely as the position's first (`--top-k 128
--min-p R --keep csd-events`; `k255min0.0065`: `--top-k 255 --min-p 0.0065`; `w0.75` / `w1.5`: with that
`--kd-weight`), `min0.02s48` and `min0.01s32` those with `--min-p 0.02 --tail-samples 48` / `--min-p 0.01
--tail-samples 32` (draws from the rest of each position's distribution; `min0.02` the same cut without
draws, `t1` at temperature 1; `min0.05s64`: `--min-p 0.05 --tail-samples 64`); each is written once per regime
when such an arm is chosen. A subset run adds its runs to quality.json, a full run replaces
its regimes. Writes
bench-results/quality.json (with each run's held-out curve and seconds) and quality.png, and prints the table (each
seed, seed 0 vs CE's, the mean vs CE's; `table`, the block of docs/results/quality.md).

`--comparison` runs the other cross-tokenizer methods against CSD instead (`comparison_arms`): CE, the
best CSD arm and csd_1to1, ULD, GOLD and CT-OPD's strict KD each at their published defaults plus a
small sweep of their main knob, and the best CSD arm with its teacher rows shuffled (the control).
Every arm runs with seed 0; then CE, both CSD arms, the control and, per baseline, its best seed-0 arm
of the regime run with seeds 1 and 2 (`--quick`: 20 steps, seed 1 only). `--comparison --arms A,B
--seeds 0,1` runs just those (a subset run adds its runs to comparison.json). Writes
bench-results/comparison.json (comparison-quick.json) and prints the table (each seed, the mean, half the
min-max spread, vs CE, vs the control, seconds per step; `comparison_table`). `--table FILE` only prints a
results file's table (with `--comparison`, a comparison.json's). `--jobs 2` (`make bench-compare`) runs two
trainings side by side with one torch thread each: about 1.7x the runs per hour of one run on 2 cores.

    python -m bench.experiments.quality [--quick] [--regime data-limited|data-rich] [--arms A,B] [--seeds 0,1] [--out DIR]
    python -m bench.experiments.quality --comparison [--quick] [--jobs 2] [--regime ...] [--arms A,B --seeds 0,1]
    python -m bench.experiments.quality [--comparison] --table docs/results/quality.json (comparison.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

from bench.experiments.plan import arm_flags, experiment, pick_arms, pick_seeds, store_args, train_config_args
from bench.experiments.runner import (
    BIN,
    ROOT,
    WINDOW,
    bits_per_byte,
    fresh_run,
    read_jsonl,
    run,
    runs_by_arm,
    seed_cells,
    side_by_side,
    write_run,
)
from csd_pipeline.errors import CsdError

EXP = experiment("quality")  # the regimes, the arms, the stores they read, the default and comparison arms, the seeds
REGIMES = EXP.regimes  # name: {train, heldout, steps}
WARMUP_STEPS = 80  # fewer when a run is shorter than 4x this (--quick)
ARMS = EXP.arms
BEST_CSD = "csd kl b1 top128 t1.5"
CONTROL = BEST_CSD + " shuffled"
DEFAULT_ARMS = EXP.extra["default_arms"]
COMPARISON_ARMS = EXP.extra["comparison_arms"]  # per regime (why these: csd_pipeline/recipes/experiments.yaml, docs/RESULTS.md)
COMPARISON_SEEDS = tuple(EXP.extra["comparison_seeds"])  # after seed 0: CE, the CSD arms, the control, best baselines
ARM_WIDTH = max(map(len, ARMS))  # the arm column of the progress lines
EVAL_POINTS = 5  # held-out evaluations per run, the last at the final step


def prepare(regime: str, out: Path, log: Path, arms: list[str] = ()) -> dict:
    """Align train + held-out and write each store the chosen `arms` read (the experiment's top-128 at least; arms
    that read fewer entries keep the most likely, `teacher_top_k`), each once per regime."""
    spec = REGIMES[regime]
    pipeline = BIN / "csd-pipeline"
    dirs = {name: out / regime / name for name in ("aligned", "heldout")}
    for name, corpus in (("aligned", spec["train"]), ("heldout", spec["heldout"])):
        run([pipeline, "align", "--corpus", corpus, "--student-tokenizer", "llama-spm", "--teacher-tokenizer", "smollm2",
             "--output", dirs[name], "--max-student-tokens", WINDOW, "--max-teacher-tokens", WINDOW, "--quiet"], log)
    for store in dict.fromkeys([EXP.store, *(EXP.store_of(ARMS[a]) for a in arms)]):
        dirs[f"store-{store}"] = out / regime / f"teacher-{store}"
        run([pipeline, "teacher-logits", "--aligned", dirs["aligned"], "--teacher", "smollm2-135m-instruct",
             *store_args(store), "--output", dirs[f"store-{store}"], "--quiet"], log)
    return dirs


def train_arm(regime: str, arm: str, seed: int, dirs: dict, out: Path, steps: int, log: Path,
              threads: int | None = None) -> dict:
    """One training run; with `threads` (runs side by side) its output goes to its own log beside the run."""
    teacher = dirs[f"store-{EXP.store_of(ARMS[arm])}"]
    target = out / regime / "runs" / f"{arm.replace(' ', '_')}-seed{seed}"
    log = fresh_run(target, log, threads)
    started = time.perf_counter()
    run([BIN / "csd-train", *train_config_args(EXP, ARMS[arm]), "--aligned", dirs["aligned"], "--teacher-logits", teacher,
         "--student-config", "demo/student-config.json", "--student-tokenizer", "llama-spm", "--output", target, "--no-save-final",
         "--steps", steps, "--seed", seed, "--eval-aligned", dirs["heldout"], "--eval-every", max(steps // EVAL_POINTS, 1),
         "--warmup-steps", min(WARMUP_STEPS, steps // 4)], log, threads)
    evals = read_jsonl(target / "eval.jsonl")
    final = [e for e in evals if e.get("step") == steps] or evals
    tail = read_jsonl(target / "metrics.jsonl")[-10:]
    record = {"regime": regime, "arm": arm, "seed": seed, "steps": steps, "bits_per_byte": final[-1]["bits_per_byte"],
              "seconds": time.perf_counter() - started, "args": arm_flags(EXP, ARMS[arm]), "threads": threads,
              "curve": [[e["step"], e["bits_per_byte"]] for e in evals]}
    for key in ("teacher_event_mass", "student_rest_mass", "events_per_chunk", "ce", "kd", "grad_norm", "step_time_s"):
        values = [float(m[key]) for m in tail if m.get(key) is not None]
        if values:
            record[f"last10_{key}"] = sum(values) / len(values)
    return record


def teacher_score(dirs: dict, log: Path) -> float:
    """The teacher's held-out bits per byte (`csd-pipeline bits-per-byte`, as for every other model)."""
    return bits_per_byte(dirs["heldout"], "smollm2-135m-instruct", "teacher0")


def plot(results: list[dict], path: Path) -> None:
    """Per regime: the final held-out bits per byte of every run, and the held-out curves of seed 0."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    regimes = sorted({r["regime"] for r in results})
    fig, axes = plt.subplots(2, len(regimes), figsize=(6.5 * len(regimes), 9), squeeze=False)
    for column, regime in enumerate(regimes):
        rows = [r for r in results if r["regime"] == regime]
        ax = axes[0][column]
        labels = [f"{r['arm']} s{r['seed']}" for r in rows]
        ax.barh(labels, [r["bits_per_byte"] for r in rows], color=["#999999" if r["arm"] == "ce" else "#4477aa" for r in rows])
        ce = [r["bits_per_byte"] for r in rows if r["arm"] == "ce" and r["seed"] == 0]
        if ce:
            ax.axvline(ce[0], color="black", lw=0.8, ls="--")
        lo = min(r["bits_per_byte"] for r in rows)
        ax.set_xlim(lo * 0.95, max(r["bits_per_byte"] for r in rows) * 1.02)
        ax.set(title=f"{regime}: held-out bits/byte (lower is better)")
        ax = axes[1][column]
        for r in rows:
            if r["seed"] == 0 and r.get("curve"):
                steps, values = zip(*r["curve"])
                ax.plot(steps, values, label=r["arm"], color="black" if r["arm"] == "ce" else None,
                        lw=2 if r["arm"] == "ce" else 1)
        ax.set(title=f"{regime}: held-out bits/byte during training", xlabel="step", ylabel="bits/byte")
        ax.set_ylim(lo * 0.97, lo * 1.35)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _save(results: list[dict], teachers: dict, path: Path, replace_regimes: bool) -> None:
    """Write quality.json. A full run replaces the regimes it measured; a subset run (`--arms`,
    `--seeds`) replaces only the runs it repeated (same regime, arm and seed) and keeps the others."""
    if path.is_file():
        previous = json.loads(path.read_text())
        if replace_regimes:
            measured = {r["regime"] for r in results} | set(teachers)
            kept = [r for r in previous.get("results", []) if r["regime"] not in measured]
            teachers = {k: v for k, v in previous.get("teacher_bits_per_byte", {}).items() if k not in measured} | teachers
        else:
            repeated = {(r["regime"], r["arm"], r["seed"]) for r in results}
            kept = [r for r in previous.get("results", []) if (r["regime"], r["arm"], r["seed"]) not in repeated]
            teachers = previous.get("teacher_bits_per_byte", {}) | teachers
        results = kept + results
    summary = {"results": results, "teacher_bits_per_byte": teachers}
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def table(merged: dict) -> str:
    """A quality.json as a Markdown table: per regime the teacher, then per arm (in experiments.yaml's order)
    each seed's held-out bits per byte, seed 0 against CE's seed 0 and, for an arm run with several seeds, the mean
    and its margin over CE's mean (when CE has several seeds too)."""
    results, teachers = merged["results"], merged["teacher_bits_per_byte"]
    order = list(ARMS)
    lines = ["| regime | arm | seeds | bits/byte (per seed) | seed 0 vs CE | mean | mean vs CE |",
             "|---|---|---|---|---|---|---|"]
    for regime in sorted({r["regime"] for r in results}):
        by_arm = runs_by_arm(results, regime)
        cells = {arm: seed_cells(runs) for arm, runs in by_arm.items()}
        first = {arm: runs[0]["bits_per_byte"] for arm, runs in by_arm.items() if runs[0]["seed"] == 0}
        ce_mean = cells["ce"]["mean"] if len(by_arm.get("ce", [])) > 1 else None
        if regime in teachers:
            lines.append(f"| {regime} | teacher (no training) |  | {teachers[regime]:.4f} |  |  |  |")
        for arm in sorted(by_arm, key=lambda a: order.index(a) if a in order else len(order)):
            c, several = cells[arm], len(by_arm[arm]) > 1
            vs_first = f"{(first[arm] - first['ce']) / first['ce']:+.1%}" if arm != "ce" and {arm, "ce"} <= set(first) else ""
            mean = f"{c['mean']:.4f}" if several else ""
            vs_mean = f"{(c['mean'] - ce_mean) / ce_mean:+.1%}" if several and ce_mean and arm != "ce" else ""
            lines.append(f"| {regime} | `{arm}` | {c['seeds']} | {c['values']} | {vs_first} | {mean} | {vs_mean} |")
    return "\n".join(lines)


def comparison_finalists(rows: list[dict]) -> list[str]:
    """The arms that also run with COMPARISON_SEEDS: CE, both CSD arms, the control, each baseline's best seed-0 arm."""
    finals = ["ce", BEST_CSD, "csd_1to1 kl top128 t1.5", CONTROL]
    for method in ("uld", "gold", "strict"):
        mine = [r for r in rows if r["arm"].split()[0] == method]
        if mine:
            finals.append(min(mine, key=lambda r: r["bits_per_byte"])["arm"])
    return finals


def run_comparison(regimes: list[str], quick: bool, out: Path, log: Path, path: Path,
                   arms: list[str] | None = None, seeds: list[int] | None = None, jobs: int = 1) -> None:
    """Every COMPARISON_ARMS arm with seed 0, then the finalists with COMPARISON_SEEDS, per regime.

    With `arms` and/or `seeds` (a subset run): exactly those arms (default COMPARISON_ARMS) with those
    seeds (default 0), added to comparison.json in place of the same (regime, arm, seed) runs only."""
    subset = arms is not None or seeds is not None
    results, teachers = [], {}
    for regime in regimes:
        steps = 20 if quick else REGIMES[regime]["steps"]
        print(f"[comparison] {regime}: aligning and computing teacher top-k ...", flush=True)
        dirs = prepare(regime, out, log, arms or COMPARISON_ARMS[regime])
        teachers[regime] = teacher_score(dirs, log)
        rows: list[dict] = []
        plan = [(arm, s) for s in (seeds or [0]) for arm in (arms or COMPARISON_ARMS[regime])]
        for stage in range(2):  # seed 0 of every arm, then (a full run) the finalists with COMPARISON_SEEDS
            train = partial(train_arm, regime, dirs=dirs, out=out, steps=steps, log=log)
            for record in side_by_side(plan, jobs, train):
                rows.append(record)
                write_run(path.stem, record, path.parent)
                _save(results + rows, teachers, path, not subset)
                print(f"[comparison] {regime:<13} {record['arm']:<{ARM_WIDTH}} seed {record['seed']}: "
                      f"{record['bits_per_byte']:.4f} bits/byte ({record['seconds']:.0f} s)", flush=True)
            if subset or stage:
                break
            plan = [(arm, s) for s in COMPARISON_SEEDS[:1 if quick else None] for arm in comparison_finalists(rows)]
        results.extend(rows)
    _save(results, teachers, path, not subset)


def comparison_table(merged: dict) -> str:
    """A comparison.json as a Markdown table: per regime and arm (best mean first) each seed's held-out bits per
    byte, the mean, half the min-max spread, the margin over CE and over the shuffled-teacher control (both means)
    and the mean step time of its last 10 steps."""
    results, teachers = merged["results"], merged["teacher_bits_per_byte"]
    lines = ["| regime | arm | seeds | bits/byte (per seed) | mean | ± | vs CE | vs control | s/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for regime in sorted({r["regime"] for r in results}):
        by_arm = runs_by_arm(results, regime)
        cells = {arm: seed_cells(runs) for arm, runs in by_arm.items()}
        ce, control = (cells[arm]["mean"] if arm in cells else None for arm in ("ce", CONTROL))
        if regime in teachers:
            lines.append(f"| {regime} | teacher (no training) |  |  | {teachers[regime]:.4f} |  |  |  |  |")
        for arm in sorted(by_arm, key=lambda a: cells[a]["mean"]):
            c, m = cells[arm], cells[arm]["mean"]
            versus = [f"{(m - ref) / ref:+.1%}" if ref and arm != own else "" for ref, own in ((ce, "ce"), (control, CONTROL))]
            step = [r["last10_step_time_s"] for r in by_arm[arm] if r.get("last10_step_time_s")]
            step_s = f"{sum(step) / len(step):.2f}" if step else ""
            lines.append(f"| {regime} | `{arm}` | {c['seeds']} | {c['values']} | {m:.4f} | {c['spread']} | "
                         f"{versus[0]} | {versus[1]} | {step_s} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench-quality")
    parser.add_argument("--regime", action="append", choices=sorted(REGIMES))
    parser.add_argument("--arms", help="comma-separated subset of the arms")
    parser.add_argument("--seeds", help="comma-separated seeds to run every chosen arm with (default: seed 0, "
                        "then ce and the best arm with seed 1)")
    parser.add_argument("--quick", action="store_true", help="20 steps per arm (a smoke run, not a measurement; writes quality-quick.*)")
    parser.add_argument("--jobs", type=int, default=1, help="--comparison: runs side by side, each with "
                        "cores/jobs torch threads (2 on 2 cores gives more runs per hour than 1; default 1)")
    parser.add_argument("--comparison", action="store_true", help="CSD against ULD, GOLD, strict and the shuffled "
                        "control (COMPARISON_ARMS, three seeds for the finalists; writes comparison.json)")
    parser.add_argument("--table", type=Path, help="only print the table of a results file (docs/results/quality.json; "
                        "with --comparison docs/results/comparison.json)")
    args = parser.parse_args(argv)
    if args.table:
        print((comparison_table if args.comparison else table)(json.loads(args.table.read_text())))
        return 0
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    results_dir = ROOT / "bench-results"
    results_dir.mkdir(exist_ok=True)
    if args.comparison:
        try:
            arms = pick_arms(EXP, args.arms) if args.arms else None
            seeds = pick_seeds(args.seeds, ()) or None
        except CsdError as err:
            parser.error(str(err))
        path = results_dir / ("comparison-quick.json" if args.quick else "comparison.json")
        started = time.perf_counter()
        if args.jobs < 1:
            parser.error(f"--jobs: {args.jobs} must be at least 1")
        run_comparison(args.regime or list(REGIMES), args.quick, out, log, path, arms, seeds, args.jobs)
        print(comparison_table(json.loads(path.read_text())))
        print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {path}")
        return 0
    name = "quality-quick" if args.quick else "quality"  # a smoke run never mixes with measurements
    summary_path, plot_path = results_dir / f"{name}.json", results_dir / f"{name}.png"
    try:
        arms = pick_arms(EXP, args.arms, DEFAULT_ARMS)
        seeds = pick_seeds(args.seeds, EXP.seeds)
    except CsdError as err:
        parser.error(str(err))
    full = not args.arms and not args.seeds
    started = time.perf_counter()
    results, teachers = [], {}
    for regime in args.regime or list(REGIMES):
        steps = 20 if args.quick else REGIMES[regime]["steps"]
        print(f"[quality] {regime}: aligning and computing teacher top-k ...", flush=True)
        prepared = time.perf_counter()
        dirs = prepare(regime, out, log, arms)
        teachers[regime] = teacher_score(dirs, log)
        print(f"[quality] {regime}: prepared in {time.perf_counter() - prepared:.0f} s", flush=True)
        rows, plan = [], [(arm, seed) for arm in arms for seed in seeds]
        while plan:
            arm, seed = plan.pop(0)
            record = train_arm(regime, arm, seed, dirs, out, steps, log)
            rows.append(record)
            write_run(name, record, summary_path.parent)
            _save(results + rows, teachers, summary_path, full)
            print(f"[quality] {regime:<13} {arm:<{ARM_WIDTH}} seed {seed}: {record['bits_per_byte']:.4f} bits/byte "
                  f"({record['seconds']:.0f} s)", flush=True)
            kd_rows = [r for r in rows if r["arm"] != "ce"]
            if not plan and not args.seeds and seed == 0 and kd_rows:  # seed noise on CE and the best arm
                best = min(kd_rows, key=lambda r: r["bits_per_byte"])["arm"]
                plan = [(a, 1) for a in ("ce", best) if a in arms]
        results.extend(rows)
        _save(results, teachers, summary_path, full)
    merged = json.loads(summary_path.read_text())  # every regime measured so far
    plot(merged["results"], plot_path)
    print(table(merged))
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {summary_path} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
