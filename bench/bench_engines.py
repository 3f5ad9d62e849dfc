"""Ray's overhead: `align` and `teacher-logits` with `--engine ray` against `--engine local`, both with
two workers on this machine (two CPUs), in one run.

Inputs: align, the committed slice tests/data/python-docs-slice.txt (256 KB; 64 KB in quick mode),
Llama 3 student / Qwen2 teacher tokenizers, 32 KB shards; teacher-logits, the real
SmolLM2-135M-Instruct on CPU (float32, one thread per worker) over the first 8 KB of the same slice
aligned for it (gpt-2 student, 2 KB shards; 3 KB in quick mode).

Measured: the whole stage call (`run_align` / `run_teacher_logits` with `workers=2`), planning, the
workers' own tokenizer or teacher loads and the manifest included; the local engine's workers are spawned
processes, Ray's are actors of a local Ray cluster started once before the timings (its start is
reported apart, `ray_start_seconds`). The two engines alternate, `REPEATS` times each, and the best of
each is kept (the machine is shared; `--stage`, `--repeats` run less). Checks: ray / local <= 1.10 per stage, and the two engines' outputs
byte-identical. `python bench/bench_engines.py [--quick]` runs it alone.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SLICE = ROOT / "tests" / "data" / "python-docs-slice.txt"
TEACHER = "smollm2-135m-instruct"
WORKERS = 2
REPEATS = 2
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


def _alternate(run, tmp: Path, stage: str, repeats: int) -> dict:
    """Run `run(out, engine)` `repeats` times per engine, alternating; best seconds of each, byte equality."""
    from csd_pipeline.runtime.ray_engine import EngineConfig

    seconds: dict[str, list[float]] = {"local": [], "ray": []}
    hashes = {}
    for repeat in range(repeats):
        order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")
        for name in order:
            out = tmp / f"{stage}-{name}-{repeat}"
            start = time.perf_counter()
            run(out, EngineConfig(engine=name))
            seconds[name].append(time.perf_counter() - start)
            hashes.setdefault(name, _hashes(out))
    local, ray = min(seconds["local"]), min(seconds["ray"])
    print(f"[engines] {stage}: local {seconds['local']}, ray {seconds['ray']} seconds", file=sys.stderr, flush=True)
    return {"local_seconds": round(local, 3), "ray_seconds": round(ray, 3), "ratio": round(ray / local, 3),
            "local_seconds_each": [round(s, 3) for s in seconds["local"]],
            "ray_seconds_each": [round(s, 3) for s in seconds["ray"]],
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


def run(quick: bool = False, stages: tuple = STAGES, repeats: int = REPEATS) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # before any worker starts: one thread per worker on both engines
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.stage import run_teacher_logits

    ray_start = start_local_ray(WORKERS)
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            data = SLICE.read_bytes()
            corpus, teacher_corpus = tmp / "docs.txt", tmp / "teacher-docs.txt"
            corpus.write_bytes(_cut(data, 64_000 if quick else len(data)))
            teacher_corpus.write_bytes(_cut(data, 3_000 if quick else 8_000))

            def align(out, engine):
                run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer="llama-bpe", teacher_tokenizers=["qwen2"],
                                      output=str(out), split_on_blank_lines=True, shard_bytes=32_000),
                          workers=WORKERS, engine=engine)

            aligned = tmp / "aligned"
            run_align(AlignConfig(corpus=[str(teacher_corpus)], student_tokenizer="gpt-2", teacher_tokenizers=["smollm2"],
                                  output=str(aligned), split_on_blank_lines=True, shard_bytes=2_000))

            def teacher(out, engine):
                run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(model_path(TEACHER)),
                                                       output=str(out), top_k=32, device="cpu", dtype="float32"),
                                   workers=WORKERS, engine=engine)

            runs = {"align": align, "teacher_logits": teacher}
            results = {stage: _alternate(runs[stage], tmp, stage, repeats) for stage in stages}
            shards = {stage: len(list((tmp / f"{stage}-local-0").glob("*.parquet"))) for stage in stages}
    finally:
        ray.shutdown()
    metrics = {"workers": WORKERS, "cpus": os.cpu_count(), "ray_version": ray.__version__,
               "ray_start_seconds": round(ray_start, 3)}
    checks = {}
    for stage, result in results.items():
        metrics |= {f"{stage}_{key}": value for key, value in result.items() if key not in ("ratio", "identical")}
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
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs per engine (the best is kept)")
    args = parser.parse_args()
    print(json.dumps(run(quick=args.quick, stages=tuple(args.stage or STAGES), repeats=args.repeats), indent=2))
