"""Speed and size of `csd-pipeline teacher-logits` with the real SmolLM2-135M-Instruct teacher,
and its memory and bytes per position with the Gemma 3 270M teacher (262k vocabulary, `run_262k`).

Corpus: six kinds of real text (Bible, Python docs, stdlib code, the Jargon File, a novel, Django
translations), 16,000 characters each (2,000 in quick mode): by default the committed
`bench/corpus/kinds.jsonl`; with `--corpus DIR`, the same slices read from a folder holding the full
files (kjv.txt, python-docs.txt, cpython-stdlib-code.jsonl, jargon.txt, botchan.txt,
django-po-multilingual.jsonl). Aligned by the real align stage (gpt-2 student, SmolLM2 teacher,
1024-token windows); one source per shard, so the bytes per position are also reported per kind of text.

Measured in one process, shard by shard:
- B, the stage on that shard: read the aligned shard, batch, forward, float32 log-softmax and
  top-k, encode, write the Parquet file (wall time);
- F, inside B: the time of the teacher's forward itself (decoder, then the float32 output layer on
  the real positions), clocked around those calls from here (`ForwardClock`: hooks on the decoder,
  a wrapper around the runner's output layer). overhead = (B - F) / B must be
  <= 10%. Both sides are measured in the same seconds of the same run, so a busy shared machine
  cannot favour one of them;
- for reference, separate forward-only passes over exactly the stage's batches, alternating the
  order per shard: the runner's own forward path (decoder + float32 head on real positions), and
  the model's plain `model(input_ids, attention_mask).logits` (which also computes padded positions).
  On a busy machine these separate passes drift by more than the overhead itself.
Also: positions/s of the stage, bytes per position (the shard files, and the encoded payloads
alone, per kind of text), peak RSS while the stage runs, and the decoding error of every stored
log-prob against a plain float32 forward of each row alone (first shard).

`run_gpu()` measures bf16 throughput on CUDA with a larger random-initialised Llama; it needs a GPU.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CORPUS_HELP = "folder holding kjv.txt, python-docs.txt, ... (default: the committed bench/corpus/kinds.jsonl)"
KINDS = ROOT / "bench" / "corpus" / "kinds.jsonl"
TEACHER = "smollm2-135m-instruct"
LIMIT_OVERHEAD = 0.10
LIMIT_BYTES = 64.0
LIMIT_ERROR = 0.01
WINDOW = 1024
TOP_K = 32
BATCH_TOKENS = 8192


def corpus_sources(quick: bool, corpus: Path | None) -> dict[str, str]:
    """kind -> real text (16,000 characters each, 2,000 in quick mode): `bench/corpus/kinds.jsonl`, or
    the same slices of the full files in `corpus`."""
    size = 2_000 if quick else 16_000
    if corpus is None:
        lines = KINDS.read_text(encoding="utf-8").splitlines()
        return {record["kind"]: record["text"][:size] for record in map(json.loads, lines)}
    corpus = Path(corpus)

    def text(name, offset):
        raw = (corpus / name).read_text(encoding="utf-8")
        return raw[offset:offset + size]

    def jsonl(name, start, count):
        lines = (corpus / name).read_text(encoding="utf-8").splitlines()[start:start + count]
        return "\n".join(json.loads(line)["text"] for line in lines)[:size]

    return {
        "bible": text("kjv.txt", 1_000_000),
        "python-docs": text("python-docs.txt", 3_000_000),
        "stdlib-code": jsonl("cpython-stdlib-code.jsonl", 50, 3),
        "jargon": text("jargon.txt", 600_000),
        "novel": text("botchan.txt", 50_000),
        "translations": "\n".join(json.loads(line)["text"] for line in
                                  (corpus / "django-po-multilingual.jsonl").read_text(encoding="utf-8").splitlines()[::37])[:size],
    }


def _align(tmp: Path, quick: bool, corpus_dir: Path | None) -> tuple[Path, dict[str, str]]:
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align

    corpus = tmp / "corpus"
    corpus.mkdir()
    sources = corpus_sources(quick, corpus_dir)
    files = []
    for index, (name, body) in enumerate(sources.items()):
        path = corpus / f"{index}-{name}.txt"
        path.write_text(body, encoding="utf-8")
        files.append(str(path))
    out = tmp / "aligned"
    # shard_bytes=1: every document (one per source) closes its own shard.
    run_align(AlignConfig(corpus=files, student_tokenizer="gpt-2", teacher_tokenizers=["smollm2"], output=str(out),
                          max_student_tokens=WINDOW, max_teacher_tokens=[WINDOW], shard_bytes=1), rank=0, world_size=1)
    return out, {Path(f).stem: f for f in files}


def _shard_rows(aligned, shard):
    """(teacher 0's ids of every row, row ids) of one aligned shard (`AlignedOutput`, `AlignedShard`)."""
    row_ids, rows = aligned.teacher_rows(shard, 0)
    return rows, row_ids


def forward_only(runner, rows, *, own_path: bool = False) -> None:
    """Only the teacher's forward on a padded batch: the model's plain forward (`model(...).logits`),
    or with `own_path` the same computation the runner does (decoder, then the float32 output layer
    on the real positions, chunk by chunk) without log-softmax, top-k or copies."""
    import torch

    input_ids, mask = runner._batch_tensors(rows)
    with torch.inference_mode():
        if not own_path or runner._head is None:
            runner.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float()
            return
        width = input_ids.shape[1]
        flat = torch.cat([torch.arange(len(r), device=runner.device) + b * width for b, r in enumerate(rows)])
        states = runner._base(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        states = states.reshape(-1, states.shape[-1])[flat]
        for start in range(0, states.shape[0], runner.chunk):
            runner._head_logits(states[start:start + runner.chunk])


class ForwardClock:
    """Seconds the runner spends in the teacher's forward itself (decoder + output layer) while
    `active`: clocked around the decoder (module hooks) and the runner's output layer (a wrapper),
    so a benchmark can split the stage's time on a busy machine. On a GPU the clock waits for the
    device at each edge (slightly pessimistic)."""

    def __init__(self, runner):
        self.seconds = 0.0
        self.active = False
        self._began = 0.0
        self._device = runner.device
        body = runner._base if runner._head is not None else runner.model
        body.register_forward_pre_hook(lambda module, args: self._start())
        body.register_forward_hook(lambda module, args, output: self._stop())
        head = runner._head_logits

        def timed_head(hidden):
            self._start()
            logits = head(hidden)
            self._stop()
            return logits

        runner._head_logits = timed_head

    def _now(self) -> float:
        if self._device.type == "cuda":
            import torch

            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _start(self) -> None:
        if self.active:
            self._began = self._now()

    def _stop(self) -> None:
        if self.active:
            self.seconds += self._now() - self._began


def _forward_only(runner, rows, block_positions: int, own_path: bool) -> float:
    """Seconds of the teacher's forward alone on the batches the stage forms for these rows."""
    from csd_pipeline.teacher.runner import plan_batches
    from csd_pipeline.teacher.store.writer import block_ranges

    start_time = time.perf_counter()
    for start, end in block_ranges([len(r) for r in rows], block_positions):
        block = rows[start:end]
        for batch in plan_batches([len(r) for r in block], runner.batch_tokens):
            forward_only(runner, [block[i] for i in batch], own_path=own_path)
    return time.perf_counter() - start_time


class _PeakRss:
    """Samples this process's resident memory every 20 ms while active (`with sampler:`)."""

    def __init__(self):
        import threading

        self.peak = 0
        self._active = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize()

    def _sample(self):
        while not self._stop.wait(0.02):
            if self._active.is_set():
                self.peak = max(self.peak, self.rss())

    def __enter__(self):
        self.peak = max(self.peak, self.rss())
        self._active.set()

    def __exit__(self, *exc):
        self.peak = max(self.peak, self.rss())
        self._active.clear()

    def close(self):
        self._stop.set()
        self._thread.join()


def measure_shard(runner, clock: ForwardClock, aligned, shard, target: Path, *, reverse: bool, baselines,
                   sampler=None, sync=lambda: None) -> tuple[dict, object]:
    """Time the stage on one aligned shard (reading it included) and the forward-only baselines on its
    batches, in alternating order."""
    from contextlib import nullcontext

    from csd_pipeline.teacher.config import TeacherLogitsConfig
    from csd_pipeline.teacher.shard_writer import write_teacher_shard

    block_positions = TeacherLogitsConfig.block_positions
    rows, _ = _shard_rows(aligned, shard)
    result = None

    def stage():
        nonlocal result
        clock.active = True
        with sampler if sampler is not None else nullcontext():
            row_ids, shard_rows = aligned.teacher_rows(shard, 0)
            result = write_teacher_shard(runner, runner.chain, row_ids, shard_rows, target, block_positions)
        clock.active = False

    steps = {name: (lambda own=(name == "own_forward"): _forward_only(runner, rows, block_positions, own_path=own))
             for name in baselines}
    steps["stage"] = stage
    times = {}
    for name in (reversed(list(steps)) if reverse else list(steps)):  # cancel drift on a busy machine
        sync()
        began = time.perf_counter()
        steps[name]()
        sync()
        times[name] = time.perf_counter() - began
    return times, result


def _decode_error(runner, shard_file: Path, rows) -> dict:
    """Max |stored - float32 forward of the row alone| over stored log-probs > -20 and observed ones."""
    import numpy as np
    import torch

    from csd_pipeline.teacher.store.reader import TeacherShard

    worst_top, worst_observed, values = 0.0, 0.0, 0
    for stored, ids in zip(TeacherShard(shard_file), rows):
        with torch.inference_mode():
            logprobs = torch.log_softmax(runner.model(torch.tensor(ids[None, :])).logits[0].float(), dim=-1).numpy()
        reference = np.take_along_axis(logprobs, stored.ids.astype(np.int64), axis=1)
        keep = reference > -20
        worst_top = max(worst_top, float(np.abs(stored.logprobs - reference)[keep].max()))
        observed = logprobs[np.arange(len(ids) - 1), ids[1:]]
        worst_observed = max(worst_observed, float(np.abs(stored.observed_logprob[:-1] - observed).max()))
        values += int(keep.sum())
    return {"top": worst_top, "observed": worst_observed, "values": values}


def run(quick: bool = False, corpus: Path | None = None) -> dict:
    """Benchmark the stage on CPU; returns {"name", "metrics", "checks"}."""
    import torch

    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner

    with tempfile.TemporaryDirectory(prefix="bench-teacher-") as tmp_name:
        tmp = Path(tmp_name)
        aligned_dir, _ = _align(tmp, quick, corpus)
        aligned = AlignedOutput.open(aligned_dir)
        started = time.perf_counter()
        loaded = load_causal_lm(str(model_path(TEACHER)), device="cpu")
        load_seconds = time.perf_counter() - started
        runner = TeacherRunner(loaded, top_k=TOP_K, vocab_limit=49152, batch_tokens=BATCH_TOKENS)
        clock = ForwardClock(runner)
        out = tmp / "teacher"
        out.mkdir()
        totals = {"model_forward": 0.0, "own_forward": 0.0, "stage": 0.0}
        per_source, positions_total, file_bytes, payload_bytes = {}, 0, 0, 0
        sampler = _PeakRss()
        baseline_rss = _PeakRss.rss()
        for index, shard in enumerate(aligned.shards):
            target = out / shard.file
            times, result = measure_shard(runner, clock, aligned, shard, target, reverse=index % 2 == 1,
                                           baselines=("model_forward", "own_forward"), sampler=sampler)
            for name, seconds in times.items():
                totals[name] += seconds
            positions = result.stats["positions"]
            positions_total += positions
            file_bytes += target.stat().st_size
            payload_bytes += result.stats["payload_bytes"]
            per_source[f"bytes_per_position[{index}]"] = round(target.stat().st_size / positions, 2)
            per_source[f"positions[{index}]"] = positions
        sampler.close()
        first = aligned.shards[0]
        error = _decode_error(runner, out / first.file, _shard_rows(aligned, first)[0])
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    stage_total = totals["stage"]
    inside = clock.seconds  # decoder + output layer, timed inside the stage runs
    overhead = (stage_total - inside) / stage_total
    overhead_vs_own = (stage_total - totals["own_forward"]) / stage_total
    overhead_vs_model = (stage_total - totals["model_forward"]) / stage_total
    bytes_per_position = file_bytes / positions_total
    bytes_limit = LIMIT_BYTES if not quick else 80.0  # quick: ~600 positions per shard, LZMA starts cold
    metrics = {
        "positions": positions_total,
        "stage_seconds": round(stage_total, 2),
        "own_forward_seconds": round(totals["own_forward"], 2),
        "model_forward_seconds": round(totals["model_forward"], 2),
        "positions_per_second": round(positions_total / stage_total, 1),
        "forward_positions_per_second": round(positions_total / totals["own_forward"], 1),
        "forward_seconds_inside_stage": round(inside, 2),
        "overhead_fraction_inside_stage": round(overhead, 4),
        "overhead_fraction_vs_own_forward": round(overhead_vs_own, 4),
        "overhead_fraction_vs_model_forward": round(overhead_vs_model, 4),
        "bytes_per_position_files": round(bytes_per_position, 2),
        "bytes_per_position_payload": round(payload_bytes / positions_total, 2),
        "max_error_top_k_above_-20": round(error["top"], 5),
        "max_error_observed": round(error["observed"], 5),
        "checked_values": error["values"],
        "peak_rss_mb_stage": round(sampler.peak / 2**20, 1),
        "rss_mb_model_loaded": round(baseline_rss / 2**20, 1),
        "peak_rss_mb_process": round(peak_mb, 1),
        "teacher_load_seconds": round(load_seconds, 2),
        "torch_threads": torch.get_num_threads(),
        "logits_path": runner.path,
        **per_source,
    }
    checks = {
        "overhead_beyond_forward_fraction": {"value": overhead, "limit": LIMIT_OVERHEAD, "ok": overhead <= LIMIT_OVERHEAD},
        "bytes_per_position" + ("_quick" if quick else ""): {
            "value": bytes_per_position, "limit": bytes_limit, "ok": bytes_per_position <= bytes_limit},
        "max_abs_error_nats": {"value": max(error["top"], error["observed"]), "limit": LIMIT_ERROR,
                               "ok": max(error["top"], error["observed"]) <= LIMIT_ERROR},
    }
    large = run_262k(quick)   # the same stage at a 262k vocabulary, through the CLI
    return {"name": "teacher", "metrics": {**metrics, **large["metrics"]}, "checks": {**checks, **large["checks"]}}


def _cli(args: list[str]) -> dict:
    """Run `csd-pipeline ARGS` as a user does (its own process): wall and CPU seconds, peak RSS."""
    import os
    import subprocess

    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"csd-pipeline {' '.join(args)} failed: {process.stderr.read().decode()}")
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}


