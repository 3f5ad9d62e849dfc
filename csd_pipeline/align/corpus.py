"""Corpus readers with stable document identities.

Inputs are `.txt`, `.jsonl`, `.json` and `.parquet` files, or directories of them (walked
recursively, sorted, hidden entries skipped). Every document is identified by `(source,
record_index)`: `source` is the path as given (plus the path inside a given directory, with `/`),
`record_index` the line (jsonl), block (`.txt` with blank-line splitting), element (json) or row
(parquet) index in that file, counted over every record, rejected ones included. Identities do not
depend on worker counts or ranks.

Reading never stops at a bad record; it yields a `Document` whose `reason` says why it has no
text. Reasons: `invalid_utf8`, `broken_json`, `record_not_object`, `missing_text_field`,
`text_not_string`, `lone_surrogate`, `blank_line` (an empty line inside a jsonl file).

Choices:
- `.txt` is decoded as strict UTF-8; a document with invalid bytes is rejected (`invalid_utf8`)
  rather than changed by a replacement character. A BOM at the very start of a file is an encoding
  mark and is removed; a BOM anywhere else is text.
- `--split-on-blank-lines`: a document is a maximal run of non-blank lines (a blank line holds only
  ASCII whitespace), taken byte-exactly from the start of its first line to the end of its last line
  (without that line's `\\n`). Runs of blank lines separate documents and are not documents.
- `.jsonl` is read line by line with `json.loads`; `.json` is a JSON array of records (or an object
  holding the text field, or columns), and falls back to JSON lines when it is not one JSON value.
- `.parquet` is read with pyarrow, one row group at a time.

Work is split into shards by `plan_shards`: records in input order are cut into consecutive
segments of about `target_bytes` source bytes each, a pure function of the inputs.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

from csd_pipeline.errors import CsdError

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_READ_BLOCK = 8 << 20
_BLANK_RUN = re.compile(rb"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)*")
_WHITESPACE = b" \t\r\n\f\v"
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class CorpusFile:
    """One input file: where it is, how it is named in row ids, its format and fingerprint."""

    path: str  # absolute path
    source: str  # identity used in row ids: the path as given, plus the path inside a directory
    format: str  # "txt" | "jsonl" | "json" | "parquet"
    size: int
    mtime_ns: int

    def fingerprint(self) -> dict:
        """What a re-run must find unchanged."""
        return {"source": self.source, "size": self.size, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents."""

    text_field: str = "text"
    split_on_blank_lines: bool = False
    whole_record: bool = False  # chat mode: a document's text is its whole record as JSON (messages, tools)


@dataclass(frozen=True)
class Document:
    """A document's identity and text, or the reason it has none."""

    source: str
    record_index: int
    text: str | None
    reason: str | None = None


# ---------------------------------------------------------------------------------------------
# Discovery


def discover(paths) -> list[CorpusFile]:
    """Expand corpus paths (files or directories) into a sorted, de-duplicated list of files.

    Raises `CsdError` for a path that does not exist, a file of an unsupported type or that is not a
    regular file (a FIFO would block), or a directory without any supported file.
    """
    if not paths:
        raise CsdError("no corpus given; pass at least one --corpus PATH (.txt, .jsonl, .json, .parquet or a directory).")
    found: dict[str, CorpusFile] = {}
    for arg in paths:
        given = Path(arg)
        shown = Path(os.path.normpath(str(arg))).as_posix()
        if not given.exists():
            raise CsdError(f"corpus path {arg} does not exist; check the path.")
        if given.is_dir():
            members = _walk(given)
            if not members:
                raise CsdError(f"corpus directory {arg} holds no {', '.join(SUFFIXES)} files; point --corpus at your data.")
            for member in members:
                _add(found, member, f"{shown}/{member.relative_to(given).as_posix()}")
        elif given.suffix.lower() in SUFFIXES:
            _add(found, given, shown)
        else:
            raise CsdError(f"corpus file {arg} has an unsupported type; use .txt, .jsonl, .json or .parquet.")
    return sorted(found.values(), key=lambda f: f.source)


def _walk(directory: Path) -> list[Path]:
    members = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and Path(name).suffix.lower() in SUFFIXES:
                members.append(Path(root) / name)
    return members


def _add(found: dict, path: Path, source: str) -> None:
    resolved = str(path.resolve())
    if resolved in found:
        return
    stat = path.stat()
    if not S_ISREG(stat.st_mode):  # a FIFO or device would block the planner or never end
        raise CsdError(f"corpus path {source} is not a regular file (a pipe, socket or device); save the text to a "
                       "file and pass that.")
    found[resolved] = CorpusFile(resolved, source, path.suffix.lower()[1:], stat.st_size, stat.st_mtime_ns)


