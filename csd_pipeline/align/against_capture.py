"""A student aligned against a teacher capture (`csd-pipeline align --against-capture CAPTURE --student-tokenizer S`).

The output is an aligned output (schema version 1) co-partitioned with the capture: the same shard names,
the same rows in the same order, each row's `teacher0_ids` exactly the capture row's, so the capture's
teacher-logits output trains this student (`TeacherTopkOutput.check_pairs_with` accepts it through the
manifest's `against_capture.manifest_sha256`). docs/CAPTURE.md is the user guide.

For each capture shard the writer re-reads the documents the capture read (the capture's `run.json`
segments; each corpus file must still have its recorded size, and every window's text and teacher ids are
checked against the capture row), encodes each whole document with the student and the teacher as align
does (`TextAligner.token_sides`) and chunks the two with `chunks.align`, the one chunking code. A capture
window `[lo, hi)` lies on teacher token boundaries; its teacher tokens are the capture row's, its student
tokens are those wholly inside it (`_student_range`), and its chunks are those of the whole document that
overlap it. A chunk that straddles `lo` or `hi` (the student has no token boundary there) keeps the
window's part of its teacher tokens and the student tokens wholly inside the window, with the status
`ChunkStatus.CAPTURE_EDGE` (never an event); the student token across the edge is in neither row. They are
counted in the stats under `capture_edges` by the edge that cuts them (`window_start`, `window_end`,
`window_start_and_end`), with `student_bytes_outside_rows`.
The chunks still cover every token of both sides in order, so the CE mask and every loss read the rows as
any other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from csd_pipeline.align.stage import RECORDED, AlignStage
from csd_pipeline.align.text_mode import TextAligner
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.executor import ShardTask
from schemas.aligned import CAPTURE_COLUMNS, CAPTURE_KIND, ChunkStatus

# CAPTURE_EDGE chunks by the window edge that cuts them (one chunk cut by both counts once, as the third), and
# the window bytes no student token of the row covers
EDGE_STATS = ("window_start", "window_end", "window_start_and_end", "student_bytes_outside_rows")


@dataclass
class WindowChunks:
    """The chunks of a batch's windows, laid end to end (what `TextAligner._rows` reads of a `ChunkTable`)."""

    student_len: np.ndarray
    teacher_len: np.ndarray
    status: np.ndarray


def open_capture(directory):
    """The `AlignedOutput` of a complete capture, its shards checked; `CsdError` for any other folder."""
    from csd_pipeline.align.output import AlignedOutput

    capture = AlignedOutput.open(directory)
    if capture.kind != CAPTURE_KIND:
        raise CsdError(f"--against-capture {directory} is an aligned output, not a capture; make one with "
                       "`csd-pipeline align --capture-only --teacher-tokenizer T --corpus ...`.")
    capture.verify()
    return capture


