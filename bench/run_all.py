"""`make bench`: run every benchmark module, print one table, write bench-results/bench.json.

Each `bench/bench_<topic>.py` exposes `run(quick=False) -> {"name", "metrics", "checks"}`; checks
are ratios measured inside one run, so a noisy shared machine slows both sides alike.
`python -m bench.run_all [--quick] [--corpus DIR] [--inspect-gb GB] [topic ...]` runs a subset. The
benchmarks that read text (align, chat, teacher, train) use the committed slices in tests/data unless
`--corpus DIR` names a folder with the full files (python-docs.txt, python-faq-chat.jsonl, botchan.txt,
...; see each module's docstring); `--inspect-gb` sizes the output `bench_inspect` scans (default 0.1 GiB).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ("tables", "align", "chat", "teacher", "served", "loss", "train", "reads", "inspect", "storage", "engines")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs: a smoke run")
    parser.add_argument("--corpus", type=Path, default=None, help="folder with the full corpus files (default: tests/data slices)")
    parser.add_argument("--inspect-gb", type=float, default=None, help="size of the output bench_inspect scans, GiB")
    parser.add_argument("topics", nargs="*", help=f"a subset of {', '.join(TOPICS)}")
    args = parser.parse_args(argv)
    quick, topics = args.quick, args.topics or list(TOPICS)
    results, failed = [], False
    for topic in topics:
        started = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.bench_{topic}")
        except ModuleNotFoundError:
            print(f"[bench] {topic}: no bench/bench_{topic}.py yet, skipped", file=sys.stderr)
            continue
        print(f"[bench] {topic} ...", file=sys.stderr, flush=True)
        try:
            options = {"corpus": args.corpus} if "corpus" in inspect.signature(module.run).parameters else {}
            if topic == "inspect" and args.inspect_gb is not None:
                options["gb"] = args.inspect_gb
            result = module.run(quick=quick, **options)
        except Exception as err:  # a broken benchmark is reported, the others still run
            traceback.print_exc()
            result = {"name": topic, "metrics": {}, "checks": {"ran": {"value": 0, "limit": 1, "ok": False}}, "error": str(err)}
        result["seconds"] = round(time.perf_counter() - started, 1)
        results.append(result)
    out_dir = ROOT / "bench-results"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(f"\n{'benchmark':<10} {'check':<38} {'value':>10} {'limit':>8}  ok")
    for result in results:
        for name, check in result.get("checks", {}).items():
            ok = "yes" if check["ok"] else "NO"
            failed |= not check["ok"]
            print(f"{result['name']:<10} {name:<38} {check['value']:>10.3f} {check['limit']:>8.3f}  {ok}")
    print(f"\n{'benchmark':<10} metric")
    for result in results:
        for name, value in result.get("metrics", {}).items():
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"{result['name']:<10} {name:<42} {shown}")
    print(f"\nwrote {out_dir / 'bench.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
