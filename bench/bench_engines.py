"""Ray's overhead: `align` and `teacher-logits` with `--engine ray` against `--engine local`, both with
two workers on this machine (two CPUs), in one run.

Inputs: align, text of tests/data/python-docs-slice.txt (`--align-bytes`, 512 KB: the 256 KB slice twice;
64 KB in quick mode), Llama 3 student / Qwen2 teacher tokenizers, 32 KB shards; teacher-logits, the real
SmolLM2-135M-Instruct on CPU (float32, one thread per worker) over `--teacher-bytes` (12 KB; 3 KB in quick
mode) of the same text aligned for it (gpt-2 student, 2 KB shards). Each run is meant to take 30 s or more
on an idle machine, so that start-up weighs in it as in a user's run.

Measured: the whole stage call (`run_align` / `run_teacher_logits` with `workers=2`), planning, the
workers' own tokenizer or teacher loads and the manifest included; the local engine's workers are spawned
processes, Ray's are actors of a local Ray cluster started once before the timings (its start is
reported apart, `ray_start_seconds`). The machine is shared and never idle, so the engines run as
interleaved pairs (local, ray, local, ray, ...; `--pairs`, 3) and the ratio is taken per pair: its median
and spread are reported. Each run's time is split into phases from the driver's shard lines: start-up
(workers or actors up, tokenizers or model loaded, first shard written), the other shards, and the end
(stats, manifest, workers stopped). Checks: median ray / local <= 1.10 per stage, and the two engines'
outputs byte-identical. `python -m bench.bench_engines [--quick] [--stage S] [--json PATH]` runs it alone.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SLICE = ROOT / "tests" / "data" / "python-docs-slice.txt"
TEACHER = "smollm2-135m-instruct"
WORKERS = 2
PAIRS = 3
ALIGN_BYTES, ALIGN_SHARD_BYTES = 512_000, 32_000
TEACHER_BYTES, TEACHER_SHARD_BYTES = 16_000, 2_000
STAGES = ("align", "teacher_logits")
LIMIT_OVERHEAD = 1.10


def _cut(data: bytes, size: int) -> bytes:
    """The first `size` bytes of `data`, cut at the next blank line."""
    end = data.find(b"\n\n", size)
    return data if end < 0 else data[:end]


def _hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file of a stage output (per-rank stats included: one rank either way)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _note_shard(written: list[float], line: str) -> None:
    """A driver log line: note when a shard's completion arrived."""
    if " wrote " in line:
        written.append(time.perf_counter())


def _pairs(run, tmp: Path, stage: str, pairs: int) -> dict:
    """Run `run(out, engine, log)` as `pairs` interleaved pairs (local, then ray, then local, ...): the ratio of each
    pair, their median and spread (a shared machine's load drifts; a pair's two runs see nearly the same load),
    and byte equality of the two engines' outputs."""
    import statistics

    from csd_pipeline.runtime.ray_engine import EngineConfig

    seconds: dict[str, list[float]] = {"local": [], "ray": []}
    phases: dict[str, list[list[float]]] = {"local": [], "ray": []}
    hashes = {}
    for pair in range(pairs):
        for name in ("local", "ray"):
            out = tmp / f"{stage}-{name}-{pair}"
            written: list[float] = []  # when each shard's completion reached the driver
            start = time.perf_counter()
            run(out, EngineConfig(engine=name), functools.partial(_note_shard, written))
            end = time.perf_counter()
            seconds[name].append(end - start)
            # start-up (workers or actors started, tokenizers or model loaded, first shard), the other shards,
            # and what follows the last one (stats, manifest, workers ended)
            phases[name].append([round(written[0] - start, 2), round(written[-1] - written[0], 2), round(end - written[-1], 2)])
            hashes.setdefault(name, _hashes(out))
            if pair:  # keep the first pair's outputs (compared and counted), not the disk space of the others
                shutil.rmtree(out, ignore_errors=True)
        print(f"[engines] {stage} pair {pair + 1}: local {seconds['local'][-1]:.1f} s, ray {seconds['ray'][-1]:.1f} s",
              file=sys.stderr, flush=True)
    ratios = [ray / local for local, ray in zip(seconds["local"], seconds["ray"])]
    return {"ratio": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3), "ratio_each": [round(r, 3) for r in ratios],
            "local_seconds_each": [round(s, 3) for s in seconds["local"]],
            "ray_seconds_each": [round(s, 3) for s in seconds["ray"]],
            "local_phases_each": phases["local"], "ray_phases_each": phases["ray"],
            "identical": hashes["local"] == hashes["ray"]}