class AgainstCaptureStage(AlignStage):
    """The align stage of one student against a capture: its tokenizers loaded, the capture and corpus checked."""

    def __init__(self, config, tokenizers=None):
        from csd_pipeline.align.corpus import CorpusFile
        from csd_pipeline.align.shard_writer import AlignTokenizers
        from csd_pipeline.runtime.run_record import read_run_record
        from csd_pipeline.runtime.storage import location

        self.capture = open_capture(config.against_capture)
        manifest = self.capture.manifest
        recorded = manifest.get("config") or {}
        teacher_arg = config.teacher_tokenizers[0] if config.teacher_tokenizers else manifest.get("capture_teacher_tokenizer")
        if not isinstance(teacher_arg, str):
            raise CsdError(f"capture {self.capture.directory} does not record its teacher tokenizer; pass it with "
                           "--teacher-tokenizer.")
        # The capture decides how documents are read and whether rows start with a context token.
        self.config = replace(config, teacher_tokenizers=[teacher_arg], text_field=recorded.get("text_field", "text"),
                              split_on_blank_lines=bool(recorded.get("split_on_blank_lines", False)),
                              context_token=self.capture.context_token, max_teacher_tokens=[])
        self.output_dir = location(config.output)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise CsdError(f"--output {self.output_dir} is a file; pass a directory.")
        self.segments = {task["name"]: task["spec"]["segments"] for task in read_run_record(self.capture.directory)["tasks"]}
        self.files = list({s["path"]: CorpusFile.from_spec(s) for spec in self.segments.values() for s in spec}.values())
        self._check_corpus(manifest.get("inputs") or [])
        self.tokenizers = tokenizers or AlignTokenizers.load(self.config)
        self.chat = None
        self.capture.require_tokenizer(0, self.tokenizers.teachers[0].vocab.fingerprint)

    def _check_corpus(self, inputs: list) -> None:
        """Each local corpus file the capture read must still be there with its recorded size (every window's
        text is compared with the capture's as it is aligned)."""
        sizes = {record.get("source"): record.get("size") for record in inputs}
        for file in self.files:
            if file.format in ("hf", "dataset") or file.source not in sizes or "://" in file.path:
                continue  # a dataset or a remote file: its rows are checked as they are aligned
            size = os.path.getsize(file.path) if os.path.isfile(file.path) else None
            if size != sizes[file.source]:
                found = "is missing" if size is None else f"has {size} bytes, not the {sizes[file.source]} recorded"
                raise CsdError(f"corpus file {file.path} of capture {self.capture.directory} {found}; restore it, or "
                               "capture again with `csd-pipeline align --capture-only`.")

    @property
    def recorded(self) -> tuple[str, ...]:
        return RECORDED

    def derived(self, world_size: int) -> dict:
        recorded = self.capture.manifest.get("config") or {}
        return {"max_teacher_tokens": recorded.get("max_teacher_tokens"), "shard_bytes": recorded.get("shard_bytes"),
                "world_size": recorded.get("world_size"), "mode": "text"}

    def sources(self) -> dict:
        from csd_pipeline.align.stage import _tokenizer_record

        manifest = self.capture.manifest
        student = _tokenizer_record(self.tokenizers.student, self.config.student_tokenizer)
        return {"inputs": manifest.get("inputs") or [],
                "tokenizers": {"student": student, "teachers": manifest["tokenizers"]["teachers"]},
                "against_capture": {"manifest_sha256": self.capture.manifest_sha256(), "rows": self.capture.total_rows}}

    def manifest_extra(self) -> dict:
        return {**super().manifest_extra(), "against_capture_directory": str(self.capture.directory.resolve())}

    def plan(self, world_size: int, log) -> list[ShardTask]:
        """One task per capture shard, with its name and its documents (the segments the capture read)."""
        tasks = []
        for index, shard in enumerate(self.capture.shards):
            if shard.name not in self.segments:
                raise CsdError(f"capture {self.capture.directory} lists shard {shard.name} that its run.json does not "
                               "plan; the capture folder is damaged, capture again.")
            tasks.append(ShardTask(index, shard.name, {"capture_file": shard.file, "capture_sha256": shard.sha256,
                                                       "rows": shard.rows, "segments": self.segments[shard.name]}))
        return tasks

    def shard_writer(self):
        return AgainstCaptureWriter(self.config, self.tokenizers)


class AgainstCaptureWriter:
    """Writes the shard of one capture shard (the executor's shard writer); picklable like `AlignShardWriter`."""

    def __init__(self, config, tokenizers=None):
        self.config = config
        self._tokenizers = tokenizers

    def __getstate__(self) -> dict:
        return {"config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"])

    def __call__(self, task, tmp_path: Path):
        from csd_pipeline.align.shard_writer import AlignTokenizers, write_shard

        capture = open_capture(self.config.against_capture)
        shard = next((s for s in capture.shards if s.name == task.name), None)
        if shard is None or shard.sha256 != task.spec["capture_sha256"]:
            raise CsdError(f"capture shard {task.name} of {capture.directory} is missing or changed since this output "
                           "was started; align against the capture into a new --output.")
        tokenizers = self._tokenizers or AlignTokenizers.load(self.config)
        aligner = AgainstCaptureAligner(tokenizers.student, tokenizers.teachers[0], self.config.max_student_tokens,
                                        self.config.context_token)
        aligner.start_shard(capture.read(shard, list(CAPTURE_COLUMNS)), str(capture.shard_path(shard)))
        result = write_shard(task.spec["segments"], tmp_path, aligner, self.config)
        aligner.finish_shard()
        return result


