"""The measured rates behind docs/SCALE.md, and the projections they give for 1B / 10B / 100B tokens.

Measured here, on one CPU thread unless said:

- align: `tests/data/devil-slice.txt` + `tests/data/python-docs-slice.txt` aligned (text mode) with
  llama-spm as the student and smollm2 as the teacher, 2048-token windows, one worker, tokenizers
  loaded and tables built beforehand (their one-time cost is not per token): aligned shard bytes per
  student token and teacher tokens per student token (from the manifest), and student tokens per
  CPU-second of the stage (process CPU time, Parquet writing included);
- the teacher store's codec: SmolLM2-135M-Instruct's top-128 on the first aligned python-docs
  windows (at least 4,000 teacher positions; one float32 forward), then `encode_block` /
  `decode_block` of the same positions as one block, per setting (fixed top-128 and top-32,
  --top-p 0.99 / 0.90 with --top-k 128, and --keep csd-events of the top-128 alone and with
  --min-p 0.0035, and with --min-p 0.02 --tail-samples 48: the entries `teacher-logits` would store
  for those windows; the draws need a forward of their own): positions per CPU-second each way, the
  payload bytes and entries per position, and the CPU time the draws add to the forward.

Projections (`--tokens`, default 1e9 1e10 1e11 student tokens): bytes on disk, align CPU hours,
encode CPU hours, decode CPU hours, and the teacher forward's GPU hours for 1B / 8B / 70B teachers
from 2 x parameters x teacher tokens at ASSUMED_TFLOPS (an assumption, not a measurement), and the
trainer's read bandwidth per GPU. Teacher bytes per position come from `bench/bench_teacher_store.py`
(`--teacher-bytes`, default its all-kinds result). Prints JSON.

    python -m bench.scale_sheet [--json FILE]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from bench.experiments.plan import store_settings

ROOT = Path(__file__).resolve().parent.parent

DATA = ROOT / "tests" / "data"
ASSUMED_TFLOPS = 400.0  # bf16 forward per GPU: about 40% of an H100's dense peak; an assumption
TEACHERS = {"1B": 1.24e9, "8B": 8.03e9, "70B": 70.6e9}  # parameters (Llama 3.2 1B, 3.1 8B, 3.1 70B)
# Bytes per teacher position of the store, SmolLM2-135M-Instruct on bench/corpus/kinds.jsonl
# (python -m bench.bench_teacher_store, all kinds, shard files).
TEACHER_BYTES = {"top-128": 237.87, "top-32": 60.37, "p0.99": 185.37, "p0.90": 101.58, "events128": 168.5,
                 "events-min0.0035": 72.46, "events-min0.02-s48": 72.96}
# The settings: stores by name (bench.experiments.plan.store_settings), those TEACHER_BYTES has a figure for.
SETTINGS = {name: store_settings(name) for name in TEACHER_BYTES}
STEP = {"tokens_per_gpu": 8 * 4096, "seconds": 1.0}  # the trainer example: 8 windows of 4096 per GPU per second


def measure_align(tmp: Path) -> dict:
    """Aligned bytes per student token, teacher tokens per student token, student tokens per CPU-second."""
    import os

    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.shard_writer import AlignTokenizers
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.vocab.tables import build_table

    config = AlignConfig(corpus=[str(DATA / "devil-slice.txt"), str(DATA / "python-docs-slice.txt")],
                         student_tokenizer="llama-spm", teacher_tokenizers=["smollm2"], output=str(tmp / "aligned"),
                         max_student_tokens=2048)
    tokenizers = AlignTokenizers.load(config)
    s2t, t2s = tmp / "s2t.safetensors", tmp / "t2s.safetensors"
    build_table(tokenizers.student, tokenizers.teachers[0]).save(s2t)
    build_table(tokenizers.teachers[0], tokenizers.student).save(t2s)
    config.tables = [(str(s2t), str(t2s))]
    before = os.times()
    wall = time.perf_counter()
    run_align(config, rank=0, world_size=1, workers=1, tokenizers=tokenizers)
    after = os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    manifest = json.loads((tmp / "aligned" / "manifest.json").read_text())
    stats = manifest["totals"]["stats"]
    student, teacher = stats["tokens"]["student"], stats["tokens"]["teacher0"]
    shard_bytes = sum(s["bytes"] for s in manifest["shards"])
    return {"student_tokens": student, "teacher_tokens": teacher, "shard_bytes": shard_bytes,
            "aligned_bytes_per_student_token": shard_bytes / student, "teacher_tokens_per_student_token": teacher / student,
            "align_cpu_seconds": cpu, "align_wall_seconds": time.perf_counter() - wall,
            "student_tokens_per_cpu_second": student / cpu}


def measure_codec(aligned_dir: Path, positions: int = 4000) -> dict:
    """Encode / decode positions per CPU-second and payload bytes per position, per setting: the
    teacher's top-128 on the first `positions` teacher positions of the aligned python-docs windows,
    each setting's entries chosen as `teacher-logits` chooses them (the event selection included)."""
    import numpy as np
    import torch

    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner
    from csd_pipeline.teacher.store.codec import decode_block
    from csd_pipeline.teacher.store.selectors import chain_from_config
    from csd_pipeline.teacher.store.writer import encode_rows
    from schemas.aligned import teacher_columns

    torch.set_num_threads(1)
    aligned = AlignedOutput.open(aligned_dir)
    columns = aligned.training_columns([0])
    aligned_rows = [row for shard in aligned.shards for row in aligned.read(shard, columns).to_pylist()
                    if "python-docs-slice" in row["row_id"].rsplit(":", 2)[0]]
    rows, count = [], 0
    while count < positions:
        rows.append(np.asarray(aligned_rows[len(rows)][teacher_columns(0)[0]], dtype=np.int64))
        count += len(rows[-1])
    aligned_rows = aligned_rows[:len(rows)]
    loaded = load_causal_lm(str(model_path("smollm2-135m-instruct")), device="cpu")
    runner = TeacherRunner(loaded, top_k=128, vocab_limit=aligned.teacher_tokenizer(0).size, batch_tokens=8192)
    began = time.process_time()
    results = runner.run(rows)
    forward = time.process_time() - began
    observed_ids = np.concatenate([np.append(row[1:], -1) for row in rows])
    out = {"positions": count}
    for name, store in SETTINGS.items():
        # the setting's selectors, as teacher-logits builds them from its options
        chain, k, samples = chain_from_config(store, aligned), store["top_k"], store.get("tail_samples")
        drawn, draw_seconds = results, 0.0
        if samples:  # the draws come with the forward: a runner of their own
            tail_runner = TeacherRunner(loaded, top_k=k, vocab_limit=runner.vocab_limit, batch_tokens=8192,
                                        selectors=chain.position_selectors())
            tail_runner.seed(0)
            began = time.process_time()
            drawn = tail_runner.run(rows)
            draw_seconds = max(time.process_time() - began - forward, 0.0) / count
        else:  # the top-128 computed once, through the setting's selectors as the forward applies them
            drawn = [chain.cut_row(result, row) for result, row in zip(results, rows)]
        select = chain.row_cut(aligned_rows)
        chosen = drawn if select is None else [select(index, row) for index, row in enumerate(drawn)]
        lengths = np.concatenate([r.lengths for r in chosen])
        began = time.process_time()
        payload, _ = encode_rows(chosen, rows, chain.width)  # the store writer's encoding of one block
        encode = time.process_time() - began
        began = time.process_time()
        decode_block(payload, observed_ids >= 0)
        decode = time.process_time() - began
        out[name] = {"payload_bytes_per_position": len(payload) / count, "entries_per_position": lengths.mean(),
                     "encode_positions_per_cpu_second": count / encode,
                     "decode_positions_per_cpu_second": count / decode,
                     **({"draw_cpu_seconds_per_position": draw_seconds} if samples else {})}
    return out