def run_262k(quick: bool = False) -> dict:
    """`teacher-logits` with the Gemma 3 270M teacher (262,144 ids) through the CLI, at k=32 and k=128.

    Corpus: tests/data/devil-slice.txt (6,000 characters), aligned by `csd-pipeline align` (student
    llama-spm, teacher gemma3). Reports the peak RSS of each run against the largest logits block
    the runner holds (a chunk of positions x the whole vocabulary, float32) and against what one
    batch of logits would take unchunked, and the bytes per position of the shard files. Quick: k=32 only.
    """
    from csd_pipeline.fixtures.names import model_path
    from csd_pipeline.teacher.runner import LOGIT_CHUNK_ELEMENTS

    vocab, batch_tokens = 262_144, BATCH_TOKENS
    chunk_positions = max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    metrics = {
        "gemma3_logits_chunk_positions": chunk_positions,
        "gemma3_logits_chunk_mb": chunk_positions * vocab * 4 / 2**20,
        "gemma3_whole_batch_logits_mb": batch_tokens * vocab * 4 / 2**20,
        "gemma3_weights_mb": round((model_path("gemma3-270m") / "model.safetensors").stat().st_size / 2**20, 1),
    }
    checks = {}
    with tempfile.TemporaryDirectory(prefix="bench-teacher-262k-") as tmp_name:
        aligned = Path(tmp_name) / "aligned"
        _cli(["align", "--corpus", str(ROOT / "tests" / "data" / "devil-slice.txt"), "--student-tokenizer", "llama-spm",
              "--teacher-tokenizer", "gemma3", "--output", str(aligned), "--quiet"])
        for top_k in (32,) if quick else (32, 128):
            out = Path(tmp_name) / f"topk-{top_k}"
            timing = _cli(["teacher-logits", "--aligned", str(aligned), "--teacher", "gemma3-270m", "--output", str(out),
                           "--top-k", str(top_k), "--batch-tokens", str(batch_tokens), "--quiet"])
            totals = json.loads((out / "manifest.json").read_text(encoding="utf-8"))["totals"]
            positions = totals["stats"]["positions"]
            metrics.update({
                f"gemma3_k{top_k}_positions": positions,
                f"gemma3_k{top_k}_bytes_per_position_files": round(totals["bytes"] / positions, 2),
                f"gemma3_k{top_k}_bytes_per_position_payload": round(totals["stats"]["payload_bytes"] / positions, 2),
                f"gemma3_k{top_k}_seconds": round(timing["seconds"], 1),
                f"gemma3_k{top_k}_cpu_seconds": round(timing["cpu_seconds"], 1),
                f"gemma3_k{top_k}_peak_rss_mb": round(timing["peak_rss_mb"], 1),
            })
            # Bounded by the chunked output layer: far below one unchunked batch of 262k-wide logits.
            ratio = timing["peak_rss_mb"] / metrics["gemma3_whole_batch_logits_mb"]
            checks[f"gemma3_k{top_k}_peak_rss_vs_whole_batch_logits"] = {"value": ratio, "limit": 0.5, "ok": ratio <= 0.5}
    return {"name": "teacher_262k", "metrics": metrics, "checks": checks}