class AgainstCaptureAligner(TextAligner):
    """A batch of documents -> the aligned rows of their capture windows (schema version 1, one teacher)."""

    def __init__(self, student, teacher, max_student: int, context_token: bool):
        super().__init__(student, [teacher], max_student, [1 << 30], context_token)
        self.capture = None

    def new_stats(self) -> dict:
        return {**super().new_stats(), "capture_edges": dict.fromkeys(EDGE_STATS, 0)}

    def start_shard(self, rows, where: str) -> None:
        """Take the capture shard's rows (Arrow, `CAPTURE_COLUMNS`); `where` names it in errors."""
        import pyarrow.compute as pc

        self.capture, self.where, self.next_row = rows, where, 0
        self.keys = list(zip(rows.column("source").to_pylist(), rows.column("record_index").to_pylist()))
        self.byte_start = rows.column("byte_start").to_numpy()
        self.text_bytes = pc.binary_length(rows.column("text").combine_chunks().cast("binary")).to_numpy()

    def finish_shard(self) -> None:
        """Raise `CsdError` unless every capture row was aligned (the corpus gave every captured document)."""
        if self.next_row != len(self.keys):
            source, record = self.keys[self.next_row]
            raise CsdError(f"capture row of {source}:{record} in {self.where} has no document in the corpus the capture "
                           "recorded (the corpus changed); restore it, or capture again.")

    def align_documents(self, documents: list, stats: dict):
        from csd_pipeline.align.capture import refuse_prompt_completion
        from csd_pipeline.align.chunks import align

        refuse_prompt_completion(documents, "--against-capture")
        src, doc_bytes, _, spans = self.token_sides(documents)
        student, teacher = spans[0], spans[self.side_of_teacher[0]]
        first, windows = self._capture_windows(documents, doc_bytes)
        table = align(src, doc_bytes, student, teacher)
        _teacher_range(windows, align(src, doc_bytes, teacher, teacher), self.where, self.keys[first:])
        bytes_outside = _student_range(windows, align(src, doc_bytes, student, student))
        chunks = _window_chunks(table, windows, stats["capture_edges"])
        stats["capture_edges"]["student_bytes_outside_rows"] += bytes_outside
        self._check_student_limit(windows, first)
        self._count(stats, documents, doc_bytes, windows, [table])
        rows = self._rows(documents, src, doc_bytes, student, [teacher], [chunks], windows, stats)
        self._check_rows(rows, first)
        return rows

    def _capture_windows(self, documents: list, doc_bytes: np.ndarray):
        """(index of the batch's first capture row, `Windows` of the capture rows of `documents`, in order)."""
        from csd_pipeline.align.chunks import Windows

        doc_of = {(d.source, d.record_index): i for i, d in enumerate(documents)}
        first = self.next_row
        while self.next_row < len(self.keys) and self.keys[self.next_row] in doc_of:
            self.next_row += 1
        picked = slice(first, self.next_row)
        doc = np.fromiter((doc_of[key] for key in self.keys[picked]), dtype=np.int64, count=self.next_row - first)
        lo = doc_bytes[doc] + self.byte_start[picked]
        hi = lo + self.text_bytes[picked]
        if (hi > doc_bytes[doc + 1]).any():
            bad = first + int(np.flatnonzero(hi > doc_bytes[doc + 1])[0])
            raise CsdError(f"capture row {self.capture.column('row_id')[bad]} of {self.where} reaches past its document's "
                           "end: the corpus changed since the capture; restore it, or capture again.")
        window_index = self.capture.column("window_index").to_numpy()[picked].astype(np.int32)
        empty = np.zeros((len(doc), 2), dtype=np.int64)
        return first, Windows(doc, window_index, np.stack([lo, hi], axis=1), empty.copy(), [empty.copy()], [empty.copy()],
                              0, 0, np.zeros(0, dtype=np.int64))

    def _check_student_limit(self, windows, first: int) -> None:
        counts = windows.student_range[:, 1] - windows.student_range[:, 0] + int(self.context[0] is not None)
        over = np.flatnonzero(counts > self.max_student)
        if over.size:
            row = self.capture.column("row_id")[first + int(over[0])]
            raise CsdError(f"capture row {row} of {self.where} holds {int(counts[over[0]])} student tokens, more than "
                           f"--max-student-tokens {self.max_student}; raise it, or capture with a smaller "
                           "--max-teacher-tokens.")

    def _check_rows(self, rows, first: int) -> None:
        """The rows must carry the capture rows' ids, text and teacher ids exactly (the teacher store's positions)."""
        captured = self.capture.slice(first, len(rows))
        for column in ("row_id", "text", "teacher0_ids", "byte_start"):
            if not rows.column(column).equals(captured.column(column)):
                ours, theirs = rows.column(column).to_pylist(), captured.column(column).to_pylist()
                row = next(i for i in range(len(rows)) if ours[i] != theirs[i])
                raise CsdError(f"capture row {captured.column('row_id')[row]} of {self.where}: the {column} of its window "
                               "differs from the capture's (the corpus or the teacher tokenizer changed since the "
                               "capture); restore them, or capture again.")


