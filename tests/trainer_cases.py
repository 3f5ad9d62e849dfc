"""Shared inputs of the trainer tests (tests/trainer/): small aligned directories of real
text (llama-spm student, smollm2 teacher) and a tiny student config. The `trainer_data` fixture in
conftest.py calls `make_trainer_data` once per session."""

from __future__ import annotations

import io
import json
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

DATA = Path(__file__).parent / "data"

STUDENT_CONFIG = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": True,
}


def align(corpus: list[Path], output: Path, max_student_tokens: int = 128, teachers: int = 1,
          shard_bytes: int = 2000, student_name: str = "llama-spm", teacher_name: str = "smollm2") -> Path:
    """Run the align stage (`student_name` student, `teachers` x `teacher_name` teacher; fixture tokenizers) into
    `output`, shards of about `shard_bytes` of text."""
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.fixtures.names import tokenizer_path
    from tests.csd_cases import bundle, cached_table_file

    student, teacher = bundle(tokenizer_path, student_name), bundle(tokenizer_path, teacher_name)
    tables = (cached_table_file(student, teacher), cached_table_file(teacher, student))  # built once, cached
    run_align(AlignConfig(corpus=[str(c) for c in corpus], student_tokenizer=student_name,
                          teacher_tokenizers=[teacher_name] * teachers, output=str(output),
                          max_student_tokens=max_student_tokens, tables=[tables] * teachers,
                          split_on_blank_lines=True, shard_bytes=shard_bytes))
    return output


def make_trainer_data(root: Path) -> dict:
    """{"train", "eval"}: aligned dirs of the botchan / devil slices (windows <= 128 student tokens);
    "train_short": the first 2500 characters of the botchan slice, aligned for two teachers with the
    same (smollm2) tokenizer; "student_config": a 2-layer, 64-wide Llama config JSON with the llama-spm vocabulary."""
    from csd_pipeline.fixtures.names import tokenizer_path

    tokenizer_path("llama-spm")  # fails with `make fixtures` advice when the cache is missing
    out = {"train": align([DATA / "botchan-slice.txt"], root / "train"),
           "eval": align([DATA / "devil-slice.txt"], root / "eval")}
    # a shorter text for the runs that need the real teacher's top-k (the teacher is the slow part)
    short = root / "botchan-short.txt"
    short.write_text((DATA / "botchan-slice.txt").read_text(encoding="utf-8")[:2500], encoding="utf-8")
    out["train_short"] = align([short], root / "train-short", teachers=2)
    out["student_config"] = root / "student.json"
    out["student_config"].write_text(json.dumps(STUDENT_CONFIG))
    return out


def make_teacher_topk(aligned: Path, output: Path, top_k: int = 8) -> Path:
    """Run the teacher-logits stage with the real SmolLM2-135M-Instruct teacher on `aligned`."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher="smollm2-135m-instruct", output=str(output),
                                           top_k=top_k, device="cpu"))
    return output


def kd_run_args(data: dict, teacher: Path, output: Path, *extra: str, steps: int = 3,
                student_tokenizer: str = "llama-spm") -> list[str]:
    """`csd-train` arguments for a short CSD/baseline run on `data["train_short"]` with the teacher top-k `teacher`."""
    return ["--aligned", str(data["train_short"]), "--teacher-logits", str(teacher), "--student-config",
            str(data["student_config"]), "--student-tokenizer", student_tokenizer, "--output", str(output), "--steps",
            str(steps), "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1",
            "--save-every", "0", "--workers", "0", "--no-progress", *extra]


def metrics(output: Path) -> list[dict]:
    """The rows of a run's `metrics.jsonl`."""
    with open(output / "metrics.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def direct_first_batch_loss(config, **loss_options):
    """(loss, batch): the run's first batch and its loss at the initial weights, from dense float64 logits
    without FSDP (the run's `--loss`, built with the `LossConfig` fields `loss_options` changed)."""
    from dataclasses import replace

    import torch

    from trainer.data import TrainingData
    from trainer.model import build_student

    data = TrainingData.open(config)
    loader = data.loader(0, 1, None)
    batch = next(loader)
    loader.close()
    model = build_student(config.student, config.seed, data.student_vocab.size)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(batch.input_ids), position_ids=torch.as_tensor(batch.position_ids),
                       use_cache=False).logits
    loss = replace(config.loss, **loss_options).build()
    return loss(ce_positions=batch.ce_positions, ce_tokens=batch.ce_tokens, teachers=batch.teachers,
                logits=logits.reshape(-1, logits.shape[-1]).double(),
                global_chunk_counts=[sum(batch.shape_counts[0])]), batch


