"""The teacher-logits stage's shard writer: one aligned shard -> one teacher top-k shard.

`TeacherShardWriter(...)(task, tmp_path)` checks the aligned shard against its manifest, reads the
teacher's ids of every row (`AlignedOutput.teacher_rows`), cuts the rows into blocks of about
`block_positions` positions (one Parquet row group each), computes each block with the
`TeacherRunner` and encodes it (`teacher.codec`) in row order. A row with any non-finite
log-probability is rejected and counted (status 1, no values) and keeps its place, so the shard
stays co-partitioned with its aligned shard (`schemas/teacher_topk.py`).

The writer is picklable: the executor sends a copy to each worker process (`--workers N`), which
loads its own teacher; in the stage's own process it uses the teacher the stage loaded.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.runner import TeacherRunner


def block_ranges(lengths, block_positions: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, end) of at least `block_positions` positions each (the last may
    be shorter); every block holds at least one row."""
    ranges, start = [], 0
    while start < len(lengths):
        end, positions = start, 0
        while end < len(lengths) and (positions < block_positions or end == start):
            positions += int(lengths[end])
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def encode_rows(results: list[TeacherTopkRow], rows: list[np.ndarray], top_k: int, select=None,
                first_row: int = 0) -> tuple[bytes, dict]:
    """Encode the kept rows (finite) of one block; returns (payload, stats of the block).

    Each position stores its `TeacherTopkRow.lengths` most likely entries; `entries` counts them and
    `observed.in_top_k` counts the observed tokens among them. `select(row_index, TeacherTopkRow)`, when
    given, first chooses the entries of each kept row (row_index: `first_row` + its place here)."""
    from csd_pipeline.teacher.codec import encode_block

    if select is not None:
        results = [select(first_row + i, r) if r.ok else r for i, r in enumerate(results)]
    kept = [(r, row) for r, row in zip(results, rows) if r.ok]
    if kept:
        ids = np.concatenate([r.ids for r, _ in kept])
        logprobs = np.concatenate([r.logprobs for r, _ in kept])
        lengths = np.concatenate([r.lengths for r, _ in kept])
        observed = np.concatenate([r.observed_logprob for r, _ in kept])
        observed_ids = np.concatenate([np.append(row[1:], -1) for _, row in kept])
    else:
        ids, logprobs = np.zeros((0, top_k), np.int64), np.zeros((0, top_k), np.float32)
        observed, observed_ids, lengths = np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    payload = encode_block(ids, logprobs, observed_ids, observed, lengths)
    has_next = observed_ids >= 0
    stored = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    in_stored = ((ids == observed_ids[:, None]) & stored).any(axis=1)
    stats = {
        "positions": int(sum(len(row) for row in rows)),
        "entries": int(lengths.sum()),
        "rejected": {"non_finite": sum(not r.ok for r in results)},
        "observed": {"positions": int(has_next.sum()), "in_top_k": int((in_stored & has_next).sum())},
        "payload_bytes": len(payload),
    }
    return payload, stats


