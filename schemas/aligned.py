"""Aligned shards: the declared Arrow schemas (aligned version 1, capture version 1) and the chunk status codes.

One row is one window of one source document (SPEC §8). Columns:

| column | type | meaning |
|---|---|---|
| `row_id` | string | `"{source}:{record_index}:{window_index}"`, stable across re-runs and worker counts |
| `text` | string | the window's source text (UTF-8), exactly the bytes the content tokens cover |
| `student_ids` | list<int32> | what the student is fed: the context token, then the content tokens |
| `student_loss_mask` | list<bool> | tokens the student is trained on (every content token in text mode) |
| `teacher{i}_ids` | list<int32> | what teacher i is fed (its own context token, then content tokens) |
| `teacher{i}_chunk_student_len` | list<int32> | chunk c covers this many student tokens ... |
| `teacher{i}_chunk_teacher_len` | list<int32> | ... and this many teacher tokens |
| `teacher{i}_chunk_status` | list<uint8> | a `ChunkStatus` code per chunk |
| `source` | string | the corpus file the document came from (as given, plus the path inside a directory) |
| `record_index` | int64 | the document's index in that file (line, block, row) |
| `window_index` | int32 | the window's index within the document |
| `byte_start` | int64 | where the window starts in the document's UTF-8 bytes |

The chunks of a row cover every token of both sides in order: chunk c covers student tokens
`[s0, s0 + M)` and teacher tokens `[t0, t0 + N)`, where `s0`/`t0` are the running sums of the earlier
chunks' lengths. Every row starts with the pair of context tokens as one 1:1 chunk with status
`SPECIAL` (unless the align stage ran with `--no-context-token`).

**Capture variant** (`csd-pipeline align --capture-only`, manifest `"kind": "capture"`; shard metadata
`csd.schema` = `aligned-capture`, `csd.schema_version` = `CAPTURE_SCHEMA_VERSION`): windows cut by one
teacher's tokenization alone, with no student. Columns `row_id`, `text`, `teacher0_ids`, `source`,
`record_index`, `window_index`, `byte_start`, as above; no student columns and no chunk columns.
`teacher-logits` reads it like any aligned output. `csd-pipeline align --against-capture DIR` writes, for
a student, an aligned output (version 1) co-partitioned with the capture whose `teacher0_ids` are the
capture's; a chunk cut by a window edge there has the status `CAPTURE_EDGE` (docs/CAPTURE.md).
"""

from __future__ import annotations

from enum import IntEnum

SCHEMA_VERSION = 1
CAPTURE_SCHEMA_VERSION = 1
STAGE = "align"
CAPTURE_KIND = "capture"  # the manifest's "kind" of a capture (absent: an aligned output)
CAPTURE_COLUMNS = ("row_id", "text", "teacher0_ids", "source", "record_index", "window_index", "byte_start")


class ChunkStatus(IntEnum):
    """Why a chunk is (or is not) a CSD event. Only `ACCEPTED` chunks enter the KD loss."""

    ACCEPTED = 0
    """Both token runs spell exactly the chunk's source bytes, and both have a predictor position."""
    SPECIAL = 1
    """Special tokens only (the context tokens at the start of a row); never content."""
    NO_PREDICTOR = 2
    """The first chunk of a row when a side has no context token before it (`--no-context-token`)."""
    WHITESPACE_GAP_WITHOUT_SOURCE = 3
    """The two runs differ from the source only in whitespace that the source does not confirm
    (a tokenizer added or dropped whitespace at a boundary taken from character offsets)."""
    MISMATCH = 4
    """A run spells other bytes than the source (a normalizer changed the text, `<unk>`, ...)."""
    OUTSIDE_LOSS_REGION = 5
    """Chat mode: the chunk lies outside the final assistant message (context, not trained on)."""
    UNTRUSTED_TOKEN = 6
    """A run holds an added or special token whose text does not round-trip, so it has no spelling."""
    DUMMY_PREFIX = 7
    """SentencePiece: the first chunk of a document, whose first token carries the tokenizer's
    dummy-prefix space. Kept for cross-entropy, excluded from KD."""
    TOO_LONG = 8
    """Reserved: a chunk longer than a window limit. The align stage never writes it; it drops
    such a window region and counts it as the rejection `chunk_longer_than_window`."""
    CAPTURE_EDGE = 9
    """Aligned against a capture (`--against-capture`): the chunk is cut by the capture's window edge (the
    student has no token boundary there). It holds the window's teacher tokens of the chunk and the student
    tokens wholly inside the window (maybe none); the student token across the edge is in no row. Not an event."""


SHAPES = ("1:1", "1:N", "M:1", "M:N")
"""The shape classes of a chunk (student tokens : teacher tokens), in the order every count uses."""


def shape_name(student_len: int, teacher_len: int) -> str:
    """The shape class of a chunk with `student_len` student and `teacher_len` teacher tokens."""
    return SHAPES[2 * (student_len != 1) + (teacher_len != 1)]


def teacher_columns(i: int) -> tuple[str, str, str, str]:
    """Column names of teacher `i`: ids, chunk student lengths, chunk teacher lengths, statuses."""
    return (
        f"teacher{i}_ids",
        f"teacher{i}_chunk_student_len",
        f"teacher{i}_chunk_teacher_len",
        f"teacher{i}_chunk_status",
    )


def list_of(value_type):
    """A list type whose child is named `element`, as Parquet stores lists, so that the schema read
    back from a shard equals the declared one."""
    import pyarrow as pa

    return pa.list_(pa.field("element", value_type))


def aligned_schema(num_teachers: int):
    """The Arrow schema (version 1) of aligned shards with `num_teachers` teachers.

    Raises ValueError when `num_teachers` < 1.
    """
    import pyarrow as pa

    if num_teachers < 1:
        raise ValueError(f"an aligned shard needs at least one teacher, got {num_teachers}")
    fields = [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("student_ids", list_of(pa.int32()), nullable=False),
        pa.field("student_loss_mask", list_of(pa.bool_()), nullable=False),
    ]
    for i in range(num_teachers):
        ids, student_len, teacher_len, status = teacher_columns(i)
        fields += [
            pa.field(ids, list_of(pa.int32()), nullable=False),
            pa.field(student_len, list_of(pa.int32()), nullable=False),
            pa.field(teacher_len, list_of(pa.int32()), nullable=False),
            pa.field(status, list_of(pa.uint8()), nullable=False),
        ]
    fields += [
        pa.field("source", pa.string(), nullable=False),
        pa.field("record_index", pa.int64(), nullable=False),
        pa.field("window_index", pa.int32(), nullable=False),
        pa.field("byte_start", pa.int64(), nullable=False),
    ]
    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_MARK

    metadata = {b"csd.schema": b"aligned", b"csd.schema_version": str(SCHEMA_VERSION).encode(), **PAGE_CHECKSUM_MARK}
    return pa.schema(fields, metadata=metadata)



def capture_schema():
    """The Arrow schema (capture version 1) of a teacher capture's shards: `CAPTURE_COLUMNS`, no student."""
    import pyarrow as pa

    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_MARK

    full = aligned_schema(1)
    metadata = {b"csd.schema": b"aligned-capture", b"csd.schema_version": str(CAPTURE_SCHEMA_VERSION).encode(),
                **PAGE_CHECKSUM_MARK}
    return pa.schema([full.field(name) for name in CAPTURE_COLUMNS], metadata=metadata)
