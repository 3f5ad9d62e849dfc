"""Speed of `csd-train`: the CSD step against a CE-only step, and the data pipeline.

Data: the first 24 KiB (quick: 8 KiB) of botchan.txt in the folder given by `--corpus DIR`, or by
default the committed slice tests/data/botchan-slice.txt (6,000 characters); aligned (llama-spm student, smollm2 teacher, windows
of at most 256 student tokens) and scored by the real SmolLM2-135M-Instruct teacher (top-32). This
set-up is not timed.

Measured in one process, one rank (FSDP2 over a one-rank gloo group, as `csd-train` runs alone):
- a CSD optimizer step and a CE-only step on the *same* prefetched micro-batches and the same model
  (a 4-layer, 256-wide Llama with the 32k llama-spm vocabulary on CPU), interleaved so that the
  shared machine's noise hits both alike; check: median CSD step <= 1.2x median CE step;
- the data pipeline alone (reading Parquet, decoding teacher top-k, packing, building events) with
  2 worker processes, time per micro-batch after the first; check: it delivers >= 3x faster than
  the CSD step consumes;
- tokens/s of the CSD step on CPU.
With CUDA (not available in this project's sessions) the same code also times a ~110M-parameter
student in bf16 on the GPU and reports its tokens/s.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORPUS_FILE = "botchan.txt"
SLICE = ROOT / "tests" / "data" / "botchan-slice.txt"
LIMIT_CSD_OVER_CE = 1.2
LIMIT_DATA_OVER_STEP = 3.0
SEQ_LEN = 256
CPU_STUDENT = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
               "max_position_embeddings": 1024, "tie_word_embeddings": True}
GPU_STUDENT = dict(CPU_STUDENT, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                   num_attention_heads=12, num_key_value_heads=12)  # ~110M parameters


def _prepare(tmp: Path, quick: bool, corpus_dir: Path | None) -> tuple[Path, Path, str]:
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    size = (8 if quick else 24) << 10
    if corpus_dir is None:
        text, source = SLICE.read_text(encoding="utf-8"), "tests/data/botchan-slice.txt (the committed slice)"
    else:
        full = Path(corpus_dir) / CORPUS_FILE
        if not full.is_file():
            raise FileNotFoundError(f"{full} not found: --corpus must be a folder holding {CORPUS_FILE}")
        text, source = full.read_text(encoding="utf-8")[:size], f"botchan.txt (first {size >> 10} KiB)"
    corpus = tmp / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    aligned, teacher = tmp / "aligned", tmp / "teacher"
    run_align(AlignConfig(corpus=[str(corpus)], student_tokenizer="llama-spm", teacher_tokenizers=["smollm2"],
                          output=str(aligned), max_student_tokens=SEQ_LEN, split_on_blank_lines=True,
                          shard_bytes=8 << 10))
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher="smollm2-135m-instruct",
                                           output=str(teacher), top_k=32, device="cpu"))
    return aligned, teacher, source


def train_config(aligned: Path, teacher: Path, student: Path, output: Path, batch_size: int, device: str):
    from trainer.options import parse_args

    return parse_args(["--aligned", str(aligned), "--teacher-logits", str(teacher), "--student-config", str(student),
                       "--student-tokenizer", "llama-spm", "--output", str(output), "--seq-len", str(SEQ_LEN),
                       "--batch-size", str(batch_size), "--workers", "0", "--device", device, "--no-progress",
                       "--warmup-steps", "0"])


def time_steps(config, ctx, n_steps: int) -> dict:
    """Interleaved CE-only and CSD steps on the same micro-batches; median seconds of each."""
    import dataclasses

    import torch

    from trainer.loop import build_components, train_step

    data, wrapper, optimizer, scheduler = build_components(config, ctx)
    loader = data.loader(0, 1, None)
    batches = [next(loader) for _ in range(n_steps + 1)]
    loader.close()
    weights = data.teacher_weights
    times = {"ce": [], "csd": []}
    tokens = []
    for i, batch in enumerate(batches):
        ce_batch = dataclasses.replace(batch, teachers=[], shape_counts=[])
        for kind, micro, w in (("ce", ce_batch, []), ("csd", batch, weights)):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            record = train_step(wrapper, optimizer, scheduler, [micro], w, config, ctx)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first pair warms up
                times[kind].append(time.perf_counter() - start)
        if i:
            tokens.append(record["tokens"])
    ce, csd = statistics.median(times["ce"]), statistics.median(times["csd"])
    return {"ce_step_s": ce, "csd_step_s": csd, "tokens_per_step": statistics.mean(tokens),
            "chunks_per_step": sum(sum(c) for b in batches[1:] for c in b.shape_counts) / n_steps}


def _time_loader(config, workers: int, n_batches: int) -> float:
    """Seconds per micro-batch of the data pipeline alone, after the first batch (worker start-up)."""
    import dataclasses

    from trainer.data import TrainingData

    data = TrainingData.open(dataclasses.replace(config, data=dataclasses.replace(config.data, workers=workers)))
    loader = data.loader(0, 1, None)
    next(loader)
    start = time.perf_counter()
    for _ in range(n_batches):
        next(loader)
    elapsed = time.perf_counter() - start
    loader.close()
    return elapsed / n_batches


def run(quick: bool = False, corpus: Path | None = None) -> dict:
    """Run the benchmark; returns {"name", "metrics", "checks"}."""
    import torch

    from trainer import distributed

    n_steps = 3 if quick else 8
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp_name:
        tmp = Path(tmp_name)
        aligned, teacher, source = _prepare(tmp, quick, corpus)
        student = tmp / "student.json"
        student.write_text(json.dumps(CPU_STUDENT))
        ctx = distributed.setup("cpu")
        try:
            config = train_config(aligned, teacher, student, tmp / "out", batch_size=4, device="cpu")
            steps = time_steps(config, ctx, n_steps)
            loader_s = {w: _time_loader(config, w, 2 * n_steps) for w in (0, 2)}
            gpu = {}
            if torch.cuda.is_available():
                distributed.teardown()
                ctx = distributed.setup("cuda")
                student.write_text(json.dumps(GPU_STUDENT))
                gpu_config = train_config(aligned, teacher, student, tmp / "out-gpu", batch_size=16, device="cuda")
                gpu_steps = time_steps(gpu_config, ctx, n_steps)
                gpu = {"gpu_csd_tokens_per_s": gpu_steps["tokens_per_step"] / gpu_steps["csd_step_s"],
                       "gpu_csd_over_ce": gpu_steps["csd_step_s"] / gpu_steps["ce_step_s"],
                       "gpu_student_parameters_m": 110}
        finally:
            distributed.teardown()
    ratio = steps["csd_step_s"] / steps["ce_step_s"]
    supply = steps["csd_step_s"] / loader_s[2]
    metrics = {
        "corpus": source,
        "student": "llama 4x256, vocab 32000 (11.4M params), CPU float32, seq_len 256 x 4 rows",
        "ce_step_s": steps["ce_step_s"],
        "csd_step_s": steps["csd_step_s"],
        "csd_tokens_per_s_cpu": steps["tokens_per_step"] / steps["csd_step_s"],
        "ce_tokens_per_s_cpu": steps["tokens_per_step"] / steps["ce_step_s"],
        "accepted_chunks_per_step": steps["chunks_per_step"],
        "loader_s_per_batch_2_workers": loader_s[2],
        "loader_s_per_batch_in_process": loader_s[0],
        **gpu,
    }
    checks = {
        "csd_step_over_ce_step": {"value": ratio, "limit": LIMIT_CSD_OVER_CE, "ok": ratio <= LIMIT_CSD_OVER_CE},
        "data_supply_over_csd_step_2_workers": {"value": supply, "limit": LIMIT_DATA_OVER_STEP,
                                                "ok": supply >= LIMIT_DATA_OVER_STEP},
    }
    return {"name": "train", "metrics": metrics, "checks": checks}


if __name__ == "__main__":
    from bench.command_line import run_alone

    run_alone(run, __doc__, CORPUS_FILE, sys.argv[1:])