def start_local_ray(num_cpus: int, attempts: int = 3) -> float:
    """Start a local Ray of `num_cpus` CPUs in this process (never joining another); returns the seconds of
    the start that worked. Ray gives its raylet 30 s to register: on a busy shared machine that can pass,
    so a failed start is tried again (the tests' cluster starts here too)."""
    import ray

    for attempt in range(1, attempts + 1):
        start = time.perf_counter()
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
            return time.perf_counter() - start
        except Exception as err:  # Ray raises a bare Exception for a node that timed out during startup
            ray.shutdown()
            if attempt == attempts:
                raise
            print(f"[ray] no start ({err}); trying again", file=sys.stderr, flush=True)
    return 0.0


def _corpus(data: bytes, size: int) -> bytes:
    """`size` bytes of text from the slice `data` (repeated when `size` is more; cut at a blank line)."""
    whole = data * (size // len(data) + 1)
    return _cut(whole, size)


def run(quick: bool = False, stages: tuple = STAGES, pairs: int = PAIRS, align_bytes: int = ALIGN_BYTES,
        teacher_bytes: int = TEACHER_BYTES) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # before any worker starts: one thread per worker on both engines
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.stage import run_teacher_logits

    if quick:
        align_bytes, teacher_bytes = 64_000, 3_000
    ray_start = start_local_ray(WORKERS)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            data = SLICE.read_bytes()
            corpus, teacher_corpus = tmp / "docs.txt", tmp / "teacher-docs.txt"
            corpus.write_bytes(_corpus(data, align_bytes))
            teacher_corpus.write_bytes(_corpus(data, teacher_bytes))

            def align(out, engine, log):
                run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer="llama-bpe", teacher_tokenizers=["qwen2"],
                                      output=str(out), split_on_blank_lines=True, shard_bytes=ALIGN_SHARD_BYTES),
                          workers=WORKERS, engine=engine, log=log)

            aligned = tmp / "aligned"
            run_align(AlignConfig(corpus=[str(teacher_corpus)], student_tokenizer="gpt-2", teacher_tokenizers=["smollm2"],
                                  output=str(aligned), split_on_blank_lines=True, shard_bytes=TEACHER_SHARD_BYTES))

            def teacher(out, engine, log):
                run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(model_path(TEACHER)),
                                                       output=str(out), top_k=32, device="cpu", dtype="float32"),
                                   workers=WORKERS, engine=engine, log=log)

            runs = {"align": align, "teacher_logits": teacher}
            results = {stage: _pairs(runs[stage], tmp, stage, pairs) for stage in stages}
            shards = {stage: len(list((tmp / f"{stage}-local-0").glob("*.parquet"))) for stage in stages}
    finally:
        ray.shutdown()
    sizes = {"align": align_bytes, "teacher_logits": teacher_bytes}
    metrics = {"workers": WORKERS, "cpus": os.cpu_count(), "ray_version": ray.__version__, "pairs": pairs,
               "ray_start_seconds": round(ray_start, 3),
               **{f"{stage}_corpus_bytes": len(_corpus(SLICE.read_bytes(), sizes[stage])) for stage in stages}}
    checks = {}
    for stage, result in results.items():
        metrics |= {f"{stage}_{key}": value for key, value in result.items() if key != "identical"}
        metrics[f"{stage}_shards"] = shards[stage]
        checks[f"{stage}_ray_over_local"] = {"value": result["ratio"], "limit": LIMIT_OVERHEAD,
                                            "ok": result["ratio"] <= LIMIT_OVERHEAD}
        checks[f"{stage}_ray_local_byte_identical"] = {"value": float(result["identical"]), "limit": 1.0,
                                                      "ok": result["identical"]}
    return {"name": "engines", "metrics": metrics, "checks": checks}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs: a smoke run")
    parser.add_argument("--stage", action="append", choices=STAGES, help="one stage only (repeatable; default: both)")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="interleaved (local, ray) pairs per stage")
    parser.add_argument("--align-bytes", type=int, default=ALIGN_BYTES, help="align's corpus size")
    parser.add_argument("--teacher-bytes", type=int, default=TEACHER_BYTES, help="teacher-logits' text size")
    parser.add_argument("--json", type=Path, help="also write the result here (e.g. bench-results/engines.json)")
    args = parser.parse_args()
    result = run(quick=args.quick, stages=tuple(args.stage or STAGES), pairs=args.pairs, align_bytes=args.align_bytes,
                 teacher_bytes=args.teacher_bytes)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
