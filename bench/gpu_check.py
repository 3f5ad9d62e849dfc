"""`make gpu-check`: on a CUDA device, what the GPU path costs and how far bf16 moves the teacher's values.

Without a CUDA device it prints "no CUDA device" and exits 0. With one (the first), on the demo corpus
aligned for the llama-spm student and the SmolLM2 teacher (windows of at most 256 tokens), it measures:
- the teacher-logits stage with the real SmolLM2-135M-Instruct teacher in bf16 (forward, float32
  log-softmax and top-32, encode, write the Parquet shard) against the same forward with no store
  writing, shard by shard in alternating order (`bench_teacher.measure_shard`): positions/s of each;
- the bf16 teacher's top-32 against the float32 teacher's on the same windows: the largest |log-prob
  difference| over the ids both lists hold (and over those the float32 teacher gives p > 1e-3), the
  share of the float32 top-32 that the bf16 one holds, and the largest error of the observed token's log-prob;
- a CSD optimizer step against a CE step on the same micro-batches (`bench_train.time_steps`: a
  ~110M-parameter Llama student, bf16 parameters, 16 rows of 256 tokens);
- peak GPU memory of the teacher stage and of training.
Prints the result as JSON and writes `bench-results/gpu_check.json`; to publish it, add it to the `runs` of
docs/results/gpu_check.json and run `make results` (`table` writes docs/results/gpu.md's block). `--dry-run-cpu` runs the same code
on the CPU at toy sizes (the tests use it; its numbers mean nothing).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORPUS = ROOT / "demo" / "corpus" / "devil-train.jsonl"
TEACHER = "smollm2-135m-instruct"
TEACHER_VOCAB = 49152
TOP_K = 32
WINDOW = 256


def _align(tmp: Path, records: int | None) -> Path:
    from csd_pipeline.align.stage import AlignConfig, run_align

    corpus = tmp / "corpus.jsonl"
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    corpus.write_text("\n".join(lines[:records]) + "\n", encoding="utf-8")
    run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer="llama-spm", teacher_tokenizers=["smollm2"],
                          output=str(tmp / "aligned"), max_student_tokens=WINDOW, max_teacher_tokens=[WINDOW],
                          shard_bytes=64 << 10), rank=0, world_size=1)
    return tmp / "aligned"


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def teacher_speed(aligned_dir: Path, device: str, out: Path) -> dict:
    """Positions/s of the bf16 stage against its forward alone; peak GPU memory."""
    import torch

    from bench.bench_teacher import ForwardClock, measure_shard
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner

    loaded = load_causal_lm(str(model_path(TEACHER)), device=device)  # bf16 on a GPU, as the stage runs it
    runner = TeacherRunner(loaded, top_k=TOP_K, vocab_limit=TEACHER_VOCAB, batch_tokens=65536)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    if runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runner.device)
    aligned = AlignedOutput.open(aligned_dir)
    clock, totals, positions = ForwardClock(runner), {"own_forward": 0.0, "stage": 0.0}, 0
    out.mkdir(parents=True, exist_ok=True)
    for index, shard in enumerate(aligned.shards):
        times, result = measure_shard(runner, clock, aligned, shard, out / shard.file, reverse=index % 2 == 1,
                                       baselines=("own_forward",), sync=sync)
        totals = {name: totals[name] + times[name] for name in totals}
        positions += result.stats["positions"]
    return {"dtype": str(loaded.dtype).removeprefix("torch."), "positions": positions,
            "stage_positions_per_s": positions / totals["stage"],
            "forward_only_positions_per_s": positions / totals["own_forward"],
            "stage_over_forward_time": totals["stage"] / totals["own_forward"],
            "peak_memory_gib": _peak_gib(runner.device)}


def topk_error(aligned_dir: Path, device: str, max_rows: int) -> dict:
    """The bf16 teacher's top-k and observed log-probs against the float32 teacher's, on the same windows."""
    import numpy as np

    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner

    aligned = AlignedOutput.open(aligned_dir)
    rows = [row for shard in aligned.shards for row in aligned.teacher_rows(shard, 0)[1]][:max_rows]
    results = {}
    for dtype in ("bfloat16", "float32"):
        loaded = load_causal_lm(str(model_path(TEACHER)), dtype=dtype, device=device)
        results[dtype] = TeacherRunner(loaded, top_k=TOP_K, vocab_limit=TEACHER_VOCAB, batch_tokens=16384).run(rows)
        del loaded
    largest, likely, observed, held, total = 0.0, 0.0, 0.0, 0, 0
    for low, exact in zip(results["bfloat16"], results["float32"], strict=True):
        same = low.ids[:, :, None] == exact.ids[:, None, :]  # [T, k bf16, k float32]
        gaps = np.abs(low.logprobs[:, :, None] - exact.logprobs[:, None, :])
        largest = max(largest, float(gaps[same].max(initial=0.0)))
        above = same & (exact.logprobs[:, None, :] > np.log(1e-3))  # the entries that carry the mass
        likely = max(likely, float(gaps[above].max(initial=0.0)))
        held += int(same.any(axis=1).sum())
        total += exact.ids.size
        observed = max(observed, float(np.nanmax(np.abs(low.observed_logprob - exact.observed_logprob), initial=0.0)))
    return {"windows": len(rows), "positions": sum(len(r) for r in rows), "top_k": TOP_K,
            "largest_logprob_error_shared_ids": largest, "largest_logprob_error_p_above_1e-3": likely,
            "float32_topk_held_by_bf16": held / total,
            "largest_observed_logprob_error": observed}


def train_speed(aligned_dir: Path, device: str, tmp: Path, quick: bool) -> dict:
    """A CSD step against a CE step on the same micro-batches (bf16 parameters, also on the CPU); peak GPU memory."""
    import dataclasses

    import torch

    from bench.bench_train import CPU_STUDENT, GPU_STUDENT, time_steps, train_config
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from trainer import distributed

    teacher = tmp / "teacher"
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned_dir), teacher=TEACHER, output=str(teacher),
                                           top_k=TOP_K, device=device))
    student = tmp / "student.json"
    student.write_text(json.dumps(CPU_STUDENT if quick else GPU_STUDENT))
    ctx = distributed.setup(device)
    try:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        config = train_config(aligned_dir, teacher, student, tmp / "run", batch_size=2 if quick else 16, device=device)
        # bf16 parameters as on a GPU, also in the CPU dry run: a float32 dry run once hid a bf16-only crash
        config = dataclasses.replace(config, student=dataclasses.replace(config.student, dtype="bfloat16"))
        steps = time_steps(config, ctx, 2 if quick else 8)
        peak = _peak_gib(ctx.device)
    finally:
        distributed.teardown()
    return {"student": "bench_train.CPU_STUDENT" if quick else "bench_train.GPU_STUDENT (~110M, bf16)",
            **steps, "csd_over_ce_step": steps["csd_step_s"] / steps["ce_step_s"], "peak_memory_gib": peak}


ROWS = (  # (label, section, key, format) of the results table (docs/results/gpu.md)
    ("teacher stage (bf16 forward, float32 log-softmax, top-32, encode, Parquet), positions/s", "teacher",
     "stage_positions_per_s", "{:,.0f}"),
    ("the same forward without the store, positions/s", "teacher", "forward_only_positions_per_s", "{:,.0f}"),
    ("stage time / forward time", "teacher", "stage_over_forward_time", "{:.2f}"),
    ("teacher stage peak GPU memory, GiB", "teacher", "peak_memory_gib", "{:.2f}"),
    ("float32 top-32 ids that the bf16 top-32 also holds", "bf16_vs_float32_teacher", "float32_topk_held_by_bf16",
     "{:.1%}"),
    ("largest absolute log-prob difference, ids in both top-32, nats", "bf16_vs_float32_teacher",
     "largest_logprob_error_shared_ids", "{:.2f}"),
    ("largest observed-token log-prob difference, nats", "bf16_vs_float32_teacher",
     "largest_observed_logprob_error", "{:.2f}"),
    ("CE step, ~110M Llama student, bf16, 16 rows of 256 tokens (median of 8), s", "train", "ce_step_s", "{:.3f}"),
    ("CSD step on the same micro-batches, s", "train", "csd_step_s", "{:.3f}"),
    ("CSD step / CE step", "train", "csd_over_ce_step", "{:.2f}"),
    ("training peak GPU memory, GiB", "train", "peak_memory_gib", "{:.2f}"),
)


def table(merged: dict) -> str:
    """One row per figure, one column per run of a results file (docs/results/gpu_check.json); "failed" where the
    run's section raised."""
    runs = merged["runs"]
    lines = ["| what | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " |", "|---|" + "---|" * len(runs)]
    for label, section, key, fmt in ROWS:
        cells = []
        for run in runs:
            value = run.get(section, {}).get(key)
            cells.append("failed" if "error" in run.get(section, {}) else "" if value is None else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure on the first CUDA device and print JSON; 0 also when there is none (nothing measured)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run-cpu", action="store_true", help="the same code on the CPU at toy sizes (tests)")
    parser.add_argument("--output", type=Path, default=ROOT / "bench-results" / "gpu_check.json")
    args = parser.parse_args(argv)
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing measured (run `make gpu-check` on a machine with one)")
        return 0
    device, quick = ("cpu", True) if args.dry_run_cpu else ("cuda", False)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        aligned = _align(tmp, 2 if quick else None)
        result = {"device": "cpu (dry run: no meaning)" if quick else torch.cuda.get_device_name(0),
                  "torch": torch.__version__,
                  "teacher": teacher_speed(aligned, device, tmp / "stage"),
                  "bf16_vs_float32_teacher": topk_error(aligned, device, 4 if quick else 256),
                  "train": train_speed(aligned, device, tmp, quick)}
    result["seconds"] = time.perf_counter() - started
    text = json.dumps(result, indent=2)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
