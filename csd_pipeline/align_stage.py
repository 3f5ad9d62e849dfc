"""The align stage (text mode): corpus -> aligned shards (schemas/aligned.py) in DIR.

`run_align(config)` loads the tokenizers, builds or copies the sub-token tables into
`DIR/tables/teacher{i}/`, plans the shards from the corpus (`corpus.plan_shards`) and hands them to
the shared executor. Each shard is written by `make_shard_processor`: documents are read in order,
tokenized in batches with `encode_batch_fast` (no offsets: spans come from token bytes; the student
once, each distinct teacher tokenizer once),
aligned with `alignment.align` (vectorised over the batch), cut into windows and written as
Parquet row groups of a fixed number of rows (zstd). Shard bytes depend only on the shard's
documents and the config.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from schemas.aligned import SCHEMA_VERSION, STAGE, ChunkStatus, aligned_schema, teacher_columns

ROW_GROUP_ROWS = 1024
COMPRESSION_LEVEL = 3


@dataclass
class AlignConfig:
    """Options of `csd-pipeline align` (text mode; chat mode in `chat_align.py`, docs/CHAT.md)."""

    corpus: list[str]
    student_tokenizer: str
    teacher_tokenizers: list[str]
    output: str
    mode: str = "text"
    max_student_tokens: int = 2048
    max_teacher_tokens: list[int] = field(default_factory=list)  # one per teacher, or one for all; empty: student's
    context_token: bool = True
    text_field: str = "text"
    split_on_blank_lines: bool = False
    shard_bytes: int = 4 << 20
    tables: list[tuple[str, str]] = field(default_factory=list)  # per teacher (student->teacher, teacher->student)
    batch_bytes: int = 1 << 20
    trust_remote_code: bool = False
    # chat mode (csd_pipeline/chat_align.py)
    student_chat_template: str | None = None
    teacher_chat_templates: list[str] = field(default_factory=list)  # once for all, or once per teacher
    include_thinking: bool = False
    alignment_regions: list[str] = field(default_factory=list)
    drop_first_assistant_chunk: list[int] = field(default_factory=list)  # teacher indices

    def validate(self) -> None:
        """Raise `CsdError` naming the option that is wrong."""
        from csd_pipeline.chat_align import chat_options

        if self.mode not in ("text", "chat"):
            raise CsdError(f"--mode {self.mode!r} is unknown; use --mode text or --mode chat.")
        if not self.teacher_tokenizers:
            raise CsdError("no teacher tokenizer given; pass --teacher-tokenizer at least once.")
        if self.max_student_tokens < 2:
            raise CsdError(f"--max-student-tokens {self.max_student_tokens} is too small; use at least 2.")
        if len(self.max_teacher_tokens) not in (0, 1, len(self.teacher_tokenizers)):
            raise CsdError(
                f"--max-teacher-tokens was given {len(self.max_teacher_tokens)} times for {len(self.teacher_tokenizers)} "
                "teachers; give it once (for all) or once per --teacher-tokenizer, in the same order."
            )
        if any(m < 2 for m in self.max_teacher_tokens):
            raise CsdError(f"--max-teacher-tokens {min(self.max_teacher_tokens)} is too small; use at least 2.")
        if self.tables and len(self.tables) != len(self.teacher_tokenizers):
            raise CsdError(
                f"--tables was given {len(self.tables)} times for {len(self.teacher_tokenizers)} teachers; give one "
                "S2T T2S pair per --teacher-tokenizer, in the same order, or none to build them."
            )
        if self.shard_bytes < 1 or self.batch_bytes < 1:
            raise CsdError("--shard-mb must be positive.")
        chat_options(self)

    def teacher_limits(self) -> list[int]:
        """The window limit of each teacher."""
        if not self.max_teacher_tokens:
            return [self.max_student_tokens] * len(self.teacher_tokenizers)
        if len(self.max_teacher_tokens) == 1:
            return self.max_teacher_tokens * len(self.teacher_tokenizers)
        return list(self.max_teacher_tokens)


# ---------------------------------------------------------------------------------------------
# Stage entry


def run_align(config: AlignConfig, *, rank: int | None = None, world_size: int | None = None, workers: int = 1, log=None):
    """Run (or resume) the align stage for this rank; returns the executor's `RunReport`.

    Raises `CsdError` for a bad option, a missing corpus path, an unsupported tokenizer, tables that
    do not match the tokenizers, or an output directory holding another run.
    """
    from csd_pipeline.corpus import ReadOptions, discover, plan_shards
    from csd_pipeline.executor import (
        ShardTask,
        StageRun,
        check_identity,
        check_or_record_run,
        read_run_record,
        resolve_rank,
        run_stage,
        shard_name,
    )
    from csd_pipeline.fixtures import resolve_tokenizer_arg

    config.validate()
    log = log or (lambda message: None)
    rank, world_size = resolve_rank(rank, world_size)
    if workers < 1:
        raise CsdError(f"--workers {workers} is not positive; pass --workers 1 or more.")
    files = discover(config.corpus)
    out = Path(config.output)
    if out.exists() and not out.is_dir():
        raise CsdError(f"--output {out} is a file; pass a directory.")
    student_path = resolve_tokenizer_arg(config.student_tokenizer)
    teacher_paths = [resolve_tokenizer_arg(t) for t in config.teacher_tokenizers]
    student = load_bundle(student_path, config.trust_remote_code)
    teachers = [load_bundle(t, config.trust_remote_code) for t in teacher_paths]
    limits = config.teacher_limits()
    identity = {
        "config": {
            "mode": config.mode,
            "max_student_tokens": config.max_student_tokens,
            "max_teacher_tokens": limits,
            "context_token": config.context_token,
            "text_field": config.text_field,
            "split_on_blank_lines": config.split_on_blank_lines,
            "shard_bytes": config.shard_bytes,
            "world_size": world_size,
        },
        "inputs": [f.fingerprint() for f in files],
        "tokenizers": {
            "student": _tokenizer_record(student, student_path, config.student_tokenizer),
            "teachers": [_tokenizer_record(t, p, a) for t, p, a in zip(teachers, teacher_paths, config.teacher_tokenizers)],
        },
    }
    chat = None
    if config.mode == "chat":
        from csd_pipeline.chat_align import prepare_chat

        chat = prepare_chat(config, student, teachers, files)
        identity["config"]["chat"] = chat
    options = ReadOptions(config.text_field, config.split_on_blank_lines, whole_record=chat is not None)
    check_identity(out, STAGE, identity)  # before anything is written into the directory
    tasks = _recorded_tasks(out, identity, read_run_record)
    if tasks is None:
        log_line(log, f"planning shards over {len(files)} corpus file(s)...")
        shards = plan_shards(files, options, config.shard_bytes)
        tasks = []
        for index, segments in enumerate(shards):
            spec = {"segments": [dict(seg, **_file_spec(files[seg["file"]])) for seg in segments]}
            for seg in spec["segments"]:
                seg.pop("file")
            tasks.append(ShardTask(index, shard_name(index % world_size, index), spec))
    run = StageRun(
        stage=STAGE,
        schema_version=SCHEMA_VERSION,
        output_dir=out,
        identity=identity,
        tasks=tasks,
        processor="csd_pipeline.align_stage:make_shard_processor",
        processor_config={
            "student": student_path,
            "teachers": teacher_paths,
            "text_field": config.text_field,
            "split_on_blank_lines": config.split_on_blank_lines,
            "max_student_tokens": config.max_student_tokens,
            "max_teacher_tokens": limits,
            "context_token": config.context_token,
            "batch_bytes": config.batch_bytes,
            "trust_remote_code": config.trust_remote_code,
            **({"chat": chat} if chat else {}),
        },
        extra={"tables": _table_records(student, teachers)},
    )
    out.mkdir(parents=True, exist_ok=True)
    check_or_record_run(run)
    _prepare_tables(out, config, student, teachers, log)
    return run_stage(run, rank=rank, world_size=world_size, workers=workers, log=log)


_BUNDLES: dict = {}


def load_bundle(path: str, trust_remote_code: bool = False):
    """`vocab.load_tokenizer`, cached per process (the stage and its in-process shard writer share it)."""
    from csd_pipeline.vocab import load_tokenizer

    key = (path, trust_remote_code, _mtime(path))
    if key not in _BUNDLES:
        _BUNDLES[key] = load_tokenizer(path, trust_remote_code=trust_remote_code)
    return _BUNDLES[key]


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def log_line(log, message: str) -> None:
    if log is not None:
        log(message)


def _tokenizer_record(bundle, path: str, arg: str) -> dict:
    vocab = bundle.vocab
    return {
        "fingerprint": vocab.fingerprint,
        "family": vocab.family,
        "context_token": vocab.context_token(),
        "dummy_prefix": vocab.dummy_prefix,
        "name": Path(arg).name if os.sep in arg else arg,
    }


def _file_spec(file) -> dict:
    return {"path": file.path, "source": file.source, "format": file.format}


def _recorded_tasks(out: Path, identity: dict, read_run_record):
    """The task list of an earlier run of the same identity in `out` (resume without re-planning)."""
    from csd_pipeline.executor import RUN_NAME, ShardTask

    if not (out / RUN_NAME).is_file():
        return None
    try:
        record = read_run_record(out)
    except CsdError:
        return None
    if record.get("identity") != identity:
        return None
    return [ShardTask(t["index"], t["name"], t["spec"]) for t in record["tasks"]]


TABLE_NAMES = ("student_to_teacher.safetensors", "teacher_to_student.safetensors")


def _table_records(student, teachers) -> list[dict]:
    """Where each teacher's tables live inside DIR, with the fingerprints they were made for."""
    return [{
        "teacher": i,
        "student_to_teacher": f"tables/teacher{i}/{TABLE_NAMES[0]}",
        "teacher_to_student": f"tables/teacher{i}/{TABLE_NAMES[1]}",
        "student_fingerprint": student.vocab.fingerprint,
        "teacher_fingerprint": teacher.vocab.fingerprint,
    } for i, teacher in enumerate(teachers)]


