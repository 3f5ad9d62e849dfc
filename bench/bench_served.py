"""Positions per second of `teacher-logits` with a served teacher (vLLM's CPU build on 127.0.0.1) against the
in-process teacher, on the same aligned windows of the same machine.

Teacher: SmolLM2-135M-Instruct (the fixture), float32 on both sides, top-32. Windows: bench_teacher's six kinds of
real text (2,000 characters each with --quick, else 16,000), aligned by the real align stage (1024-token windows).
The server runs on `THREADS` CPU threads, as the in-process teacher does, and is started once (its start-up is
reported, not counted). Measured one after the other in one run: the in-process stage, then the served stage at each
`--server-concurrency` of CONCURRENCY, each the whole stage (read, forward or requests, top-k, encode, write).
Reported: positions/s of each, served / in-process, and the server's start-up seconds. The in-process stage's
seconds include loading the model (as a user's run does); the served stage's do not include the server's start.
Needs `make vllm-venv`.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

TEACHER = "smollm2-135m-instruct"
TOP_K = 32
THREADS = 2
CONCURRENCY = (1, 4, 16)


def _stage_seconds(config) -> float:
    from csd_pipeline.teacher.stage import run_teacher_logits

    started = time.perf_counter()
    if not run_teacher_logits(config, log=None).complete:
        raise RuntimeError(f"teacher-logits did not complete into {config.output}")
    return time.perf_counter() - started


def run(quick: bool = False, corpus: Path | None = None) -> dict:
    import torch

    from bench.bench_teacher import _align
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.teacher.stage import TeacherLogitsConfig
    from tests.teacher.vllm_server import vllm_server

    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp_name:
        tmp = Path(tmp_name)
        aligned_dir, _ = _align(tmp, quick, corpus)
        aligned = AlignedOutput.open(aligned_dir)
        positions = sum(len(ids) for shard in aligned.shards for ids in aligned.teacher_rows(shard, 0)[1])
        teacher = model_path(TEACHER)
        seconds = {"in_process": _stage_seconds(TeacherLogitsConfig(
            aligned=str(aligned_dir), output=str(tmp / "local"), teacher=str(teacher), top_k=TOP_K))}
        started = time.perf_counter()
        with vllm_server(teacher, "teacher", TOP_K, tmp / "server.log", threads=THREADS, max_model_len=2048) as (url, _):
            startup = time.perf_counter() - started
            for concurrency in CONCURRENCY:
                seconds[f"served_c{concurrency}"] = _stage_seconds(TeacherLogitsConfig(
                    aligned=str(aligned_dir), output=str(tmp / f"served-{concurrency}"), teacher_server=url,
                    teacher_model="teacher", top_k=TOP_K, server_concurrency=concurrency))
    rates = {name: positions / value for name, value in seconds.items()}
    best = max(rates[f"served_c{c}"] for c in CONCURRENCY)
    metrics = {"positions": positions, "server_startup_s": round(startup, 1),
               **{f"{name}_positions_per_s": round(rate, 1) for name, rate in rates.items()},
               "best_served_over_in_process": round(best / rates["in_process"], 3)}
    return {"name": "served", "metrics": metrics,
            "checks": {"served_stage_completes": {"value": 1, "limit": 1, "ok": True}}}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
