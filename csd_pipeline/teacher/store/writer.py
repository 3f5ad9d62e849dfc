"""The teacher store's writer: blocks of teacher rows, from any source, -> one Parquet shard (`schema.py`).

`write_store(path, chain, row_ids, token_rows, teacher_rows, block_positions)` writes a shard: the rows cut into
blocks of about `block_positions` positions (`block_ranges`), `teacher_rows(start, end)` asked for each block's
values. `StoreWriter(path, chain)`, which it uses, is a context manager; `write_block(row_ids, token_rows, rows)` encodes one block
(`codec.encode_block`: one Parquet row group) of `TeacherTopkRow`s, whatever computed them (the teacher-logits
stage's runner, or values replayed by a benchmark), and `stats` sums what was written. It runs no teacher: the
selectors (`selectors/`) have cut the rows already, except those of the writer's scope (`--keep csd-events`),
which `write_block(..., select=)` applies with the encoding. Rows with status != 0 keep their place with no
values, so a shard stays co-partitioned with its aligned shard.

With `threads` > 0 the encoding (LZMA releases the GIL) runs in threads while the caller computes the next block
(on a GPU the CPU would otherwise idle the accelerator); blocks are written in order either way.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from csd_pipeline.teacher.row import TeacherTopkRow


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


def encode_rows(results: list[TeacherTopkRow], rows: list[np.ndarray], width: int, select=None,
                first_row: int = 0) -> tuple[bytes, dict]:
    """Encode the kept rows (finite) of one block; returns (payload, stats of the block).

    rows: the teacher ids of each row (the observed tokens). Each position stores its `TeacherTopkRow.lengths`
    most likely entries; `entries` counts them and `observed.in_top_k` counts the observed tokens among them.
    `select(row_index, TeacherTopkRow)`, when given, first chooses the entries of each kept row (row_index:
    `first_row` + its place here)."""
    from csd_pipeline.teacher.store.codec import encode_block

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
        ids, logprobs = np.zeros((0, width), np.int64), np.zeros((0, width), np.float32)
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


class StoreWriter:
    """Writes one teacher top-k shard at `path` for the selector chain `chain` (`SelectorChain`: the width and
    schema metadata), block by block; `threads` encoders (0: encode in the caller's thread)."""

    COMPRESSION = {"row_id": "zstd", "status": "zstd", "positions": "zstd", "block": "zstd", "payload": "none"}

    def __init__(self, path, chain, threads: int = 0):
        from csd_pipeline.teacher.store.codec import ENCODING
        from csd_pipeline.teacher.store.schema import teacher_topk_schema

        self.path = path
        self.width = chain.width
        self.schema = teacher_topk_schema(self.width, ENCODING, chain.metadata())
        self.stats = {"positions": 0, "entries": 0, "rejected": {"non_finite": 0},
                      "observed": {"positions": 0, "in_top_k": 0}, "payload_bytes": 0}
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads) if threads else None
        self._pending: deque = deque()
        self._blocks = 0
        self._writer = None

    def __enter__(self) -> StoreWriter:
        import pyarrow.parquet as pq

        from csd_pipeline.runtime.integrity import PARQUET_CHECKSUMS

        self._writer = pq.ParquetWriter(str(self.path), self.schema, compression=self.COMPRESSION,
                                        use_dictionary=False, write_statistics=False, store_schema=True,
                                        **PARQUET_CHECKSUMS)
        return self

    def write_block(self, row_ids: list[str], token_rows: list[np.ndarray], rows: list[TeacherTopkRow],
                    select=None, first_row: int = 0) -> None:
        """Encode and write one block: `rows` (one per row id; `token_rows` their teacher ids), `select`ed first
        (`SelectorChain.row_cut`, `first_row`: the shard index of the block's first row)."""
        job = (encode_rows, rows, token_rows, self.width, select, first_row)
        encoded = self._pool.submit(*job) if self._pool else job[0](*job[1:])
        self._pending.append((row_ids, token_rows, rows, encoded))
        while len(self._pending) > self.threads:  # at most `threads` blocks in flight
            self._write(*self._pending.popleft())

    def _write(self, row_ids, token_rows, rows, encoded) -> None:
        import pyarrow as pa

        from csd_pipeline.runtime.run_record import merge_stats

        payload, part = encoded.result() if self._pool else encoded
        merge_stats(self.stats, part)
        count = len(row_ids)
        self._writer.write_table(pa.table({
            "row_id": pa.array(list(row_ids), pa.string()),
            "status": pa.array([r.status for r in rows], pa.uint8()),
            "positions": pa.array([len(r) for r in token_rows], pa.int32()),
            "block": pa.array([self._blocks] * count, pa.int32()),
            "payload": pa.array([payload] + [None] * (count - 1), pa.binary()),
        }, schema=self.schema), row_group_size=count)
        self._blocks += 1

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is None:
                while self._pending:
                    self._write(*self._pending.popleft())
        finally:
            if self._pool:
                self._pool.shutdown(cancel_futures=True)
            self._writer.close()


def write_store(path, chain, row_ids: list[str], token_rows: list[np.ndarray], teacher_rows, block_positions: int,
                select=None, threads: int = 0) -> dict:
    """Write one shard at `path` for the `SelectorChain` `chain`; returns the shard's stats.

    row_ids and token_rows (teacher ids, int) of every row in order; `teacher_rows(start, end) -> list of
    TeacherTopkRow`: the values of rows [start, end), already through the chain's position selectors (a runner,
    or values computed before); `select`: the chain's `row_cut` for this shard, or None."""
    with StoreWriter(path, chain, threads) as writer:
        for start, end in block_ranges([len(row) for row in token_rows], block_positions):
            writer.write_block(row_ids[start:end], token_rows[start:end], teacher_rows(start, end), select, start)
    return writer.stats
