"""Teacher top-k shards: the declared Arrow schema (version 1), row statuses and the encoding.

A teacher top-k shard is co-partitioned with the aligned shard it was computed from: same file
name (`part-RRRRR-IIIII.parquet`), one row per aligned row, same order. Read it with
`csd_pipeline.read_teacher_topk(DIR)`, which yields per row `row_id`, `ids` int32 [T, k],
`logprobs` float32 [T, k] (descending), `observed_logprob` float32 [T] (NaN at the last
position) and `status` (SPEC §8).

Columns (one row per aligned row):

| column | type | meaning |
|---|---|---|
| `row_id` | string | the aligned row's `row_id` |
| `status` | uint8 | a `RowStatus`; 0 = values stored, otherwise the row is rejected and holds no values |
| `positions` | int32 | T, the number of teacher positions (tokens) of the aligned row, also when rejected |
| `block` | int32 | index (in this file) of the block that holds the row's values |
| `payload` | binary, nullable | the encoded block, on the first row of each block; null on the other rows |

Each block is one Parquet row group, so a reader decodes one row group at a time. A block holds
the values of its rows with status 0, concatenated in row order: P positions, where the last
position of each row has no observed token.

Encoding `csd-topk-lzma-v1` of a block payload (see `csd_pipeline/teacher/codec.py`):

    header (little-endian): magic "CTK1", uint32 P, uint32 k, uint32 id_width (2 or 3),
        uint32 O (positions with an observed next token), then uint32 byte length of each of the
        7 streams below, in order.
    streams, each compressed with raw LZMA1 (FORMAT_RAW, settings per stream in topk_codec.py;
    an empty stream is stored as zero bytes):
      top     uint16 BE [P]         q of the best entry of each position
      ids_lo  uint16 BE [P, k]      low 16 bits of the ids, position-major, canonical order
      ids_hi  uint8 [P, k]          bits 16..23 of the ids (only when id_width == 3)
      gaps    uint8 [k-1, P]        q[j] - q[j-1] for j = 1..k-1, RANK-major; 255 = escaped
      gaps_x  uint16 BE             the escaped gaps (>= 255), in the order of `gaps`
      obs     uint8 [O]             per observed position: index of the observed token in the
                                    top-k, or k when it is not there
      obs_x   uint16 BE             per obs == k: q_observed - q[k-1] (>= 0)

Quantization: q = clip(round(-logprob * 51), 0, 65535), decoded as -q / 51 in float32, so every
stored log-probability is within 1/102 nat (0.0098) of the float32 value the teacher produced,
down to -1285 nat (q saturates at 65535 there; log-probabilities below that decode as -1285; this
never happens in a top-k of a real model, and no coarser step is used anywhere, so the 0.0098
bound holds for every value above -20 and far below). Canonical order: entries sorted by q
ascending, ties by id ascending. The quantized values are first rounded, then differenced, so
rounding errors never accumulate along the ranks.

Rejected rows (status != 0) keep their place (so row order still matches the aligned shard) but
have no values in the block; the reader yields them with empty [0, k] arrays and their status.
"""

from __future__ import annotations

from enum import IntEnum

SCHEMA_VERSION = 1
STAGE = "teacher-logits"


class RowStatus(IntEnum):
    """Whether a teacher top-k row holds values."""

    OK = 0
    """The row's top-k ids, log-probs and observed log-probs are stored."""
    NON_FINITE = 1
    """A log-probability of the row (the normaliser, a top-k value or an observed value) was NaN or
    infinite; the row is rejected (counted as `rejected.non_finite` in the stats) and holds no values."""


def teacher_topk_schema(k: int, encoding: str):
    """The Arrow schema (version 1) of a teacher top-k shard with `k` entries per position.

    The schema metadata records the schema name and version, k, the encoding name and that the
    pages carry checksums (`csd.page_checksum`, csd_pipeline/runtime/integrity.py).
    """
    import pyarrow as pa

    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_MARK

    fields = [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("status", pa.uint8(), nullable=False),
        pa.field("positions", pa.int32(), nullable=False),
        pa.field("block", pa.int32(), nullable=False),
        pa.field("payload", pa.binary(), nullable=True),
    ]
    metadata = {
        b"csd.schema": b"teacher_topk",
        b"csd.schema_version": str(SCHEMA_VERSION).encode(),
        b"csd.k": str(k).encode(),
        b"csd.encoding": encoding.encode(),
        **PAGE_CHECKSUM_MARK,
    }
    return pa.schema(fields, metadata=metadata)