def _prepare_tables(out: Path, config: AlignConfig, student, teachers, log) -> None:
    """Copy (or build) each teacher's two tables into DIR/tables/teacher{i}/ unless already there."""
    from csd_pipeline.tables import build_table

    names = TABLE_NAMES
    for i, teacher in enumerate(teachers):
        folder = out / "tables" / f"teacher{i}"
        wanted = ((student.vocab.fingerprint, teacher.vocab.fingerprint), (teacher.vocab.fingerprint, student.vocab.fingerprint))
        for name, (source_fp, destination_fp), position in zip(names, wanted, (0, 1)):
            target = folder / name
            if target.is_file() and table_fingerprints(target) == (source_fp, destination_fp):
                continue
            if config.tables:
                given = config.tables[i][position]
                if table_fingerprints(given) != (source_fp, destination_fp):
                    direction = "student->teacher" if position == 0 else "teacher->student"
                    raise CsdError(
                        f"table {given} does not match the tokenizers of teacher {i} ({direction} expected: "
                        f"{config.student_tokenizer if position == 0 else config.teacher_tokenizers[i]} -> "
                        f"{config.teacher_tokenizers[i] if position == 0 else config.student_tokenizer}); pass the "
                        "right tables or omit --tables to build them."
                    )
                _copy_atomic(Path(given), target)
            else:
                log_line(log, f"building table {name} for teacher {i}...")
                source, destination = (student, teacher) if position == 0 else (teacher, student)
                folder.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f"{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")
                build_table(source, destination).save(tmp)
                os.replace(tmp, target)


