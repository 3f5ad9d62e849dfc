"""The measured rates behind docs/SCALE.md, and the projections they give for 1B / 10B / 100B tokens.

Measured here, on one CPU thread unless said:

- align: `tests/data/devil-slice.txt` + `tests/data/python-docs-slice.txt` aligned (text mode) with
  llama-spm as the student and smollm2 as the teacher, 2048-token windows, one worker, tokenizers
  loaded and tables built beforehand (their one-time cost is not per token): aligned shard bytes per
  student token and teacher tokens per student token (from the manifest), and student tokens per
  CPU-second of the stage (process CPU time, Parquet writing included);
- the teacher store's codec: SmolLM2-135M-Instruct's top-128 on the first 4,000 tokens of
  `python-docs-slice.txt` (one float32 forward), then `encode_block` / `decode_block` of the same
  positions as one block, per setting (fixed top-128 and top-32, --top-p 0.99 / 0.90 with
  --top-k 128): positions per CPU-second each way and the payload bytes per position.

Projections (`--tokens`, default 1e9 1e10 1e11 student tokens): bytes on disk, align CPU hours,
encode CPU hours, decode CPU hours, and the teacher forward's GPU hours for 1B / 8B / 70B teachers
from 2 x parameters x teacher tokens at ASSUMED_TFLOPS (an assumption, not a measurement), and the
trainer's read bandwidth per GPU. Teacher bytes per position come from `bench/bench_teacher_store.py`
(`--teacher-bytes`, default its all-kinds result). Prints JSON.

    python bench/scale_sheet.py [--json FILE]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DATA = ROOT / "tests" / "data"
ASSUMED_TFLOPS = 400.0  # bf16 forward per GPU: about 40% of an H100's dense peak; an assumption
TEACHERS = {"1B": 1.24e9, "8B": 8.03e9, "70B": 70.6e9}  # parameters (Llama 3.2 1B, 3.1 8B, 3.1 70B)
# Bytes per teacher position of the store, SmolLM2-135M-Instruct on bench/corpus/kinds.jsonl
# (python bench/bench_teacher_store.py, all kinds, shard files).
TEACHER_BYTES = {"top-128": 237.87, "top-32": 60.37, "p0.99": 185.37, "p0.90": 101.58}
SETTINGS = {"top-128": (128, None), "top-32": (32, None), "p0.99": (128, 0.99), "p0.90": (128, 0.90)}
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


def measure_codec() -> dict:
    """Encode / decode positions per CPU-second and payload bytes per position, per setting."""
    import numpy as np
    import torch

    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.codec import decode_block, encode_block
    from csd_pipeline.teacher.runner import TeacherRunner, mass_lengths
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    torch.set_num_threads(1)
    bundle = load_tokenizer(str(model_path("smollm2-135m-instruct")))
    text = (DATA / "python-docs-slice.txt").read_text(encoding="utf-8")
    ids = bundle.encode_spans([text[:20000]])[0].ids[:3999]
    rows = [np.concatenate([[bundle.vocab.context_token()], ids]).astype(np.int64)[i:i + 1000] for i in range(0, 4000, 1000)]
    runner = TeacherRunner(load_causal_lm(str(model_path("smollm2-135m-instruct")), device="cpu"), top_k=128,
                           vocab_limit=bundle.vocab.size, batch_tokens=8192)
    results = runner.run(rows)
    top_ids = np.concatenate([r.ids for r in results])
    top_lp = np.concatenate([r.logprobs for r in results])
    observed = np.concatenate([r.observed for r in results])
    observed_ids = np.concatenate([np.append(row[1:], -1) for row in rows])
    out = {"positions": len(top_ids)}
    for name, (k, top_p) in SETTINGS.items():
        lengths = None if top_p is None else mass_lengths(top_lp[:, :k], top_p)
        began = time.process_time()
        payload = encode_block(top_ids[:, :k], top_lp[:, :k], observed_ids, observed, lengths)
        encode = time.process_time() - began
        began = time.process_time()
        decode_block(payload, observed_ids >= 0)
        decode = time.process_time() - began
        out[name] = {"payload_bytes_per_position": len(payload) / len(top_ids),
                     "encode_positions_per_cpu_second": len(top_ids) / encode,
                     "decode_positions_per_cpu_second": len(top_ids) / decode}
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
    codec = measure_codec()
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