# ---------------------------------------------------------------------------------------------
# Record boundaries (cheap scans used both for planning and for reading)


def _txt_blocks(handle, start: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes) of each blank-line-separated block, from offset `start` (a block start)."""
    handle.seek(start)
    carry_at, carry = start, b""
    while True:
        data = handle.read(_READ_BLOCK)
        eof = not data
        buf = carry + data
        pos = 0
        for match in _BLANK_RUN.finditer(buf):
            if not eof and match.end() == len(buf):
                break  # the blank run may continue in the next read
            piece = buf[pos:match.start()]
            if piece.strip(_WHITESPACE):
                yield carry_at + pos + _leading_blank_lines(piece), piece[_leading_blank_lines(piece):]
            pos = match.end()
        if eof:
            piece = buf[pos:]
            if piece.strip(_WHITESPACE):
                lead = _leading_blank_lines(piece)
                piece = piece[lead:]
                yield carry_at + pos + lead, _without_trailing_blank_lines(piece)
            return
        carry_at, carry = carry_at + pos, buf[pos:]


def _leading_blank_lines(piece: bytes) -> int:
    # Only the first block of a file can start with blank lines (the file's own first lines).
    lead = 0
    while True:
        newline = piece.find(b"\n", lead)
        if newline < 0 or piece[lead:newline].strip(_WHITESPACE):
            return lead
        lead = newline + 1


def _without_trailing_blank_lines(piece: bytes) -> bytes:
    # The last block of a file may end with blank lines that no further block follows.
    lines = piece.split(b"\n")
    while not lines[-1].strip(_WHITESPACE):
        lines.pop()
    return b"\n".join(lines)


def _lines(handle, start: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes without the newline) of each line from offset `start`."""
    handle.seek(start)
    offset = start
    for line in handle:
        yield offset, line[:-1] if line.endswith(b"\n") else line
        offset += len(line)


def _record_sizes(file: CorpusFile, options: ReadOptions) -> Iterator[tuple[int, int]]:
    """(byte offset, size) of each record of `file`, in order; offset -1 where there is no seek offset."""
    if file.format == "jsonl":
        with open(file.path, "rb") as handle:
            for offset, line in _lines(handle, 0):
                yield offset, len(line)
    elif file.format == "txt":
        if not options.split_on_blank_lines:
            yield 0, file.size
            return
        with open(file.path, "rb") as handle:
            for offset, block in _txt_blocks(handle, 0):
                yield offset, len(block)
    elif file.format == "json":
        for record in _json_records(file):
            yield -1, len(record) if isinstance(record, bytes) else _json_size(record, options)
    else:
        for count, size in _parquet_row_groups(file):
            for _ in range(count):
                yield -1, size


def _json_size(record, options: ReadOptions) -> int:
    if options.whole_record:
        return len(json.dumps(record, ensure_ascii=False, default=str))
    text = record.get(options.text_field) if isinstance(record, dict) else None
    return len(text) if isinstance(text, str) else 1


# ---------------------------------------------------------------------------------------------
# Planning


def plan_shards(files: list[CorpusFile], options: ReadOptions, target_bytes: int) -> list[list[dict]]:
    """Cut the records of `files` (in order) into shards of about `target_bytes` source bytes.

    Returns one list of segments per shard; a segment is a JSON dict
    {"file": index into `files`, "first": first record index, "count": records, "offset": byte
    offset of the first record (-1 where records are not seekable)}. A shard closes after the record
    that brings it to `target_bytes` or more; a record is never split.
    """
    if target_bytes < 1:
        raise CsdError(f"the shard size must be positive (got {target_bytes} bytes); pass a positive --shard-mb.")
    shards: list[list[dict]] = []
    current: list[dict] = []
    filled = 0
    for file_index, file in enumerate(files):
        segment = None
        for record_index, (offset, size) in enumerate(_record_sizes(file, options)):
            if segment is None:
                segment = {"file": file_index, "first": record_index, "count": 0, "offset": offset}
                current.append(segment)
            segment["count"] += 1
            filled += size
            if filled >= target_bytes:
                shards.append(current)
                current, filled, segment = [], 0, None
    if current:
        shards.append(current)
    return shards


# ---------------------------------------------------------------------------------------------
# Reading


