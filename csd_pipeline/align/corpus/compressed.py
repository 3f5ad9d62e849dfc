"""Compressed files: `.jsonl.zst`, `.json.zst`, `.txt.zst` (zstandard) and the same with `.gz` (zlib).

They are decompressed as a stream, a few hundred KB at a time, never whole. A compressed file
cannot be entered at a byte offset of its records, only at the start of one of its frames (zstd
frames, gzip members; `pzstd` writes many, and so does `cat a.zst b.zst > ab.zst`). So a record's
position is a restart point: `offset`, the compressed byte offset of the frame its first byte was
decompressed from, and `skip`, the decompressed bytes from that frame's start to the record. A
segment is decompressed from its restart point, `skip` bytes are thrown away, then its records are
read. `plan.plan_shards` bounds the thrown-away work (at most `MAX_SHARDS_PER_REGION` shards start
inside one frame).

Records inside follow the plain rules of `files.py`: jsonl lines, txt blocks (or one document per
file), and for `.json.*` either one JSON array of records (read element by element) or JSON lines
(non-blank lines), decided by the planning scan and carried in the segment as `layout`. A single
top-level JSON object is read from a plain `.json` only (in a compressed one it is JSON lines).

A file that ends inside a frame (truncated) or does not decompress (damaged) stops the run with one
`CsdError` naming the file, where it breaks, how many complete records come before the break, and
what to do; planning reads every file whole, so this happens before anything is written.
"""

from __future__ import annotations

import codecs
import io
import json
import re
import zlib
from collections.abc import Iterator

from csd_pipeline.align.corpus.documents import (
    BOM,
    WHITESPACE,
    CorpusFile,
    Document,
    ReadOptions,
    jsonl_document,
    record_document,
    record_size,
    text_document,
)
from csd_pipeline.align.corpus.files import lines, scanned_documents, txt_blocks
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import open_input

SUFFIXES = {".zst": "zst", ".gz": "gz"}
RECORD_SUFFIXES = (".txt", ".jsonl", ".json")
_COMPRESSED_READ = 1 << 16  # small reads bound what one decompress call returns
_TOOLS = {"zst": "zstd", "gz": "gzip"}
_JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")
_MAX_JSON_VALUE = 1 << 30  # characters buffered for one array element before the file counts as not an array


class _Broken(Exception):
    """The compressed stream ends inside a frame (`truncated`) or does not decompress."""

    def __init__(self, truncated: bool, detail: str, produced: int):
        super().__init__(detail)
        self.truncated, self.detail, self.produced = truncated, detail, produced


class FrameStream(io.RawIOBase):
    """The decompressed bytes of a .zst / .gz file from the frame that starts at compressed `offset`.

    With `track`, keeps the frame starts it passed for `restart_point` (planning).
    Raises `_Broken` when the file ends inside a frame or its data does not decompress.
    """

    def __init__(self, file: CorpusFile, offset: int = 0, track: bool = False):
        super().__init__()
        self._compression = file.compression
        self._raw = open_input(file.path)
        self._raw.seek(offset)
        self._pending, self._pending_at = b"", offset  # compressed bytes not fed yet, and their offset
        self._decoder = None
        self._out, self._out_at = memoryview(b""), 0
        self.produced = 0  # decompressed bytes produced since `offset`
        self._frame_at = offset  # compressed offset of the current frame
        self._track = track
        self._frames = [(0, offset)]  # (decompressed start, compressed offset), increasing starts

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()

    def readinto(self, buffer) -> int:
        while self._out_at == len(self._out):
            piece = self._next_piece()
            if piece is None:
                return 0
            self._out, self._out_at = memoryview(piece), 0
        n = min(len(buffer), len(self._out) - self._out_at)
        buffer[:n] = self._out[self._out_at:self._out_at + n]
        self._out_at += n
        return n

    def skip(self, count: int) -> None:
        """Decompress and throw away `count` bytes."""
        while count:
            if self._out_at == len(self._out):
                piece = self._next_piece()
                if piece is None:
                    raise _Broken(True, f"it ends {count} bytes before a planned record", self.produced)
                self._out, self._out_at = memoryview(piece), 0
            n = min(count, len(self._out) - self._out_at)
            self._out_at += n
            count -= n

    def restart_point(self, position: int) -> tuple[int, int]:
        """(compressed frame offset, bytes to skip) to reach decompressed `position` (positions asked
        for must not decrease; earlier frame starts are forgotten)."""
        while len(self._frames) > 1 and self._frames[1][0] <= position:
            self._frames.pop(0)
        start, offset = self._frames[0]
        return offset, position - start

    def _next_piece(self) -> bytes | None:
        """The next decompressed bytes (maybe empty), or None at a clean end between frames."""
        while True:
            if self._decoder is None:
                if not self._pending:
                    self._pending_at = self._raw.tell()
                    self._pending = self._raw.read(_COMPRESSED_READ)
                    if not self._pending:
                        return None
                self._decoder, self._frame_at = _decoder(self._compression), self._pending_at
                if self._track and self._frames[-1][0] < self.produced:  # after an empty frame, the earlier one
                    self._frames.append((self.produced, self._pending_at))
            if not self._pending:
                self._pending_at = self._raw.tell()
                self._pending = self._raw.read(_COMPRESSED_READ)
                if not self._pending:
                    raise _Broken(True, f"the file ends inside the frame at compressed byte {self._frame_at}",
                                  self.produced)
            data, at = self._pending, self._pending_at
            try:
                piece = self._decoder.decompress(data)
            except Exception as err:  # zstandard.ZstdError, zlib.error
                raise _Broken(False, f"its data does not decompress near compressed byte {at} ({err})",
                              self.produced) from None
            self._pending = b""
            if self._decoder.eof:
                self._pending = self._decoder.unused_data
                self._pending_at = at + len(data) - len(self._pending)
                self._decoder = None
            self.produced += len(piece)
            if piece:
                return piece


