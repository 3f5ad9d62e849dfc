"""Plain files: `.txt`, `.jsonl`, `.json` and `.parquet`.

`.txt` and `.jsonl` records are found by cheap byte scans (`txt_blocks`, `lines`) that compressed
files share; a segment of either restarts at its first record's byte offset. `.json` and `.parquet`
records are counted by index (offset -1).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from csd_pipeline.align.corpus.documents import (
    BOM,
    WHITESPACE,
    CorpusFile,
    Document,
    ReadOptions,
    checked_text,
    jsonl_document,
    record_document,
    record_size,
    text_document,
)
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import location, open_input, parquet_source

READ_BLOCK = 8 << 20
_BLANK_RUN = re.compile(rb"\n[ \t\r\f\v]*\n(?:[ \t\r\f\v]*\n)*")


# ---------------------------------------------------------------------------------------------
# Record boundaries (cheap scans used both for planning and for reading)


def txt_blocks(handle, start: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes) of each blank-line-separated block of `handle`, read from its current
    position, which is offset `start` and a block start. `handle.read(n)` may return fewer bytes."""
    carry_at, carry = start, b""
    while True:
        data = handle.read(READ_BLOCK)
        eof = not data
        buf = carry + data
        pos = 0
        for match in _BLANK_RUN.finditer(buf):
            if not eof and match.end() == len(buf):
                break  # the blank run may continue in the next read
            piece = buf[pos:match.start()]
            if piece.strip(WHITESPACE):
                yield carry_at + pos + _leading_blank_lines(piece), piece[_leading_blank_lines(piece):]
            pos = match.end()
        if eof:
            piece = buf[pos:]
            if piece.strip(WHITESPACE):
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
        if newline < 0 or piece[lead:newline].strip(WHITESPACE):
            return lead
        lead = newline + 1


def _without_trailing_blank_lines(piece: bytes) -> bytes:
    # The last block of a file may end with blank lines that no further block follows.
    lines = piece.split(b"\n")
    while not lines[-1].strip(WHITESPACE):
        lines.pop()
    return b"\n".join(lines)


def lines(handle, start: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes without the newline) of each line of `handle` from its current position,
    which is offset `start`."""
    offset = start
    for line in handle:
        yield offset, line[:-1] if line.endswith(b"\n") else line
        offset += len(line)


def scanned_documents(records, source: str, first: int, count: int, fmt: str, options: ReadOptions,
                      bom_possible: bool) -> Iterator[Document]:
    """The documents of `count` scanned (offset, bytes) records of a txt (blocks) or jsonl file,
    numbered from `first`; a BOM is removed from a record at offset 0 when `bom_possible`."""
    for i, (offset, raw) in enumerate(records):
        if i == count:
            break
        if bom_possible and offset == 0 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if fmt == "jsonl":
            yield jsonl_document(source, first + i, raw, options)
        else:
            yield text_document(source, first + i, raw)


# ---------------------------------------------------------------------------------------------
# Planning and reading


def record_sizes(file: CorpusFile, options: ReadOptions) -> Iterator[tuple[int, int]]:
    """(byte offset, size) of each record of `file`, in order; offset -1 where there is no seek offset."""
    if file.format == "jsonl":
        with open_input(file.path) as handle:
            for offset, line in lines(handle, 0):
                yield offset, len(line)
    elif file.format == "txt":
        if not options.split_on_blank_lines:
            yield 0, file.size
            return
        with open_input(file.path) as handle:
            for offset, block in txt_blocks(handle, 0):
                yield offset, len(block)
    elif file.format == "json":
        for record in json_records(location(file.path).read_bytes()):
            yield -1, len(record) if isinstance(record, bytes) else record_size(record, options)
    else:
        for count, size in _parquet_row_groups(file):
            for _ in range(count):
                yield -1, size


def read_segment(file: CorpusFile, segment: dict, options: ReadOptions) -> Iterator[Document]:
    """Yield the documents of one segment of a plain file, in record order, rejected ones included."""
    first, count = segment["first"], segment["count"]
    if file.format == "jsonl" or (file.format == "txt" and options.split_on_blank_lines):
        with open_input(file.path) as handle:
            handle.seek(segment["offset"])
            records = lines(handle, segment["offset"]) if file.format == "jsonl" else txt_blocks(handle, segment["offset"])
            yield from scanned_documents(records, file.source, first, count, file.format, options, True)
    elif file.format == "txt":
        raw = location(file.path).read_bytes()
        yield text_document(file.source, 0, raw[len(BOM):] if raw.startswith(BOM) else raw)
    elif file.format == "json":
        for i, record in enumerate(json_records(location(file.path).read_bytes())):
            if first <= i < first + count:
                if isinstance(record, bytes):
                    yield jsonl_document(file.source, i, record, options)
                else:
                    yield record_document(file.source, i, record, options)
    else:
        yield from _parquet_documents(file, first, count, options)


def json_records(raw: bytes) -> list:
    """The records of a .json file's bytes: parsed objects, or raw lines (bytes) when it is JSON lines."""
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # Not one JSON value: read it as JSON lines, counting broken lines.
        return [line for line in raw.split(b"\n") if line.strip(WHITESPACE)]
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
        return pq.ParquetFile(parquet_source(file.path))
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
    parquet = _parquet_file(file)
    missing = not options.whole_record and options.text_field not in parquet.schema_arrow.names
    start = 0
    for group_index, (rows, _) in enumerate(_parquet_row_groups(file)):
        lo, hi = max(first, start), min(first + count, start + rows)
        if lo < hi and missing:
            yield from (Document(file.source, i, None, "missing_text_field") for i in range(lo, hi))
        elif lo < hi:
            columns = None if options.whole_record else [options.text_field]
            table = parquet.read_row_group(group_index, columns=columns).slice(lo - start, hi - lo)
            yield from table_documents(table, file.source, lo, options)
        start += rows


def table_documents(table, source: str, first: int, options: ReadOptions) -> Iterator[Document]:
    """The documents of the rows of an Arrow table numbered from `first` (Parquet, `datasets`)."""
    import pyarrow as pa

    if options.whole_record:
        for offset, record in enumerate(table.to_pylist()):
            yield record_document(source, first + offset, record, options)
        return
    if options.text_field not in table.column_names:
        for i in range(first, first + table.num_rows):
            yield Document(source, i, None, "missing_text_field")
        return
    column = table.column(options.text_field)
    is_text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    for offset, value in enumerate(column.to_pylist()):
        i = first + offset
        if value is None:
            yield Document(source, i, None, "missing_text_field")
        elif not is_text:
            yield Document(source, i, None, "text_not_string")
        else:
            yield checked_text(source, i, value)