def run_gpu(hidden: int = 2048, layers: int = 16, positions: int = 200_000, vocab_tokenizer: str = "llama-bpe",
            corpus: Path | None = None) -> dict:
    """bf16 throughput on CUDA with a random-initialised Llama (about 1B parameters by default).

    Aligns real text for the `vocab_tokenizer` teacher (Llama 3, 128,256 ids), saves the random
    teacher with that tokenizer, then times forward-only vs the stage per shard as `run` does.
    Needs a CUDA device (raises RuntimeError without one).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.runtime.model_loading import load_causal_lm
    from csd_pipeline.teacher.runner import TeacherRunner
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    if not torch.cuda.is_available():
        raise RuntimeError("run_gpu needs a CUDA device")
    with tempfile.TemporaryDirectory(prefix="bench-teacher-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        corpus_file = tmp / "corpus.txt"
        sources = corpus_sources(False, corpus)
        text = "\n\n".join(sources.values())
        corpus_file.write_text(text * max(1, positions // max(1, len(text) // 4)), encoding="utf-8")
        aligned = tmp / "aligned"
        run_align(AlignConfig(corpus=[str(corpus_file)], student_tokenizer="gpt-2", teacher_tokenizers=[vocab_tokenizer],
                              output=str(aligned), max_student_tokens=4096, max_teacher_tokens=[4096],
                              split_on_blank_lines=True, shard_bytes=4 << 20), rank=0, world_size=1)
        vocab = load_tokenizer(str(tokenizer_path(vocab_tokenizer))).vocab.size
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512),
                             max_position_embeddings=8192, tie_word_embeddings=False)
        model_dir = tmp / "teacher-model"
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(model_dir))
        loaded = load_causal_lm(str(model_dir), device="cuda")  # bf16 by default on GPU
        runner = TeacherRunner(loaded, top_k=TOP_K, vocab_limit=vocab, batch_tokens=65536)
        clock = ForwardClock(runner)  # synchronises the GPU around the forward: slightly pessimistic
        aligned_output = AlignedOutput.open(aligned)
        out = tmp / "teacher"
        out.mkdir()
        forward_total = stage_total = 0.0
        positions_total = 0
        for index, shard in enumerate(aligned_output.shards):
            times, result = measure_shard(runner, clock, aligned_output, shard, out / shard.file, reverse=index % 2 == 1,
                                           baselines=("own_forward",), sync=torch.cuda.synchronize)
            forward_total += times["own_forward"]
            stage_total += times["stage"]
            positions_total += result.stats["positions"]
        peak_gpu = torch.cuda.max_memory_allocated() / 2**30
    return {
        "name": "teacher_gpu",
        "metrics": {
            "parameters_millions": round(sum(p.numel() for p in loaded.model.parameters()) / 1e6, 1),
            "positions": positions_total,
            "positions_per_second": round(positions_total / stage_total, 1),
            "forward_positions_per_second": round(positions_total / forward_total, 1),
            "overhead_fraction_vs_own_forward": round((stage_total - forward_total) / stage_total, 4),
            "overhead_fraction_inside_stage": round((stage_total - clock.seconds) / stage_total, 4),
            "peak_gpu_gib": round(peak_gpu, 2),
            "logits_path": runner.path,
        },
        "checks": {},
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs: a smoke run")
    parser.add_argument("--gpu", action="store_true", help="bf16 throughput on CUDA (run_gpu)")
    parser.add_argument("--262k", dest="gemma", action="store_true", help="only the Gemma 3 (262k vocabulary) teacher")
    parser.add_argument("--corpus", type=Path, default=None, help=CORPUS_HELP)
    args = parser.parse_args()
    if args.gpu:
        result = run_gpu(corpus=args.corpus)
    elif args.gemma:
        result = run_262k(quick=args.quick)
    else:
        result = run(quick=args.quick, corpus=args.corpus)
    print(json.dumps(result, indent=2, sort_keys=True))
