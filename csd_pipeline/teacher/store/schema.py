"""Teacher top-k shards: the declared Arrow schema (version 2; version 1 still read), row statuses and the encoding.

A teacher top-k shard is co-partitioned with the aligned shard it was computed from: same file
name (`part-RRRRR-IIIII.parquet`), one row per aligned row, same order. Read it with
`csd_pipeline.read_teacher_topk(DIR)`, which yields per row (`TeacherTopkRow`) `row_id`, `ids`
int32 [T, k] and `logprobs` float32 [T, k] (descending), `lengths` int64 [T] (how many of the k
entries of each position are real: entries j >= lengths[t] are padding, id -1 and log-prob -inf),
`observed_logprob` float32 [T] (NaN at the last position) and `status` (SPEC §8).

Columns (one row per aligned row; the same in versions 1 and 2):

| column | type | meaning |
|---|---|---|
| `row_id` | string | the aligned row's `row_id` |
| `status` | uint8 | a `RowStatus`; 0 = values stored, otherwise the row is rejected and holds no values |
| `positions` | int32 | T, the number of teacher positions (tokens) of the aligned row, also when rejected |
| `block` | int32 | index (in this file) of the block that holds the row's values |
| `payload` | binary, nullable | the encoded block, on the first row of each block; null on the other rows |

Schema metadata: `csd.schema` = "teacher_topk", `csd.schema_version`, `csd.k` (the most entries a
position holds: `--top-k`, plus N + 1 with `--tail-samples N`), `csd.encoding`, from version 2 `csd.top_p`
(the `--top-p` mass bound as a decimal string, or "" without it), and the keys of the other selectors
that are set (`SELECTOR_METADATA`: `csd.keep`, `csd.min_p`, `csd.tail_samples`), which the reader checks
against the manifest.

Each block is one Parquet row group, so a reader decodes one row group at a time. A block holds
the values of its rows with status 0, concatenated in row order: P positions, where the last
position of each row has no observed token.

Which entries a position stores is decided by the store's selectors, each stating its rule once in its
own module (`csd_pipeline/teacher/store/selectors/`: top_k, top_p, min_p, tail_samples, csd_events),
applied in that order. Every position stores at least its first entry (n >= 1), most likely first (by
stored value); the layout below is the same whatever the selectors.

Encoding `csd-topk-lzma-v2` (schema version 2) of a block payload (see `csd_pipeline/teacher/store/codec.py`):

    header (little-endian): magic "CTK2", uint32 P, uint32 k, uint32 id_width (2 or 3),
        uint32 O (positions with an observed next token), uint32 E (stored entries, the sum of
        the n of every position), then uint32 byte length of each of the 8 streams below, in order.
    streams, each compressed with raw LZMA1 (FORMAT_RAW, settings per stream in codec.py;
    an empty stream is stored as zero bytes):
      lens    uint8 [P]             n of each position, in [1, k]; empty when E == P * k (every n is k)
      top     uint16 BE [P]         q of the best entry of each position
      ids_lo  uint16 BE [E]         low 16 bits of the ids, position by position, canonical order
      ids_hi  uint8 [E]             bits 16..23 of the ids (only when id_width == 3)
      gaps    uint8 [E - P]         q[j] - q[j-1] for j = 1..n-1, RANK-major: all positions' gap
                                    j = 1 (those with n > 1), then j = 2, ...; 255 = escaped
      gaps_x  uint16 BE             the escaped gaps (>= 255), in the order of `gaps`
      obs     uint8 [O]             per observed position: index of the observed token among the
                                    position's n entries, or 255 when it is not one of them
      obs_x   uint16 BE             per obs == 255: q_observed - q[n-1] (>= 0)

Encoding `csd-topk-lzma-v1` (schema version 1, read only): header magic "CTK1", uint32 P, k,
id_width, O, then the byte lengths of the 7 streams `top` .. `obs_x` above with n = k at every
position (no `lens`, no E), and `obs` = k (not 255) for an observed token outside the top-k.

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

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # the reader still reads shards and manifests of version 1 (fixed top-k)
STAGE = "teacher-logits"


class RowStatus(IntEnum):
    """Whether a teacher top-k row holds values."""

    OK = 0
    """The row's top-k ids, log-probs and observed log-probs are stored."""
    NON_FINITE = 1
    """A log-probability of the row (the normaliser, a top-k value or an observed value) was NaN or
    infinite; the row is rejected (counted as `rejected.non_finite` in the stats) and holds no values."""


SELECTOR_METADATA = (b"csd.top_p", b"csd.keep", b"csd.min_p", b"csd.tail_samples")
"""The schema metadata keys of the selectors (`selectors/`) in the order version 2 writes them, after the
format's own keys (`FORMAT_METADATA`); `csd.top_p` is always there ("" without --top-p), the others only when
their selector is set. A selector's key not listed here follows them, in the order of the selectors."""

FORMAT_METADATA = (b"csd.schema", b"csd.schema_version", b"csd.k", b"csd.encoding")


def selector_metadata_of(metadata: dict) -> dict:
    """The selectors' keys of a shard's schema metadata: every `csd.` key but the format's and the checksum mark."""
    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_MARK

    return {key: value for key, value in metadata.items()
            if key.startswith(b"csd.") and key not in FORMAT_METADATA and key not in PAGE_CHECKSUM_MARK}


def teacher_topk_schema(k: int, encoding: str, selector_metadata: dict | None = None):
    """The Arrow schema (version 2) of a teacher top-k shard with at most `k` entries per position.

    The schema metadata records the schema name and version, k, the encoding name, the keys the store's
    selectors declare (`selector_metadata`, `SelectorChain.metadata()`, ordered as `SELECTOR_METADATA` says; the
    reader checks them against the manifest) and that the pages carry checksums
    (`csd.page_checksum`, csd_pipeline/runtime/integrity.py).
    """
    import pyarrow as pa

    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_MARK

    selector_metadata = {b"csd.top_p": b"", **(selector_metadata or {})}
    ordered = [key for key in SELECTOR_METADATA if key in selector_metadata]
    ordered += [key for key in selector_metadata if key not in SELECTOR_METADATA]
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
        **{key: selector_metadata[key] for key in ordered},
        **PAGE_CHECKSUM_MARK,
    }
    return pa.schema(fields, metadata=metadata)
