"""The teacher-logits stage's shard writer: one aligned shard -> one teacher top-k shard.

`TeacherShardWriter(...)(task, tmp_path)` checks the aligned shard against its manifest, reads the
teacher's ids of every row (`AlignedOutput.teacher_rows`; with a selector that reads the aligned
chunks, the chunk columns too), cuts the rows into blocks of about `block_positions` positions (one
Parquet row group each), computes each block with the `TeacherRunner` and its position selectors,
and hands it to the store's writer (`store/writer.py`) with the selectors of the writer's scope. A row with any non-finite
log-probability is rejected and counted (status 1, no values) and keeps its place, so the shard
stays co-partitioned with its aligned shard (`csd_pipeline/teacher/store/schema.py`).

The writer is picklable: the executor sends a copy to each worker process (`--workers N`), which
loads its own teacher; in the stage's own process it uses the teacher the stage loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.runner import TeacherRunner


def teacher_runner(loaded, config, chain, vocab_size: int) -> TeacherRunner:
    """The `TeacherRunner` of a loaded teacher for a `TeacherLogitsConfig` and its `SelectorChain`."""
    return TeacherRunner(loaded, top_k=chain.top_k, vocab_limit=vocab_size, temperature=float(config.temperature),
                         batch_tokens=config.batch_tokens, selectors=chain.position_selectors())


def write_teacher_shard(runner: TeacherRunner, chain, row_ids: list[str], rows: list[np.ndarray], tmp_path: Path,
                        block_positions: int, select=None):
    """Compute the teacher top-k of one shard's rows (teacher ids, each non-empty and inside the vocabulary)
    block by block and write it to the Parquet file `tmp_path`: runner (with the position selectors of `chain`,
    the store's `SelectorChain`) -> `select` (`chain.row_cut` of the shard, or None) -> `StoreWriter`. Returns
    the executor's `ShardResult`."""
    from csd_pipeline.runtime.executor import ShardResult
    from csd_pipeline.teacher.store.writer import write_store

    def computed(start: int, end: int) -> list:
        seed = chain.block_seed(row_ids[start])  # the draws of a block depend on its rows only: a re-run draws the same
        if seed is not None:
            runner.seed(seed)
        return runner.run(rows[start:end])

    # On a GPU the CPU would otherwise idle the accelerator while it encodes (and applies the writer's
    # selectors): encode in threads while the next block runs. On CPU the forward already uses every core.
    threads = 0 if runner.device.type == "cpu" else min(4, os.cpu_count() or 1)
    stats = write_store(tmp_path, chain, row_ids, rows, computed, block_positions, select, threads)
    return ShardResult(rows=len(rows), stats=stats)


class TeacherShardWriter:
    """Writes the teacher top-k shard of one aligned shard (the executor's shard writer).

    config: the `TeacherLogitsConfig`; chain: its `SelectorChain`; aligned: the `AlignedOutput`; vocab_size: the teacher
    tokenizer's size (ids at or beyond it never enter the top-k); device, dtype: resolved names
    ("cuda:0", "bfloat16"); runner: the `TeacherRunner` of the loaded teacher, or None to load it on
    first use.
    """

    def __init__(self, config, chain, aligned, vocab_size: int, device: str, dtype: str,
                 runner: TeacherRunner | None = None):
        self.config = config
        self.chain = chain
        self.aligned = aligned
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = dtype
        self._runner = runner

    def __getstate__(self) -> dict:
        # A copy for a worker process carries only plain values; the worker loads its own teacher.
        return {**self.__dict__, "_runner": None}

    def shard_rows(self, shard):
        """(row ids, teacher ids of each row as int64 arrays, `select` for `write_teacher_shard` or None) of
        one aligned shard, read once: with a selector that reads the aligned chunks, the chunk columns too."""
        index = self.config.teacher_index
        if not self.chain.reads_aligned:
            return (*self.aligned.teacher_rows(shard, index), None)
        from schemas.aligned import teacher_columns

        aligned_rows = self.aligned.read(shard, self.aligned.training_columns([index])).to_pylist()
        ids = teacher_columns(index)[0]
        rows = [np.asarray(row[ids], dtype=np.int64) for row in aligned_rows]
        return [row["row_id"] for row in aligned_rows], rows, self.chain.row_cut(aligned_rows)

    def runner(self) -> TeacherRunner:
        """The runner of the teacher, loaded once."""
        if self._runner is None and self.config.teacher_server:
            from csd_pipeline.teacher.served import served_teacher

            self._runner = served_teacher(self.config, self.chain, self.vocab_size)
        if self._runner is None:
            from csd_pipeline.runtime.model_loading import load_causal_lm

            config = self.config
            deterministic_torch(self.device)
            loaded = load_causal_lm(config.teacher, dtype=self.dtype, device=self.device,
                                    trust_remote_code=config.trust_remote_code)
            self._runner = teacher_runner(loaded, config, self.chain, self.vocab_size)
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
        return write_teacher_shard(self.runner(), self.chain, row_ids, rows, tmp_path, self.config.block_positions,
                                   select)


def deterministic_torch(device: str) -> None:
    """On CPU, have torch warn about any nondeterministic kernel (CPU kernels are deterministic for a
    given thread count; this makes an exception loud)."""
    import torch

    if not device.startswith("cuda"):
        torch.use_deterministic_algorithms(True, warn_only=True)