def write_teacher_shard(runner: TeacherRunner, row_ids: list[str], rows: list[np.ndarray], tmp_path: Path,
                        block_positions: int, select=None):
    """Compute and encode the teacher top-k of one shard's rows (teacher ids, each non-empty and inside
    the vocabulary) into the Parquet file `tmp_path`. Returns the executor's `ShardResult`.

    select: None (store every entry) or `select(row_index, TeacherTopkRow) -> TeacherTopkRow`, the entries to store
    of each kept row (`--keep csd-events`: `event_entries.keep_marked`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from csd_pipeline.runtime.executor import ShardResult
    from csd_pipeline.runtime.run_record import merge_stats
    from csd_pipeline.teacher.codec import ENCODING
    from csd_pipeline.teacher.tail_samples import block_seed
    from schemas.teacher_topk import teacher_topk_schema

    schema = teacher_topk_schema(runner.width, ENCODING, runner.top_p, "top-k" if select is None else "csd-events",
                                 runner.min_p, runner.tail_samples)
    stats = {"positions": 0, "entries": 0, "rejected": {"non_finite": 0},
             "observed": {"positions": 0, "in_top_k": 0}, "payload_bytes": 0}
    compression = {"row_id": "zstd", "status": "zstd", "positions": "zstd", "block": "zstd", "payload": "none"}
    # On a GPU the CPU would otherwise idle the accelerator while it encodes: encode blocks in threads
    # (LZMA releases the GIL) while the next block runs. On CPU the forward already uses every core.
    threads = 0 if runner.device.type == "cpu" else min(4, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(threads) if threads else None
    pending: deque = deque()

    def write(block: int, start: int, end: int, results, encoded) -> None:
        payload, part = encoded.result() if pool else encoded
        merge_stats(stats, part)
        count = end - start
        writer.write_table(pa.table({
            "row_id": pa.array(row_ids[start:end], pa.string()),
            "status": pa.array([r.status for r in results], pa.uint8()),
            "positions": pa.array([len(r) for r in rows[start:end]], pa.int32()),
            "block": pa.array([block] * count, pa.int32()),
            "payload": pa.array([payload] + [None] * (count - 1), pa.binary()),
        }, schema=schema), row_group_size=count)

    try:
        from csd_pipeline.runtime.integrity import PARQUET_CHECKSUMS

        with pq.ParquetWriter(str(tmp_path), schema, compression=compression, use_dictionary=False,
                              write_statistics=False, store_schema=True, **PARQUET_CHECKSUMS) as writer:
            for block, (start, end) in enumerate(block_ranges([len(r) for r in rows], block_positions)):
                if runner.tail_samples:  # the draws of a block depend on its rows only: a re-run draws the same
                    runner.seed(block_seed(runner.sample_seed, row_ids[start]))
                results = runner.run(rows[start:end])
                # The entry selection runs with the encoding, off the teacher's path on a GPU.
                job = (encode_rows, results, rows[start:end], runner.width, select, start)
                pending.append((block, start, end, results, pool.submit(*job) if pool else job[0](*job[1:])))
                while len(pending) > threads:  # blocks are written in order; at most `threads` in flight
                    write(*pending.popleft())
            while pending:
                write(*pending.popleft())
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return ShardResult(rows=len(rows), stats=stats)


class TeacherShardWriter:
    """Writes the teacher top-k shard of one aligned shard (the executor's shard writer).

    config: the `TeacherLogitsConfig`; aligned: the `AlignedOutput`; vocab_size: the teacher
    tokenizer's size (ids at or beyond it never enter the top-k); device, dtype: resolved names
    ("cuda:0", "bfloat16"); runner: the `TeacherRunner` of the loaded teacher, or None to load it on
    first use.
    """

    def __init__(self, config, aligned, vocab_size: int, device: str, dtype: str, runner: TeacherRunner | None = None):
        self.config = config
        self.aligned = aligned
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self._runner = runner
        self._context = None

    def __getstate__(self) -> dict:
        # A copy for a worker process carries only plain values; the worker loads its own teacher.
        return {**self.__dict__, "_runner": None, "_context": None}

    def event_context(self):
        """The `EventContext` of the aligned tables of this teacher (`--keep csd-events`), built once."""
        if self._context is None:
            from csd_pipeline.events.context import EventContext
            from csd_pipeline.vocab.tables import load_table

            s2t, t2s = self.aligned.tables(self.config.teacher_index)
            self._context = EventContext(load_table(s2t), load_table(t2s), tables_name=str(s2t.parent))
        return self._context

    def shard_rows(self, shard):
        """(row ids, teacher ids of each row as int64 arrays, `select` for `write_teacher_shard` or None) of
        one aligned shard, read once: with `--keep csd-events` the chunk columns too, for the selection."""
        index = self.config.teacher_index
        if self.config.keep != "csd-events":
            return (*self.aligned.teacher_rows(shard, index), None)
        from csd_pipeline.teacher.event_entries import event_selector
        from schemas.aligned import teacher_columns

        aligned_rows = self.aligned.read(shard, self.aligned.training_columns([index])).to_pylist()
        ids = teacher_columns(index)[0]
        rows = [np.asarray(row[ids], dtype=np.int64) for row in aligned_rows]
        return [row["row_id"] for row in aligned_rows], rows, event_selector(aligned_rows, index, self.event_context())

    def runner(self) -> TeacherRunner:
        """The runner of the teacher, loaded once."""
        if self._runner is None:
            from csd_pipeline.runtime.model_loading import load_causal_lm

            config = self.config
            deterministic_torch(self.device)
            loaded = load_causal_lm(config.teacher, dtype=self.dtype, device=self.device,
                                    trust_remote_code=config.trust_remote_code)
            self._runner = TeacherRunner(loaded, top_k=config.top_k, vocab_limit=self.vocab_size,
                                         temperature=float(config.temperature), batch_tokens=config.batch_tokens,
                                         top_p=config.top_p, min_p=config.min_p, tail_samples=config.tail_samples,
                                         sample_seed=config.sample_seed)
        return self._runner

    def __call__(self, task, tmp_path: Path):
        """Write the teacher shard of task `task` (aligned shard `task.index`) to `tmp_path`."""
        from csd_pipeline.runtime.files import file_sha256

        shard = self.aligned.shards[task.index]
        source = self.aligned.shard_path(shard)
        unchanged = shard.file == task.spec["aligned_file"] and source.is_file()
        if not unchanged or file_sha256(source) != task.spec["aligned_sha256"]:
            raise CsdError(f"aligned shard {source} is missing or differs from what its manifest records; re-run "
                           "csd-pipeline align, then teacher-logits into a new --output.")
        row_ids, rows, select = self.shard_rows(shard)
        for row_id, row in zip(row_ids, rows):
            if row.size == 0:
                raise CsdError(f"aligned row {row_id} of {source} has no teacher tokens; re-run csd-pipeline align.")
            if row.min() < 0 or row.max() >= self.vocab_size:
                raise CsdError(f"aligned row {row_id} of {source} has teacher ids outside the teacher vocabulary "
                               f"(size {self.vocab_size}); the aligned directory was made with another tokenizer.")
        return write_teacher_shard(self.runner(), row_ids, rows, tmp_path, self.config.block_positions, select)


def deterministic_torch(device: str) -> None:
    """On CPU, have torch warn about any nondeterministic kernel (CPU kernels are deterministic for a
    given thread count; this makes an exception loud)."""
    import torch

    if not device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