def make_read_store(root: Path, chars: int = 24000, shard_bytes: int = 1000, top_k: int = 8) -> dict:
    """{"aligned", "topk"}: the first `chars` characters of the python-docs slice (paragraphs) aligned into
    shards of about `shard_bytes` of text, and their teacher top-k from a tiny random teacher (smollm2
    tokenizer), in blocks of 64 positions (one Parquet row group each). For counting the bytes a loader reads."""
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.teacher.test_stage import make_tiny_teacher

    corpus = root / "docs.txt"
    corpus.write_text((DATA / "python-docs-slice.txt").read_text(encoding="utf-8")[:chars], encoding="utf-8")
    aligned = align([corpus], root / "aligned", shard_bytes=shard_bytes)
    teacher = make_tiny_teacher(root / "tiny-teacher", tokenizer_path("smollm2"))
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(teacher), output=str(root / "topk"),
                                           top_k=top_k, device="cpu", block_positions=64, batch_tokens=512))
    return {"aligned": aligned, "topk": root / "topk"}


@contextmanager
def counted_file_reads():
    """Within it, a Counter of the bytes read from each file path by `Path.read_bytes` (the aligned
    shards) and by `pq.ParquetFile` opened on a path (the teacher top-k shards): real reads, counted."""
    import pyarrow.parquet as pq

    counts: Counter = Counter()
    read_bytes, parquet_file = Path.read_bytes, pq.ParquetFile

    class CountingFile(io.FileIO):
        def read(self, size=-1):
            data = super().read(size)
            counts[str(self.name)] += len(data)
            return data

        def readinto(self, buffer):
            count = super().readinto(buffer)
            counts[str(self.name)] += count or 0
            return count

    def counted_read_bytes(self):
        data = read_bytes(self)
        counts[str(self)] += len(data)
        return data

    def counted_parquet_file(source, *args, **kwargs):
        return parquet_file(CountingFile(str(source)) if isinstance(source, (str, Path)) else source, *args, **kwargs)

    Path.read_bytes, pq.ParquetFile = counted_read_bytes, counted_parquet_file
    try:
        yield counts
    finally:
        Path.read_bytes, pq.ParquetFile = read_bytes, parquet_file


def lane_epoch_reads(data, rank: int, world: int, counts: Counter) -> list[tuple[Counter, int]]:
    """(bytes read from each shard index, aligned and teacher together; windows trained) of each lane of
    `rank` of `world` over epoch 0, each lane alone in its own worker stream (`stream_batches(spec, lane,
    lanes)`), through the real readers; `counts` is a `counted_file_reads()` counter."""
    from trainer.loader import stream_batches

    shard_of = {str(data.aligned.shard_path(s)): i for i, s in enumerate(data.aligned.shards)}
    for teacher in data.teachers:
        shard_of.update({str(teacher.output.directory / name): i for i, name in enumerate(teacher.output.shard_files)})
    spec = data.loader(rank, world, None).spec  # (workers 0: nothing is read until a batch is asked for)
    out = []
    for lane in range(spec.lanes):
        counts.clear()
        stream = stream_batches(spec, lane, spec.lanes)
        windows = 0
        while True:  # one epoch of this lane: a micro-batch never holds two, so nothing of epoch 1 is read
            batch = next(stream)
            windows += batch.windows
            if batch.state["epoch"] == 1:
                break
        stream.close()
        read: Counter = Counter()
        for path, count in counts.items():
            if path in shard_of:
                read[shard_of[path]] += count
        out.append((read, windows))
    return out