def _teacher_range(windows, teacher_self, where: str, keys: list) -> None:
    """Set each window's teacher token range, cut as the capture cut it (`cut_windows` over the teacher's
    chunks with itself); a window edge that is not a teacher boundary is a `CsdError`."""
    lo, hi = windows.byte_range[:, 0], windows.byte_range[:, 1]
    c0, c1 = np.searchsorted(teacher_self.bounds, lo), np.searchsorted(teacher_self.bounds, hi)
    inside = len(teacher_self.bounds) - 1
    off = (teacher_self.bounds[np.minimum(c0, inside)] != lo) | (teacher_self.bounds[np.minimum(c1, inside)] != hi)
    if off.any():
        source, record = keys[int(np.flatnonzero(off)[0])]
        raise CsdError(f"a capture window of {source}:{record} in {where} does not start and end on teacher token "
                       "boundaries: the corpus or teacher tokenizer changed since the capture; capture again.")
    windows.teacher_ranges[0][:] = np.stack([teacher_self.teacher_cut[c0], teacher_self.teacher_cut[c1]], axis=1)


def _student_range(windows, student_self) -> int:
    """Set each window's student token range: the tokens wholly inside it, cut as align cuts at a boundary
    (after the token that ends there). Returns the window bytes those tokens do not cover, summed."""
    lo, hi = windows.byte_range[:, 0], windows.byte_range[:, 1]
    bounds = student_self.bounds
    b0 = np.searchsorted(bounds, lo, side="left")
    b1 = np.maximum(np.searchsorted(bounds, hi, side="right") - 1, b0)  # a window inside one student token: none
    s0, s1 = student_self.student_cut[b0], student_self.student_cut[b1]
    windows.student_range[:] = np.stack([s0, np.maximum(s1, s0)], axis=1)
    covered = np.maximum(bounds[np.minimum(b1, len(bounds) - 1)] - bounds[b0], 0)
    return int((hi - lo - covered).sum())


def _window_chunks(table, windows, edges: dict) -> WindowChunks:
    """The chunks of the whole documents (`table`, a `ChunkTable`) that overlap each window, laid end to end;
    a chunk cut by a window edge keeps the window's tokens of both sides and the status CAPTURE_EDGE. Sets
    `windows.chunk_ranges[0]` (indices into the result) and counts edge chunks into `edges`."""
    from csd_pipeline.align.chunks import ragged_arange

    lo, hi = windows.byte_range[:, 0], windows.byte_range[:, 1]
    c0 = np.searchsorted(table.bounds, lo, side="right") - 1
    c1 = np.searchsorted(table.bounds, hi, side="left")
    count = c1 - c0
    offsets = np.zeros(len(lo) + 1, dtype=np.int64)
    np.cumsum(count, out=offsets[1:])
    index = ragged_arange(c0, count)
    firsts, lasts = offsets[:-1], offsets[1:] - 1
    cuts = []
    for cut, window_range in ((table.student_cut, windows.student_range), (table.teacher_cut, windows.teacher_ranges[0])):
        start, end = cut[index], cut[index + 1]
        start[firsts], end[lasts] = window_range[:, 0], window_range[:, 1]
        cuts.append(end - start)
    status = table.status[index].copy()
    at_start, at_end = table.bounds[c0] < lo, table.bounds[c1] > hi
    status[firsts[at_start]] = ChunkStatus.CAPTURE_EDGE
    status[lasts[at_end]] = ChunkStatus.CAPTURE_EDGE
    if (cuts[0] < 0).any() or (cuts[1] < 0).any():
        raise CsdError("a capture window's chunks have a negative token count (an alignment bug); report it with the "
                       "capture and the student tokenizer.")
    both = at_start & at_end & (count == 1)  # one chunk reaches over both edges of its window
    edges["window_start"] += int((at_start & ~both).sum())
    edges["window_end"] += int((at_end & ~both).sum())
    edges["window_start_and_end"] += int(both.sum())
    windows.chunk_ranges[0][:] = np.stack([offsets[:-1], offsets[1:]], axis=1)
    return WindowChunks(cuts[0], cuts[1], status)
