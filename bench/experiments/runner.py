"""Running an experiment: its command line, the plan of (regime, arm, seed) runs, side by side, one JSON file.

`main(bench, argv)` serves every experiment module that gives a `Bench` (pretrained, prune, teachers): the
arms, seeds and regimes come from csd_pipeline/recipes/experiments.yaml, the module prepares a regime's data and stores,
scores the references, trains one arm and formats the table. Each run writes its record to
`bench-results/runs/<name>/<regime>/<arm>-seed<k>.json` and into `bench-results/<name>.json` (with the reference
scores; a run replaces the run with the same key and keeps the others); `--table FILE` only prints a file's table.
The helpers below (`run`, `fresh_run`, `side_by_side`, ...) are shared with `quality.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.experiments.plan import experiment, pick_arms, pick_seeds
from csd_pipeline.errors import CsdError

ROOT = Path(__file__).resolve().parent.parent.parent
BIN = Path(sys.executable).parent
WINDOW = 256


def _env(threads: int | None = None) -> dict:
    """This checkout's code first, whatever the installed console scripts point at; `threads` caps torch's
    intra-op threads (parallel runs on a small machine must not oversubscribe its cores)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run(cmd: list, log: Path, threads: int | None = None) -> None:
    with log.open("a") as handle:
        handle.write("$ " + " ".join(map(str, cmd)) + "\n")
        handle.flush()
        result = subprocess.run([str(c) for c in cmd], cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                env=_env(threads))
    if result.returncode != 0:
        raise RuntimeError(f"failed ({result.returncode}): {' '.join(map(str, cmd))}; see {log}{_last_error(log)}")


def _last_error(log: Path) -> str:
    """The command's own `error:` line from its log, so that a failure reads whole where only the message travels
    (a remote machine's runs)."""
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.startswith("error:")]
    return f"\n{lines[-1]}" if lines else ""


def fresh_run(target: Path, log: Path, threads: int | None) -> Path:
    """Remove an earlier run at `target` (a fresh measurement, never a resumed one); the log to write: `log`, or
    with `threads` (runs side by side) the run's own log beside it."""
    shutil.rmtree(target, ignore_errors=True)
    if not threads:
        return log
    own = target.with_name(target.name + ".log")
    own.parent.mkdir(parents=True, exist_ok=True)
    own.unlink(missing_ok=True)
    return own


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bits_per_byte(aligned: Path, model, side: str, threads: int | None = None) -> float:
    """`csd-pipeline bits-per-byte` of a model on a held-out aligned folder, as a user runs it."""
    done = subprocess.run([str(BIN / "csd-pipeline"), "bits-per-byte", "--aligned", str(aligned), "--model", str(model),
                           "--side", side, "--seq-len", str(WINDOW), "--json", "--quiet"],
                          cwd=ROOT, capture_output=True, text=True, env=_env(threads))
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return json.loads(done.stdout)["bits_per_byte"]


def side_by_side(plan: list, jobs: int, train) -> Iterator[dict]:
    """Yield each (arm, seed) run's record, `train(arm=, seed=, threads=)`, as it finishes; `jobs` > 1 runs that many
    side by side, each with cores // jobs torch threads (two runs that each take every core are ~10x slower on
    2 cores), `threads` None for one run at a time."""
    if jobs <= 1:
        for arm, seed in plan:
            yield train(arm=arm, seed=seed, threads=None)
        return
    from concurrent.futures import ThreadPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(train, arm=arm, seed=seed, threads=threads) for arm, seed in plan]
        for future in as_completed(futures):
            yield future.result()


def save_results(path: Path, results: list[dict], scores: dict, key: tuple[str, ...], head: dict | None = None,
                 **dump) -> None:
    """Write the results file: a run replaces the earlier run with the same `key` fields and keeps the others;
    reference scores merge over the earlier ones. `head`: fields written before them; `dump`: json.dumps options."""
    if path.is_file():
        previous = json.loads(path.read_text())
        repeated = {tuple(r.get(k) for k in key) for r in results}
        results = [r for r in previous.get("results", []) if tuple(r.get(k) for k in key) not in repeated] + results
        scores = previous.get("reference_bits_per_byte", {}) | scores
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**(head or {}), "reference_bits_per_byte": scores, "results": results}, **dump) + "\n")
    tmp.replace(path)


def write_run(experiment_name: str, record: dict, results_dir: Path | None = None) -> Path:
    """One run's record on its own: `bench-results/runs/<experiment>/<regime>/<arm>-seed<k>.json` (the merged
    `<experiment>.json` beside it is what the tables read: it also holds the regime's reference scores)."""
    folder = (results_dir or ROOT / "bench-results") / "runs" / experiment_name / record.get("regime", "")
    path = folder / f"{record['arm'].replace(' ', '_')}-seed{record['seed']}.json"  # no regime (prune): one less level
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def runs_by_arm(results: list[dict], regime: str) -> dict[str, list[dict]]:
    """The runs of `regime` per arm (in the order the arms first appear), each arm's runs in seed order."""
    by_arm: dict[str, list[dict]] = {}
    for r in results:
        if r.get("regime") == regime:
            by_arm.setdefault(r["arm"], []).append(r)
    return {arm: sorted(runs, key=lambda r: r["seed"]) for arm, runs in by_arm.items()}