def table_fingerprints(path) -> tuple[str, str]:
    """(source, destination) tokenizer fingerprints of a stored table, read from its header only.

    Raises `CsdError` (from `tables.load_table`) when the file is missing or not a table.
    """
    import json

    from safetensors import safe_open

    from csd_pipeline.tables import _META_KEY, load_table

    try:
        with safe_open(str(path), framework="numpy") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
        return meta["source"]["fingerprint"], meta["destination"]["fingerprint"]
    except Exception:
        table = load_table(path)  # raises the table module's one-sentence error
        return table.source_fingerprint, table.destination_fingerprint


def _copy_atomic(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


# ---------------------------------------------------------------------------------------------
# Shard processor (runs in the executor's worker processes)


def make_shard_processor(config: dict):
    """The executor factory: load the tokenizers once, return `process(task, tmp_path) -> ShardResult`."""
    student = load_bundle(config["student"], config["trust_remote_code"])
    teachers = [load_bundle(t, config["trust_remote_code"]) for t in config["teachers"]]
    if config.get("chat"):
        from csd_pipeline.chat_align import make_chat_aligner

        aligner = make_chat_aligner(config, student, teachers)
    else:
        aligner = BatchAligner(student, teachers, config["max_student_tokens"], config["max_teacher_tokens"],
                               config["context_token"])

    def process(task, tmp_path: Path):
        return write_shard(task.spec, tmp_path, aligner, config)

    return process


def write_shard(spec: dict, tmp_path: Path, aligner: BatchAligner, config: dict):
    """Read the shard's documents, align them in batches and write one Parquet file to `tmp_path`."""
    import pyarrow.parquet as pq

    from csd_pipeline.corpus import CorpusFile, ReadOptions, read_segment
    from csd_pipeline.executor import ShardResult

    options = ReadOptions(config["text_field"], config["split_on_blank_lines"], whole_record=bool(config.get("chat")))
    stats = aligner.new_stats()
    schema = aligned_schema(len(aligner.teachers))
    rows = 0
    pending: list = []
    pending_rows = 0
    with pq.ParquetWriter(str(tmp_path), schema, compression="zstd", compression_level=COMPRESSION_LEVEL,
                          write_statistics=False, store_schema=True) as writer:

        def flush(final: bool) -> None:
            nonlocal pending, pending_rows
            if not pending:
                return
            import pyarrow as pa

            table = pa.concat_tables(pending)
            cut = (len(table) // ROW_GROUP_ROWS) * ROW_GROUP_ROWS if not final else len(table)
            for start in range(0, cut, ROW_GROUP_ROWS):
                writer.write_table(table.slice(start, min(ROW_GROUP_ROWS, cut - start)), row_group_size=ROW_GROUP_ROWS)
            rest = table.slice(cut)
            pending, pending_rows = ([rest] if len(rest) else []), len(rest)

        batch, batch_bytes = [], 0
        for segment in spec["segments"]:
            file = CorpusFile(segment["path"], segment["source"], segment["format"], 0, 0)
            for document in read_segment(file, segment, options):
                stats["documents"]["read"] += 1
                if document.text is None:
                    _count(stats["rejected_documents"], document.reason)
                    continue
                if not document.text:
                    _count(stats["rejected_documents"], "empty")
                    continue
                batch.append(document)
                batch_bytes += len(document.text)
                if batch_bytes >= config["batch_bytes"]:
                    table = aligner.align_documents(batch, stats)
                    pending.append(table)
                    pending_rows += len(table)
                    rows += len(table)
                    batch, batch_bytes = [], 0
                    if pending_rows >= ROW_GROUP_ROWS:
                        flush(final=False)
        if batch:
            table = aligner.align_documents(batch, stats)
            pending.append(table)
            rows += len(table)
        flush(final=True)
    return ShardResult(rows=rows, stats=stats)


def _count(counter: dict, key: str, amount: int = 1) -> None:
    counter[key] = counter.get(key, 0) + amount


class BatchAligner:
    """Tokenizes, aligns and windows a batch of documents into an Arrow table of aligned rows."""

    def __init__(self, student, teachers, max_student: int, max_teachers: list[int], context_token: bool):
        self.student = student
        self.teachers = teachers
        self.max_student = max_student
        self.max_teachers = list(max_teachers)
        # One encoding per distinct tokenizer: a teacher identical to the student (or to an earlier
        # teacher) reuses its token spans.
        fingerprints = [student.vocab.fingerprint]
        self.side_of_teacher = []
        self.bundles = [student]
        for teacher in teachers:
            fp = teacher.vocab.fingerprint
            if fp not in fingerprints:
                fingerprints.append(fp)
                self.bundles.append(teacher)
            self.side_of_teacher.append(fingerprints.index(fp))
        self.context = [b.vocab.context_token() if context_token else None for b in [student, *teachers]]
        for bundle in self.bundles:
            if not getattr(bundle.tokenizer, "encode_special_tokens", False):
                raise CsdError(f"tokenizer {bundle.source} would parse special tokens from corpus text; "
                               "load it with csd_pipeline.vocab.load_tokenizer.")
        self.schema = aligned_schema(len(teachers))

    def new_stats(self) -> dict:
        """Counters of one shard (summed across shards by the executor)."""
        stats = {
            "documents": {"read": 0, "aligned": 0, "with_rejected_regions": 0},
            "rejected_documents": {},
            "rejected_regions": {"chunk_longer_than_window": 0},
            "rejected_region_bytes": 0,
            "windows": 0,
            "bytes": {"documents": 0, "windows": 0},
            "tokens": {"student": 0, **{f"teacher{i}": 0 for i in range(len(self.teachers))}},
        }
        for i in range(len(self.teachers)):
            stats[f"teacher{i}"] = {
                "chunk_status": {s.name: 0 for s in ChunkStatus},
                "accepted_shapes": {"1:1": 0, "1:N": 0, "M:1": 0, "M:N": 0},
            }
        return stats

    def encode(self, bundle, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Content token ids of `texts` (no special tokens added or parsed): (flat ids, offsets per text)."""
        # Offsets are not needed (spans come from token bytes), so skip computing them where possible.
        encode = getattr(bundle.tokenizer, "encode_batch_fast", bundle.tokenizer.encode_batch)
        encodings = encode(texts, add_special_tokens=False)
        id_lists = [e.ids for e in encodings]
        counts = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
        offsets = np.zeros(len(id_lists) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.fromiter(chain.from_iterable(id_lists), dtype=np.int32, count=int(offsets[-1]))
        return ids, offsets

    def align_documents(self, documents: list, stats: dict):
        """Align a batch of non-empty documents; return their windows as an Arrow table (schema v1)."""
        from csd_pipeline.alignment import align, cut_windows, token_spans

        texts = [d.text for d in documents]
        encoded = [t.encode("utf-8") for t in texts]
        doc_bytes = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)), out=doc_bytes[1:])
        src = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        spans = []
        for bundle in self.bundles:
            ids, offsets = self.encode(bundle, texts)
            side = token_spans(bundle.vocab, ids, offsets, src, doc_bytes)
            inexact = np.flatnonzero(~side.exact).tolist()
            if inexact:
                # A normalizer changed these texts: take their ends from character offsets.
                for d, encoded_text in zip(inexact, bundle.encode_spans([texts[d] for d in inexact])):
                    side.set_ends(d, encoded_text.ends, doc_bytes)
            spans.append(side)
        student = spans[0]
        tables = [align(src, doc_bytes, student, spans[s]) for s in self.side_of_teacher]
        context = [c is not None for c in self.context]
        windows = cut_windows(src, doc_bytes, tables, self.max_student, self.max_teachers, context)
        self._count(stats, documents, doc_bytes, windows, tables)
        return self._rows(documents, src, doc_bytes, student, [spans[s] for s in self.side_of_teacher], tables, windows, stats)

    def _count(self, stats, documents, doc_bytes, windows, tables) -> None:
        aligned_docs = np.unique(windows.doc)
        stats["documents"]["aligned"] += int(aligned_docs.size)
        stats["documents"]["with_rejected_regions"] += int(len(windows.rejected_docs))
        unaligned = len(documents) - int(aligned_docs.size)
        if unaligned:
            _count(stats["rejected_documents"], "chunk_longer_than_window", unaligned)
        stats["rejected_regions"]["chunk_longer_than_window"] += windows.rejected_regions
        stats["rejected_region_bytes"] += windows.rejected_bytes
        stats["windows"] += len(windows.doc)
        stats["bytes"]["documents"] += int(doc_bytes[-1])
        stats["bytes"]["windows"] += int((windows.byte_range[:, 1] - windows.byte_range[:, 0]).sum())
        stats["tokens"]["student"] += int((windows.student_range[:, 1] - windows.student_range[:, 0]).sum())
        for i, _table in enumerate(tables):
            ranges = windows.teacher_ranges[i]
            stats["tokens"][f"teacher{i}"] += int((ranges[:, 1] - ranges[:, 0]).sum())

    def _rows(self, documents, src, doc_bytes, student, teacher_spans, tables, windows, stats):
        from csd_pipeline.alignment import ragged_arange

        lo, hi = windows.byte_range[:, 0], windows.byte_range[:, 1]
        docs = windows.doc.tolist()
        text = _string_array(src[ragged_arange(lo, hi - lo)], hi - lo)
        offsets, student_ids, content = _with_head(student.ids, windows.student_range, self.context[0])
        columns = {
            "row_id": _strings([f"{documents[d].source}:{documents[d].record_index}:{w}"
                                for d, w in zip(docs, windows.window_index.tolist())]),
            "text": text,
            "student_ids": _list_array(offsets, _array(student_ids, "int32")),
            "student_loss_mask": _list_array(offsets, _bool_array(content)),
        }
        for i, (side, table) in enumerate(zip(teacher_spans, tables)):
            ctx_s, ctx_t = self.context[0], self.context[1 + i]
            ids_col, len_s_col, len_t_col, status_col = teacher_columns(i)
            t_offsets, t_ids, _ = _with_head(side.ids, windows.teacher_ranges[i], ctx_t)
            columns[ids_col] = _list_array(t_offsets, _array(t_ids, "int32"))
            chunks = windows.chunk_ranges[i]
            head = ctx_s is not None or ctx_t is not None
            first_status = None if ctx_s is not None and ctx_t is not None else ChunkStatus.NO_PREDICTOR
            c_offsets, s_len, _ = _with_head(table.student_len, chunks, int(ctx_s is not None) if head else None)
            _, t_len, _ = _with_head(table.teacher_len, chunks, int(ctx_t is not None) if head else None)
            _, status, _ = _with_head(table.status, chunks, int(ChunkStatus.SPECIAL) if head else None,
                                      first_content=first_status)
            columns[len_s_col] = _list_array(c_offsets, _array(s_len, "int32"))
            columns[len_t_col] = _list_array(c_offsets, _array(t_len, "int32"))
            columns[status_col] = _list_array(c_offsets, _array(status, "uint8"))
            _count_chunks(stats[f"teacher{i}"], s_len, t_len, status)
        columns["source"] = _strings([documents[d].source for d in docs])
        columns["record_index"] = _array(np.fromiter((documents[d].record_index for d in docs), np.int64, len(docs)), "int64")
        columns["window_index"] = _array(windows.window_index, "int32")
        columns["byte_start"] = _array(lo - doc_bytes[windows.doc], "int64")
        import pyarrow as pa

        return pa.Table.from_arrays([columns[name] for name in self.schema.names], schema=self.schema)


def _count_chunks(counter: dict, s_len: np.ndarray, t_len: np.ndarray, status: np.ndarray) -> None:
    counts = np.bincount(status, minlength=len(ChunkStatus))
    for s in ChunkStatus:
        counter["chunk_status"][s.name] += int(counts[s])
    accepted = status == ChunkStatus.ACCEPTED
    key = (s_len[accepted] > 1).astype(np.int64) * 2 + (t_len[accepted] > 1)
    shapes = np.bincount(key, minlength=4)
    for k, name in enumerate(("1:1", "1:N", "M:1", "M:N")):
        counter["accepted_shapes"][name] += int(shapes[k])


def _with_head(values: np.ndarray, ranges: np.ndarray, head, *, first_content=None):
    """Rows `values[r0:r1]`, each prefixed by `head` (None: no prefix), as flat values with offsets.

    `first_content`: when given, replaces each row's first content value if it is ACCEPTED (used for
    NO_PREDICTOR). Returns (int32 offsets [W+1], flat values, bool mask of content positions).
    """
    from csd_pipeline.alignment import ragged_arange

    r0, r1 = ranges[:, 0], ranges[:, 1]
    extra = 0 if head is None else 1
    offsets = np.zeros(len(r0) + 1, dtype=np.int64)
    np.cumsum(r1 - r0 + extra, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise CsdError("a batch of windows holds 2**31 tokens; lower --batch-mb.")
    heads = offsets[:-1]
    if extra and len(values):
        out = values.take(ragged_arange(r0 - 1, r1 - r0 + 1))  # a head slot takes values[r0 - 1], then is overwritten
        out[heads] = head
    elif extra:
        out = np.full(len(r0), head, dtype=values.dtype)
    else:
        out = values.take(ragged_arange(r0, r1 - r0))
    content = np.ones(len(out), dtype=bool)
    content[heads] = not extra
    if first_content is not None:
        firsts = (heads + extra)[r1 > r0]
        firsts = firsts[out[firsts] == ChunkStatus.ACCEPTED]
        out[firsts] = first_content
    return offsets.astype(np.int32), out, content


# Arrow arrays are built from buffers: no per-value Python objects (and pyarrow's conversion of
# Python lists or numpy arrays would import pandas, a second of start-up in every worker).


def _array(values: np.ndarray, type_name: str):
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=np.dtype(type_name))
    return pa.Array.from_buffers(getattr(pa, type_name)(), len(values), [None, pa.py_buffer(values)])


def _bool_array(mask: np.ndarray):
    import pyarrow as pa

    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(np.packbits(mask, bitorder="little"))])


def _list_array(offsets: np.ndarray, child):
    import pyarrow as pa

    from schemas.aligned import list_of

    return pa.Array.from_buffers(list_of(child.type), len(offsets) - 1, [None, pa.py_buffer(offsets)], children=[child])


def _string_array(data: np.ndarray, lengths: np.ndarray):
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] >= 1 << 31:
        raise CsdError("a batch of windows holds 2 GiB of text; lower --batch-mb.")
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))


def _strings(values: list[str]):
    encoded = [v.encode("utf-8") for v in values]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    return _string_array(np.frombuffer(b"".join(encoded), dtype=np.uint8), lengths)