def _decoder(compression: str):
    if compression == "gz":
        return zlib.decompressobj(wbits=31)
    try:
        import zstandard
    except ImportError:
        raise CsdError("reading .zst corpus files needs the zstandard package; pip install zstandard.") from None
    return zstandard.ZstdDecompressor().decompressobj()


def _broken_error(file: CorpusFile, broken: _Broken, records: int) -> CsdError:
    tool = _TOOLS[file.compression]
    what = "truncated" if broken.truncated else "damaged"
    return CsdError(
        f"corpus file {file.source} is {what}: {broken.detail}, after {broken.produced} decompressed bytes and "
        f"{records} complete records; re-create or re-download it (`{tool} -t FILE` checks a file), or pass what "
        f"decompresses (`{tool} -dc FILE > PLAIN`, its cut last record is then counted by reason)."
    )


# ---------------------------------------------------------------------------------------------
# Planning and reading


def record_positions(file: CorpusFile, options: ReadOptions) -> Iterator[tuple[dict, int]]:
    """(restart point {"offset", "skip"[, "layout"]}, size) of each record of `file`, in order.

    Raises `CsdError` for a truncated or damaged file (after the records before the break).
    """
    layout = _json_layout(file) if file.format == "json" else None
    count = 0
    try:
        with FrameStream(file, track=True) as stream:
            for position, size in _scan(stream, file.format, options, layout):
                offset, skip = stream.restart_point(position)
                yield ({"offset": offset, "skip": skip, "layout": layout} if layout else
                       {"offset": offset, "skip": skip}), size
                count += 1
    except _Broken as broken:
        raise _broken_error(file, broken, count) from None


def read_segment(file: CorpusFile, segment: dict, options: ReadOptions) -> Iterator[Document]:
    """Yield the documents of one segment of a compressed file, in record order, rejected ones included."""
    first, count, offset, skip = segment["first"], segment["count"], segment["offset"], segment["skip"]
    at_file_start = offset == 0 and skip == 0
    done = 0
    try:
        with FrameStream(file, offset) as stream:
            stream.skip(skip)
            for document in _documents(stream, file, first, count, options, segment.get("layout"), at_file_start):
                yield document
                done += 1
    except _Broken as broken:
        raise _broken_error(file, broken, first + done) from None


def _scan(stream: FrameStream, fmt: str, options: ReadOptions, layout: str | None) -> Iterator[tuple[int, int]]:
    """(decompressed position, planning size) of each record."""
    if fmt == "jsonl":
        for position, line in lines(_buffered(stream), 0):
            yield position, len(line)
    elif fmt == "txt" and options.split_on_blank_lines:
        for position, block in txt_blocks(_buffered(stream), 0):
            yield position, len(block)
    elif fmt == "txt":
        while stream.read(1 << 20):
            pass
        yield 0, stream.produced
    elif layout == "array":
        for position, record in _array_elements(stream, True):
            yield position, record_size(record, options)
    else:
        for position, line in _json_lines(stream, True):
            yield position, len(line)


