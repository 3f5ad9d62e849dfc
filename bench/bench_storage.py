"""csd-train steps per second reading its shards from a local S3 server against local disk (issue 31 item 5).

Inputs: the first 24,000 characters of tests/data/python-docs-slice.txt aligned into ~22 shards with a tiny
random teacher's top-8 (`tests.trainer_cases.make_read_store`), copied whole into a bucket of moto's S3
server, started here as a process on 127.0.0.1 (`tests.s3_cases.start_moto`). The 2-layer student of the
trainer tests trains `STEPS` steps (`--workers 0`, so every read is in the step's time) in these arms:
- s3-cache-cold, once first: `s3://` with an empty `--cache-dir` (each shard downloaded once, checked by sha256);
- then `--rounds` interleaved rounds (3) of: local (`--aligned` / `--teacher-logits` on local disk, the
  reference), s3 (the same folders as `s3://` URLs, each shard streamed), s3-cache-warm (`s3://` with that
  cache filled). A round's three runs see nearly the same load of the shared machine.
Steps per second is the steps after the first over the sum of their `step_time_s` (metrics.jsonl). The
ratios to local disk are taken per round; their median and spread are reported. The check: s3 with a warm
cache, median, within 10% of local disk. Not covered: a real cloud's latency and bandwidth (the server is
on this machine).

`python -m bench.bench_storage [--quick] [--rounds N] [--json PATH]` prints the table; `bench/run_all.py storage` runs it in the suite.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

STEPS, QUICK_STEPS = 40, 12
ROUNDS = 3
LIMIT = 0.90  # s3 with a warm --cache-dir: at least 90% of local disk's steps per second


def _steps_per_second(output: Path) -> float:
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()][1:]
    return len(records) / sum(r["step_time_s"] for r in records)


def _train(args: list[str], output: str, metrics_copy: Path) -> float:
    """Train one arm in this process; its steps per second (metrics read from the output, or its copy)."""
    from csd_pipeline.runtime.storage import location
    from trainer.loop import train
    from trainer.options import parse_args

    train(parse_args([*args, "--output", output]))
    if output.startswith("s3://"):
        metrics_copy.mkdir(parents=True, exist_ok=True)
        (metrics_copy / "metrics.jsonl").write_bytes((location(output) / "metrics.jsonl").read_bytes())
        return _steps_per_second(metrics_copy)
    return _steps_per_second(Path(output))


def run(quick: bool = False, rounds: int = ROUNDS) -> dict:
    import torch

    from csd_pipeline.runtime import storage
    from tests.s3_cases import moto_server
    from tests.trainer_cases import STUDENT_CONFIG, make_read_store

    torch.set_num_threads(1)
    steps = QUICK_STEPS if quick else STEPS
    try:
        with tempfile.TemporaryDirectory() as tmp_name, moto_server("bench") as server:
            tmp = Path(tmp_name)
            store = make_read_store(tmp)
            (tmp / "student.json").write_text(json.dumps(STUDENT_CONFIG))
            server.client().create_bucket(Bucket="bench")
            for name in ("aligned", "topk"):
                server.put_tree(store[name], f"s3://bench/{name}")
            common = ["--student-config", str(tmp / "student.json"), "--student-tokenizer", "llama-spm",
                      "--steps", str(steps), "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3",
                      "--warmup-steps", "1", "--save-every", "0", "--workers", "0", "--no-progress"]
            sources = {"local": [str(store["aligned"]), str(store["topk"])],
                       "s3": ["s3://bench/aligned", "s3://bench/topk"]}
            speeds: dict[str, list[float]] = {}

            def arm_speed(arm: str, name: str) -> float:
                cache = tmp / "cache"
                if arm.startswith("s3-cache"):
                    os.environ[storage.CACHE_ENV] = str(cache)
                else:
                    os.environ.pop(storage.CACHE_ENV, None)
                aligned, topk = sources["local" if arm == "local" else "s3"]
                output = str(tmp / name) if arm == "local" else f"s3://bench/runs/{name}"
                speed = _train(["--aligned", aligned, "--teacher-logits", topk, *common], output, tmp / f"copy-{name}")
                print(f"[storage] {name}: {speed:.3f} steps/s", file=sys.stderr, flush=True)
                return speed

            speeds["s3-cache-cold"] = [arm_speed("s3-cache-cold", "s3-cache-cold")]  # fills the cache
            for round_ in range(rounds):  # interleaved: a round's arms see nearly the same load
                for arm in ("local", "s3", "s3-cache-warm"):
                    speeds.setdefault(arm, []).append(arm_speed(arm, f"{arm}-{round_}"))
    finally:
        os.environ.pop(storage.CACHE_ENV, None)
    import statistics

    metrics: dict = {"rounds": rounds, **{f"{arm}_steps_per_s_each": [round(v, 3) for v in values]
                                          for arm, values in speeds.items()}}
    for arm in ("s3", "s3-cache-warm"):
        ratios = [value / local for value, local in zip(speeds[arm], speeds["local"])]
        metrics |= {f"{arm}_over_local": round(statistics.median(ratios), 3), f"{arm}_over_local_min": round(min(ratios), 3),
                    f"{arm}_over_local_max": round(max(ratios), 3), f"{arm}_over_local_each": [round(r, 3) for r in ratios]}
    metrics["s3-cache-cold_over_local"] = round(speeds["s3-cache-cold"][0] / statistics.median(speeds["local"]), 3)
    value = metrics["s3-cache-warm_over_local"]
    return {"name": "storage", "metrics": metrics, "steps": steps,
            "checks": {"s3_cache_warm_over_local": {"value": value, "limit": LIMIT, "ok": value >= LIMIT}}}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: a smoke run")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds (local, s3, s3 with a warm cache)")
    parser.add_argument("--json", type=Path, help="also write the result here (e.g. bench-results/storage.json)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, rounds=args.rounds)
    metrics = result["metrics"]
    print(f"csd-train, {result['steps']} steps, tiny student, --workers 0 (moto S3 server on 127.0.0.1), "
          f"{metrics['rounds']} interleaved rounds\n")
    print("| shards read from | steps/s (each round) | x local disk: median (min-max) |")
    print("|---|---|---|")
    for arm in ("local", "s3", "s3-cache-cold", "s3-cache-warm"):
        each = ", ".join(f"{v:.2f}" for v in metrics[f"{arm}_steps_per_s_each"])
        ratio = ("1" if arm == "local" else f"{metrics[f'{arm}_over_local']:.3f}" + (
            f" ({metrics[f'{arm}_over_local_min']:.3f}-{metrics[f'{arm}_over_local_max']:.3f})"
            if f"{arm}_over_local_min" in metrics else ""))
        print(f"| {arm} | {each} | {ratio} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["ok"] for c in result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
