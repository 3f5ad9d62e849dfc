"""Ray's overhead: `align` and `teacher-logits` with `--engine ray` against `--engine local`, both with
two workers on this machine (two CPUs), in one run.

Inputs: align, the committed slice tests/data/python-docs-slice.txt (256 KB; 64 KB in quick mode),
Llama 3 student / Qwen2 teacher tokenizers, 32 KB shards; teacher-logits, the real
SmolLM2-135M-Instruct on CPU (float32, one thread per worker) over the first 24 KB of the same slice
aligned for it (gpt-2 student, 6 KB shards; 8 KB in quick mode).

Measured: the whole stage call (`run_align` / `run_teacher_logits` with `workers=2`), planning, the
workers' own tokenizer or teacher loads and the manifest included; the local engine's workers are spawned
processes, Ray's are actors of a local Ray cluster started once before the timings (its start is
reported apart, `ray_start_seconds`). The two engines alternate, `REPEATS` times each, and the best of
each is kept (the machine is shared). Checks: ray / local <= 1.10 per stage, and the two engines' outputs
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
LIMIT_OVERHEAD = 1.10


def _cut(data: bytes, size: int) -> bytes:
    """The first `size` bytes of `data`, cut at the next blank line."""
    end = data.find(b"\n\n", size)
    return data if end < 0 else data[:end]


def _hashes(directory: Path) -> dict[str, str]:
    """sha256 of every file of a stage output (per-rank stats included: one rank either way)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _alternate(run, tmp: Path, stage: str) -> dict:
    """Run `run(out, engine)` REPEATS times per engine, alternating; best seconds of each, byte equality."""
    from csd_pipeline.runtime.ray_engine import EngineConfig

    seconds: dict[str, list[float]] = {"local": [], "ray": []}
    hashes = {}
    for repeat in range(REPEATS):
        order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")
        for name in order:
            out = tmp / f"{stage}-{name}-{repeat}"
            start = time.perf_counter()
            run(out, EngineConfig(engine=name))
            seconds[name].append(time.perf_counter() - start)
            hashes.setdefault(name, _hashes(out))
    local, ray = min(seconds["local"]), min(seconds["ray"])
    return {"local_seconds": round(local, 3), "ray_seconds": round(ray, 3), "ratio": round(ray / local, 3),
            "local_seconds_each": [round(s, 3) for s in seconds["local"]],
            "ray_seconds_each": [round(s, 3) for s in seconds["ray"]],
            "identical": hashes["local"] == hashes["ray"]}


def run(quick: bool = False) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"  # before any worker starts: one thread per worker on both engines
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray

    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.stage import run_teacher_logits

    start = time.perf_counter()
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    ray_start = time.perf_counter() - start
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            data = SLICE.read_bytes()
            corpus, teacher_corpus = tmp / "docs.txt", tmp / "teacher-docs.txt"
            corpus.write_bytes(_cut(data, 64_000 if quick else len(data)))
            teacher_corpus.write_bytes(_cut(data, 8_000 if quick else 24_000))

            def align(out, engine):
                run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer="llama-bpe", teacher_tokenizers=["qwen2"],
                                      output=str(out), split_on_blank_lines=True, shard_bytes=32_000),
                          workers=WORKERS, engine=engine)

            aligned = tmp / "aligned"
            run_align(AlignConfig(corpus=[str(teacher_corpus)], student_tokenizer="gpt-2", teacher_tokenizers=["smollm2"],
                                  output=str(aligned), split_on_blank_lines=True, shard_bytes=6_000))

            def teacher(out, engine):
                run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(model_path(TEACHER)),
                                                       output=str(out), top_k=32, device="cpu", dtype="float32"),
                                   workers=WORKERS, engine=engine)

            results = {"align": _alternate(align, tmp, "align"), "teacher_logits": _alternate(teacher, tmp, "teacher")}
            shards = {"align": len(list((tmp / "align-local-0").glob("*.parquet"))),
                      "teacher_logits": len(list((tmp / "teacher-local-0").glob("*.parquet")))}
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
    print(json.dumps(run(quick=parser.parse_args().quick), indent=2))