def _documents(stream: FrameStream, file: CorpusFile, first: int, count: int, options: ReadOptions,
               layout: str | None, at_file_start: bool) -> Iterator[Document]:
    if file.format == "jsonl" or (file.format == "txt" and options.split_on_blank_lines):
        records = lines(_buffered(stream), 0) if file.format == "jsonl" else txt_blocks(_buffered(stream), 0)
        yield from scanned_documents(records, file.source, first, count, file.format, options, at_file_start)
    elif file.format == "txt":
        raw = stream.readall()
        yield text_document(file.source, 0, raw[len(BOM):] if raw.startswith(BOM) else raw)
    else:
        if layout == "array":
            records = ((position, record) for position, record in _array_elements(stream, at_file_start))
        else:
            records = _json_lines(stream, at_file_start)
        for i, (_, record) in enumerate(records):
            if i == count:
                break
            if isinstance(record, bytes):
                yield jsonl_document(file.source, first + i, record, options)
            else:
                yield record_document(file.source, first + i, record, options)


def _buffered(stream: FrameStream):
    # Full reads for the scanners: a raw stream returns one decompressed piece per read.
    return io.BufferedReader(stream, 1 << 20)


def _json_lines(stream: FrameStream, at_file_start: bool) -> Iterator[tuple[int, bytes]]:
    """(position, line) of each non-blank line, a BOM at the file's start removed (as a plain .json's)."""
    for position, line in lines(_buffered(stream), 0):
        if at_file_start and position == 0 and line.startswith(BOM):
            line = line[len(BOM):]
        if line.strip(WHITESPACE):
            yield position, line


# ---------------------------------------------------------------------------------------------
# JSON arrays, element by element


class _NotAnArray(Exception):
    """The decompressed file is not one JSON array (the planning scan then reads it as JSON lines)."""


def _json_layout(file: CorpusFile) -> str:
    """"array" when the whole decompressed file is one JSON array, else "lines" (one extra scan)."""
    try:
        with FrameStream(file) as stream:
            for _ in _array_elements(stream, True):
                pass
    except (_NotAnArray, _Broken):
        return "lines"  # a break is reported by the planning scan
    return "array"


class _ArrayText:
    """Decoded text of a stream with a cursor, and the decompressed byte position of the cursor."""

    def __init__(self, stream):
        self.stream, self.text, self.i, self.position, self.eof = stream, "", 0, 0, False
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()

    def more(self) -> bool:
        if self.eof:
            return False
        self.text, self.i = self.text[self.i:], 0
        if len(self.text) > _MAX_JSON_VALUE:
            raise _NotAnArray
        data = self.stream.read(max(1 << 20, len(self.text)))  # doubling: a long element is parsed O(1) times
        try:
            self.text += self.utf8.decode(data, final=not data)
        except UnicodeDecodeError:
            raise _NotAnArray from None
        self.eof = not data
        return bool(data)

    def advance(self, end: int) -> None:
        self.position += len(self.text[self.i:end].encode("utf-8"))
        self.i = end

    def peek(self) -> str:
        """The next character after JSON whitespace ("" at the end)."""
        while True:
            self.advance(_JSON_WHITESPACE.match(self.text, self.i).end())
            if self.i < len(self.text):
                return self.text[self.i]
            if not self.more():
                return ""

    def value(self):
        while True:
            try:
                value, end = self.decoder.raw_decode(self.text, self.i)
                if end < len(self.text) or not self.more():  # a number may go on in the next read
                    return value, end
            except json.JSONDecodeError:
                if not self.more():
                    raise _NotAnArray from None


def _array_elements(stream, at_file_start: bool) -> Iterator[tuple[int, object]]:
    """(decompressed position, value) of each element of a JSON array; from the file's start (BOM,
    `[`, and the end checked), or from an element's start (a segment). Raises `_NotAnArray`."""
    text = _ArrayText(stream)
    if at_file_start:
        text.more()
        if text.text.startswith("\ufeff"):
            text.advance(1)
        if text.peek() != "[":
            raise _NotAnArray
        text.advance(text.i + 1)
        if text.peek() == "]":
            text.advance(text.i + 1)
            if text.peek():
                raise _NotAnArray
            return
    while True:
        if not text.peek():
            raise _NotAnArray
        start = text.position
        value, end = text.value()
        text.advance(end)
        yield start, value
        separator = text.peek()
        text.advance(text.i + 1)
        if separator == "]":
            break
        if separator != ",":
            raise _NotAnArray
    if text.peek():
        raise _NotAnArray
