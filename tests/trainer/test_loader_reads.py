"""Each rank reads what it trains on: the bytes of aligned and teacher top-k shards that the real
loader reads, counted at the file, for two simulated ranks in one process (issue 31 item 4).

The plan-level bound for W = 1, 2, 8, 64 over many shards is `test_shuffle.test_bytes_*`."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest

from tests.trainer_cases import DATA, align

WORLD = 2


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, tokenizer_path) -> dict:
    """22 aligned shards (python-docs paragraphs, ~1 KB of text each) and their teacher top-k from a tiny
    random teacher, in blocks of 64 positions (one Parquet row group each)."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.teacher.test_stage import make_tiny_teacher

    root = tmp_path_factory.mktemp("reads")
    corpus = root / "docs.txt"
    corpus.write_text((DATA / "python-docs-slice.txt").read_text(encoding="utf-8")[:24000], encoding="utf-8")
    aligned = root / "aligned"
    align([corpus], aligned, shard_bytes=1000)
    teacher = make_tiny_teacher(root / "tiny-teacher", tokenizer_path("smollm2"))
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(teacher), output=str(root / "topk"),
                                           top_k=8, device="cpu", block_positions=64, batch_tokens=512))
    return {"aligned": aligned, "topk": root / "topk"}


class _CountingFile(io.FileIO):
    """A file whose reads add to `counts[path]`."""

    counts: Counter = Counter()

    def read(self, size=-1):
        data = super().read(size)
        self.counts[str(self.name)] += len(data)
        return data

    def readinto(self, buffer):
        count = super().readinto(buffer)
        self.counts[str(self.name)] += count or 0
        return count


@pytest.fixture
def file_reads(monkeypatch) -> Counter:
    """Bytes read from each file path: aligned shards (`Path.read_bytes`) and teacher shards (`pq.ParquetFile`
    opened on a path) go through counting readers."""
    import pyarrow.parquet as pq

    counts: Counter = Counter()
    _CountingFile.counts = counts
    read_bytes, parquet_file = Path.read_bytes, pq.ParquetFile

    def counted_read_bytes(self):
        data = read_bytes(self)
        counts[str(self)] += len(data)
        return data

    def counted_parquet_file(source, *args, **kwargs):
        if isinstance(source, (str, Path)):
            source = _CountingFile(str(source))
        return parquet_file(source, *args, **kwargs)

    monkeypatch.setattr(Path, "read_bytes", counted_read_bytes)
    monkeypatch.setattr(pq, "ParquetFile", counted_parquet_file)
    return counts


def _config(store: dict, tmp_path, trainer_data):
    from trainer.options import parse_args

    return parse_args(["--aligned", str(store["aligned"]), "--teacher-logits", str(store["topk"]), "--student-config",
                       str(trainer_data["student_config"]), "--student-tokenizer", "llama-spm", "--output",
                       str(tmp_path / "run"), "--seq-len", "128", "--batch-size", "2", "--workers", "0",
                       "--shuffle-block", "2", "--data-lanes", "2", "--no-progress"])


def _epoch_reads(data, rank: int, world: int, file_reads: Counter, shard_of: dict) -> list[tuple[Counter, int]]:
    """(bytes read from each shard, windows trained) of each lane of `rank` over epoch 0, each lane alone
    in its own worker stream (`stream_batches(spec, lane, lanes)`), through the real readers."""
    from trainer.loader import stream_batches

    spec = data.loader(rank, world, None).spec  # (workers 0: nothing is read until a batch is asked for)
    out = []
    for worker in range(spec.lanes):
        file_reads.clear()
        stream = stream_batches(spec, worker, spec.lanes)
        windows = 0
        while True:  # one epoch of this lane: a micro-batch never holds two, so nothing of epoch 1 is read
            batch = next(stream)
            windows += batch.windows
            if batch.state["epoch"] == 1:
                break
        stream.close()
        read = Counter()
        for path, count in file_reads.items():
            if path in shard_of:
                read[shard_of[path]] += count
        out.append((read, windows))
    return out


@pytest.mark.slow
def test_each_rank_and_worker_reads_only_its_shards(small_store, trainer_data, tmp_path, file_reads):
    """W = 2 against W = 1, counting the bytes the readers take from the files. The total is what one rank
    reads for the whole epoch through the same readers: pyarrow reads a file's last 64 KiB for its footer
    and then the row groups it needs, so a teacher shard smaller than that is read about twice, whatever W."""
    from trainer.data import TrainingData
    from trainer.shuffle import EpochPlan

    data = TrainingData.open(_config(small_store, tmp_path, trainer_data))
    shards = data.aligned.shards
    shard_of = {str(data.aligned.shard_path(s)): i for i, s in enumerate(shards)}
    topk = data.teachers[0].output
    shard_of.update({str(topk.directory / name): i for i, name in enumerate(topk.shard_files)})
    rows = tuple(s.rows for s in shards)
    alone = _epoch_reads(data, 0, 1, file_reads, shard_of)
    whole = Counter()
    for read, _ in alone:
        whole.update(read)
    total, largest = sum(whole.values()), max(whole.values())
    assert set(whole) == set(range(len(shards))) and sum(w for _, w in alone) == sum(rows)
    trained = 0
    for rank in range(WORLD):
        lanes = _epoch_reads(data, rank, WORLD, file_reads, shard_of)
        assert len(lanes) == 2
        for worker, (read, windows) in enumerate(lanes):  # one lane per worker
            plan = EpochPlan(data.config.seed, 0, rows, 2)
            assert set(read) == set(plan.lane_shards(rank * 2 + worker, WORLD * 2))  # exactly its span's shards
            assert sum(read.values()) <= 1.2 * total / (WORLD * 2) + largest
            trained += windows
        assert sum(sum(read.values()) for read, _ in lanes) <= 1.2 * total / WORLD + largest
    assert trained == sum(rows)  # together the ranks trained on as many windows as the epoch has
