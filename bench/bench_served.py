"""Positions per second of `teacher-logits` with a served teacher (vLLM's CPU build on 127.0.0.1) against the
in-process teacher, on the same aligned windows of the same machine.

Teacher: SmolLM2-135M-Instruct (the fixture), float32 on both sides, top-32. Windows: bench_teacher's six kinds of
real text (2,000 characters each with --quick, else 16,000), aligned by the real align stage (1024-token windows).
The server runs on `THREADS` CPU threads, as the in-process teacher does, and is started once (its start-up is
reported, not counted). Measured one after the other in one run: the in-process stage, then the served stage at each
`--server-concurrency` of CONCURRENCY, each the whole stage (read, forward or requests, top-k, encode, write).
Reported: positions/s of each, served / in-process, and the server's start-up seconds. The in-process stage's
seconds include loading the model (as a user's run does); the served stage's do not include the server's start.
Also the served stage with tail samples (`--top-k 32 --server-top-k 128 --tail-samples 48`, at the largest
concurrency), and what a server's top-K' leaves of the tail that in-process draws reach: over the same positions
(float32 forward of the same model), the share of the tail mass (outside the kept top-k and the observed token)
held by the ids ranked up to K' (`tail_within_k{K'}_of_top{k}`), for the top-k of 32 and 128.
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
SERVER_TOP_K, TAIL_SAMPLES = 128, 48  # the tail-samples run: its --server-top-k and --tail-samples
COVERAGE = {32: (64, 128, 256, 512, 1024), 128: (256, 512, 1024)}  # top-k: the K' whose share of the tail is measured


def tail_within(teacher: Path, rows: list) -> dict:
    """{f"tail_within_k{K'}_of_top{k}": the share of the tail mass (outside the top-k and the observed token)
    that the ids ranked up to K' hold}, summed over every position of `rows` (teacher ids), float32 forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    deepest = max(max(ks) for ks in COVERAGE.values())
    tail, held = {}, {}
    with torch.no_grad():
        for ids in rows:
            ids = torch.as_tensor(ids, dtype=torch.long)[None]
            probs = model(ids).logits[0, :-1].float().softmax(-1).double()
            ranked, top_ids = probs.topk(deepest, dim=-1)
            observed = ids[0, 1:, None]
            top = torch.where(top_ids == observed, torch.zeros_like(ranked), ranked)  # the observed token: never drawn
            p_observed = probs.gather(1, observed)[:, 0]
            for k, wider in COVERAGE.items():
                kept_observed = (top_ids[:, :k] == observed).any(-1)
                mass = 1.0 - ranked[:, :k].sum(-1) - torch.where(kept_observed, 0.0, p_observed)
                tail[k] = tail.get(k, 0.0) + float(mass.sum())
                for k_served in wider:
                    key = (k, k_served)
                    held[key] = held.get(key, 0.0) + float(top[:, k:k_served].sum())
    return {f"tail_within_k{wide}_of_top{k}": round(held[k, wide] / tail[k], 4) for k, wide in held}


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
        with vllm_server(teacher, "teacher", SERVER_TOP_K, tmp / "server.log", threads=THREADS,
                         max_model_len=2048) as (url, _):
            startup = time.perf_counter() - started
            for concurrency in CONCURRENCY:
                seconds[f"served_c{concurrency}"] = _stage_seconds(TeacherLogitsConfig(
                    aligned=str(aligned_dir), output=str(tmp / f"served-{concurrency}"), teacher_server=url,
                    teacher_model="teacher", top_k=TOP_K, server_concurrency=concurrency))
            seconds[f"served_tail_c{CONCURRENCY[-1]}"] = _stage_seconds(TeacherLogitsConfig(
                aligned=str(aligned_dir), output=str(tmp / "served-tail"), teacher_server=url, teacher_model="teacher",
                top_k=TOP_K, server_top_k=SERVER_TOP_K, tail_samples=TAIL_SAMPLES, server_concurrency=CONCURRENCY[-1]))
        rows = [ids for shard in aligned.shards for ids in aligned.teacher_rows(shard, 0)[1]]
        coverage = tail_within(teacher, rows)
    rates = {name: positions / value for name, value in seconds.items()}
    best = max(rates[f"served_c{c}"] for c in CONCURRENCY)
    metrics = {"positions": positions, "server_startup_s": round(startup, 1),
               **{f"{name}_positions_per_s": round(rate, 1) for name, rate in rates.items()},
               "best_served_over_in_process": round(best / rates["in_process"], 3), **coverage}
    return {"name": "served", "metrics": metrics,
            "checks": {"served_stage_completes": {"value": 1, "limit": 1, "ok": True}}}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