def project(align: dict, codec: dict, tokens: list[float], teacher_bytes: dict) -> dict:
    """Bytes, CPU and GPU hours and read bandwidth for each number of student tokens."""
    ratio = align["teacher_tokens_per_student_token"]
    sheet = {}
    for n in tokens:
        teacher_positions = n * ratio
        row = {"aligned_bytes": n * align["aligned_bytes_per_student_token"],
               "align_cpu_hours": n / align["student_tokens_per_cpu_second"] / 3600,
               "teacher_positions": teacher_positions}
        for name, per_position in teacher_bytes.items():
            row[f"teacher_bytes_{name}"] = teacher_positions * per_position
            row[f"encode_cpu_hours_{name}"] = teacher_positions / codec[name]["encode_positions_per_cpu_second"] / 3600
            row[f"decode_cpu_hours_{name}"] = teacher_positions / codec[name]["decode_positions_per_cpu_second"] / 3600
        for teacher, params in TEACHERS.items():
            row[f"teacher_gpu_hours_{teacher}_estimate"] = 2 * params * teacher_positions / (ASSUMED_TFLOPS * 1e12) / 3600
        sheet[f"{n:.0e}"] = row
    per_second = STEP["tokens_per_gpu"] / STEP["seconds"]
    bandwidth = {"student_tokens_per_gpu_second": per_second,
                 "aligned_bytes_per_gpu_second": per_second * align["aligned_bytes_per_student_token"]}
    for name, per_position in teacher_bytes.items():
        bandwidth[f"teacher_bytes_per_gpu_second_{name}"] = per_second * ratio * per_position
        bandwidth[f"decode_cores_per_gpu_{name}"] = per_second * ratio / codec[name]["decode_positions_per_cpu_second"]
    return {"projections": sheet, "read_per_gpu": bandwidth}


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="scale-sheet-") as tmp:
        align = measure_align(Path(tmp))
        codec = measure_codec(Path(tmp) / "aligned")
    result = {"align": align, "codec": codec, "teacher_bytes_per_position": TEACHER_BYTES,
              "assumed_gpu_tflops": ASSUMED_TFLOPS, "step": STEP,
              **project(align, codec, [1e9, 1e10, 1e11], TEACHER_BYTES)}
    text = json.dumps(result, indent=2, sort_keys=True)
    if "--json" in argv:
        target = Path(argv[argv.index("--json") + 1])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