def seed_cells(runs: list[dict]) -> dict:
    """An arm's runs as table cells: `seeds` ("0,1,2"), `values` (each seed's bits per byte, "2.2119 / 2.2124"),
    `mean` (float) and `spread` (half the min-max spread, "" for one run)."""
    values = [r["bits_per_byte"] for r in runs]
    return {"seeds": ",".join(str(r["seed"]) for r in runs), "values": " / ".join(f"{v:.4f}" for v in values),
            "mean": sum(values) / len(values), "spread": f"{(max(values) - min(values)) / 2:.4f}" if len(values) > 1 else ""}


@dataclass(frozen=True)
class Bench:
    """What an experiment module gives `main`: its name in csd_pipeline/recipes/experiments.yaml and its parts.

    prepare(regime, out, log, quick) -> dirs; scores(regime, dirs, previous) -> reference scores (`previous`: the
    results file's, to reuse); train(regime, arm, seed, dirs, out, steps, log, threads) -> record; steps(regime,
    quick) -> int; table(merged results file) -> text; line(record) -> one progress line."""

    name: str
    doc: str
    prepare: Callable
    scores: Callable
    train: Callable
    steps: Callable
    table: Callable
    line: Callable
    key: tuple[str, ...] = ("regime", "arm", "seed")
    head: dict | None = None
    dump: dict | None = None
    default_arms: list[str] | None = None
    before: Callable | None = None  # before(regimes, arms by regime, seeds, quick, log): e.g. a duration estimate


def _parser(bench: Bench) -> argparse.ArgumentParser:
    exp = experiment(bench.name)
    parser = argparse.ArgumentParser(description=bench.doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"out/bench-{bench.name}")
    parser.add_argument("--regime", action="append", choices=list(exp.regimes), help="repeatable; default: all")
    parser.add_argument("--arms", help=f"comma-separated, of: {', '.join(exp.all_arm_names())} (default: "
                        f"{', '.join(bench.default_arms or exp.all_arm_names())})")
    parser.add_argument("--seeds", help=f"comma-separated seeds (default {','.join(map(str, exp.seeds))})")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, each with cores/jobs torch threads "
                        "(2 on 2 cores gives more runs per hour than 1; default 1)")
    parser.add_argument("--quick", action="store_true", help="a few documents and steps: a smoke run, written to "
                        f"{bench.name}-quick.json")
    parser.add_argument("--table", type=Path, help=f"only print the table of a results file (e.g. "
                        f"docs/results/{bench.name}.json)")
    return parser


def main(bench: Bench, argv: list[str]) -> int:
    """The experiment's command line: plan the runs, prepare each regime, run, save every record, print the table."""
    parser = _parser(bench)
    args = parser.parse_args(argv)
    if args.table:
        print(bench.table(json.loads(args.table.read_text())))
        return 0
    if args.jobs < 1:
        parser.error(f"--jobs: {args.jobs} must be at least 1")
    exp = experiment(bench.name)
    regimes = args.regime or list(exp.regimes)
    try:
        wanted = pick_arms(exp, args.arms, bench.default_arms or exp.all_arm_names())
        seeds = pick_seeds(args.seeds, exp.seeds)
    except CsdError as err:
        parser.error(str(err))
    arms = {regime: [a for a in exp.arms_of(regime) if a in wanted] for regime in regimes}
    out = ROOT / (args.out + ("-quick" if args.quick else ""))  # a smoke run's folders never mix with a measurement's
    out.mkdir(parents=True, exist_ok=True)
    log = out / "commands.log"
    path = ROOT / "bench-results" / (f"{bench.name}-quick.json" if args.quick else f"{bench.name}.json")
    path.parent.mkdir(exist_ok=True)
    if bench.before:
        bench.before(regimes, arms, seeds, args.quick, log)
    started, results = time.perf_counter(), []
    for regime in regimes:
        dirs = bench.prepare(regime, out, log, args.quick)
        previous = json.loads(path.read_text()).get("reference_bits_per_byte", {}) if path.is_file() else {}
        scores = bench.scores(regime, dirs, previous)
        print(f"[{bench.name}] {regime}: prepared after {time.perf_counter() - started:.0f} s", flush=True)
        train = partial(bench.train, regime, dirs=dirs, out=out, steps=bench.steps(regime, args.quick), log=log)
        for record in side_by_side([(arm, seed) for seed in seeds for arm in arms[regime]], args.jobs, train):
            results.append(record)
            write_run(path.stem, record, path.parent)
            save_results(path, results, scores, bench.key, bench.head, **(bench.dump or {}))
            print(f"[{bench.name}] {regime} {bench.line(record)} ({record['seconds']:.0f} s)", flush=True)
        save_results(path, results, scores, bench.key, bench.head, **(bench.dump or {}))
    print(bench.table(json.loads(path.read_text())))
    print(f"\n{(time.perf_counter() - started) / 60:.1f} min in all; wrote {path}")
    return 0
