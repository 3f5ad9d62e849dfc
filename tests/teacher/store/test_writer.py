"""The store's writer: blocks of teacher rows from any source, no teacher; the bytes do not depend on its threads."""

from __future__ import annotations

import numpy as np

from csd_pipeline.teacher.row import TeacherTopkRow
from csd_pipeline.teacher.store.selectors import chain_from_config
from tests.teacher.store.selectors.test_chain import hand_made_rows


def test_threads_write_the_same_bytes_and_rejected_rows_keep_their_place(tmp_path):
    """Encoding in threads (as on a GPU) writes the bytes the caller's thread writes; a rejected row keeps its
    place with no values; the stats count what was stored."""
    from csd_pipeline.teacher.store.reader import read_teacher_shard
    from csd_pipeline.teacher.store.writer import write_store

    chain = chain_from_config({"top_k": 5, "top_p": 0.8})
    rows, tokens = hand_made_rows(9, 5, np.random.default_rng(2))
    rows[3] = TeacherTopkRow(None, rows[3].ids, rows[3].logprobs, rows[3].observed_logprob, 1, rows[3].lengths)
    row_ids = [f"doc:{i}:0" for i in range(len(rows))]
    stats = [write_store(tmp_path / f"t{threads}.parquet", chain, row_ids, tokens, lambda a, b: rows[a:b], 12,
                         threads=threads) for threads in (0, 3)]
    assert (tmp_path / "t0.parquet").read_bytes() == (tmp_path / "t3.parquet").read_bytes() and stats[0] == stats[1]
    kept = [r for i, r in enumerate(rows) if i != 3]
    assert stats[0]["rejected"] == {"non_finite": 1} and stats[0]["entries"] == sum(int(r.lengths.sum()) for r in kept)
    shard = read_teacher_shard(tmp_path, "t0.parquet")
    assert shard.top_p == 0.8 and shard.k == 5 and len(shard._block_rows) > 1
    back = list(shard)
    assert [r.row_id for r in back] == row_ids and back[3].status == 1 and back[3].ids.shape == (0, 5)
    for row, read in zip(rows, back):
        if row.ok:
            np.testing.assert_array_equal(read.lengths, row.lengths)