def read_segment(file: CorpusFile, segment: dict, options: ReadOptions) -> Iterator[Document]:
    """Yield the documents of one segment (see `plan_shards`), in record order, rejected ones included."""
    first, count = segment["first"], segment["count"]
    if file.format in ("jsonl", "txt") and (file.format == "jsonl" or options.split_on_blank_lines):
        with open(file.path, "rb") as handle:
            records = _lines(handle, segment["offset"]) if file.format == "jsonl" else _txt_blocks(handle, segment["offset"])
            for i, (offset, raw) in enumerate(records):
                if i == count:
                    break
                if offset == 0 and raw.startswith(_BOM):
                    raw = raw[len(_BOM):]
                if file.format == "jsonl":
                    yield _jsonl_document(file.source, first + i, raw, options)
                else:
                    yield _text_document(file.source, first + i, raw)
    elif file.format == "txt":
        raw = Path(file.path).read_bytes()
        yield _text_document(file.source, 0, raw[len(_BOM):] if raw.startswith(_BOM) else raw)
    elif file.format == "json":
        for i, record in enumerate(_json_records(file)):
            if first <= i < first + count:
                if isinstance(record, bytes):
                    yield _jsonl_document(file.source, i, record, options)
                else:
                    yield _record_document(file.source, i, record, options)
    else:
        yield from _parquet_documents(file, first, count, options)


def _text_document(source: str, index: int, raw: bytes) -> Document:
    try:
        return Document(source, index, raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Document(source, index, None, "invalid_utf8")


def _jsonl_document(source: str, index: int, raw: bytes, options: ReadOptions) -> Document:
    if not raw.strip(_WHITESPACE):
        return Document(source, index, None, "blank_line")
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        return Document(source, index, None, "invalid_utf8")
    except ValueError:
        return Document(source, index, None, "broken_json")
    return _record_document(source, index, record, options)


def _record_document(source: str, index: int, record, options: ReadOptions) -> Document:
    if not isinstance(record, dict):
        return Document(source, index, None, "record_not_object")
    if options.whole_record:
        return _checked_text(source, index, json.dumps(record, ensure_ascii=False, default=str))
    if options.text_field not in record or record[options.text_field] is None:
        return Document(source, index, None, "missing_text_field")
    return _checked_text(source, index, record[options.text_field])


def _checked_text(source: str, index: int, text) -> Document:
    if not isinstance(text, str):
        return Document(source, index, None, "text_not_string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return Document(source, index, None, "lone_surrogate")
    return Document(source, index, text)


def _json_records(file: CorpusFile) -> list:
    """The records of a .json file: parsed objects, or raw lines (bytes) when it is JSON lines."""
    raw = Path(file.path).read_bytes()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        # Not one JSON value: read it as JSON lines, counting broken lines.
        return [line for line in raw.split(b"\n") if line.strip(_WHITESPACE)]
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        columns = [v for v in data.values() if isinstance(v, list)]
        if columns and all(len(c) == len(columns[0]) for c in columns) and not isinstance(data.get("text"), str):
            keys = [k for k, v in data.items() if isinstance(v, list)]
            return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]
        return [data]
    return [data]


def _parquet_file(file: CorpusFile):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(file.path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError on a damaged file
        raise CsdError(f"corpus file {file.source} is not a readable Parquet file ({err}); fix or remove it.") from None


def _parquet_row_groups(file: CorpusFile) -> list[tuple[int, int]]:
    """(rows, estimated bytes per row) of each row group."""
    meta = _parquet_file(file).metadata
    groups = []
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        groups.append((group.num_rows, max(1, group.total_byte_size // max(1, group.num_rows))))
    return groups


def _parquet_documents(file: CorpusFile, first: int, count: int, options: ReadOptions) -> Iterator[Document]:
    import pyarrow as pa

    parquet = _parquet_file(file)
    has_field = options.text_field in parquet.schema_arrow.names
    start = 0
    for group_index, (rows, _) in enumerate(_parquet_row_groups(file)):
        lo, hi = max(first, start), min(first + count, start + rows)
        if lo < hi:
            if options.whole_record:
                records = parquet.read_row_group(group_index).slice(lo - start, hi - lo).to_pylist()
                for offset, record in enumerate(records):
                    yield _record_document(file.source, lo + offset, record, options)
            elif not has_field:
                for i in range(lo, hi):
                    yield Document(file.source, i, None, "missing_text_field")
            else:
                column = parquet.read_row_group(group_index, columns=[options.text_field]).column(0)
                column = column.slice(lo - start, hi - lo)
                is_text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
                for offset, value in enumerate(column.to_pylist()):
                    i = lo + offset
                    if value is None:
                        yield Document(file.source, i, None, "missing_text_field")
                    elif not is_text:
                        yield Document(file.source, i, None, "text_not_string")
                    else:
                        yield _checked_text(file.source, i, value)
        start += rows
