"""The align stage: corpus -> aligned shards (schemas/aligned.py) in DIR.

`run_align(config)` loads the tokenizers, checks that DIR holds no other run, plans the shards from
the corpus (`corpus.plan_shards`), builds or copies the sub-token tables into
`DIR/tables/teacher{i}/` and hands the shards to the shared executor. Each shard is written by
`make_shard_processor`: documents are read in order, aligned in batches by the mode's aligner
(`text_align.BatchAligner`, or `chat_align` in chat mode) and written as Parquet row groups of a
fixed number of rows (zstd). Shard bytes depend only on the shard's documents and the config.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

from csd_pipeline.errors import CsdError
from schemas.aligned import SCHEMA_VERSION, STAGE, aligned_schema

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
    # chat mode (csd_pipeline/align/chat_mode.py)
    student_chat_template: str | None = None
    teacher_chat_templates: list[str] = field(default_factory=list)  # once for all, or once per teacher
    include_thinking: bool = False
    alignment_regions: list[str] = field(default_factory=list)
    drop_first_assistant_chunk: list[int] = field(default_factory=list)  # teacher indices

    def validate(self) -> None:
        """Raise `CsdError` naming the option that is wrong."""
        from csd_pipeline.align.chat_mode import chat_options

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
    from csd_pipeline.align.corpus import ReadOptions, discover, plan_shards
    from csd_pipeline.runtime.executor import (
        ShardTask,
        StageRun,
        check_identity,
        check_or_record_run,
        read_run_record,
        resolve_rank,
        run_stage,
        shard_name,
    )
    from csd_pipeline.fixtures.names import resolve_tokenizer_arg

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
        from csd_pipeline.align.chat_mode import prepare_chat

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
        processor="csd_pipeline.align.stage:make_shard_processor",
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
        work=lambda spec: sum(segment["count"] for segment in spec["segments"]), work_unit="doc",
    )
    out.mkdir(parents=True, exist_ok=True)
    check_or_record_run(run)
    _prepare_tables(out, config, student, teachers, log)
    # log=None means quiet here; the executor's own default would print.
    return run_stage(run, rank=rank, world_size=world_size, workers=workers, log=log or (lambda message: None))


_BUNDLES: dict = {}


def load_bundle(path: str, trust_remote_code: bool = False):
    """`vocab.load_tokenizer`, cached per process (the stage and its in-process shard writer share it)."""
    from csd_pipeline.vocab.vocabulary import load_tokenizer

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
    from csd_pipeline.runtime.executor import RUN_NAME, ShardTask

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
    from csd_pipeline.vocab.tables import build_table

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
    """(source, destination) tokenizer fingerprints of a stored table (see `tables.read_table_fingerprints`)."""
    from csd_pipeline.vocab.tables import read_table_fingerprints

    return read_table_fingerprints(path)


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
        from csd_pipeline.align.chat_mode import make_chat_aligner

        aligner = make_chat_aligner(config, student, teachers)
    else:
        from csd_pipeline.align.text_mode import BatchAligner

        aligner = BatchAligner(student, teachers, config["max_student_tokens"], config["max_teacher_tokens"],
                               config["context_token"])

    def process(task, tmp_path: Path):
        return write_shard(task.spec, tmp_path, aligner, config)

    return process


def write_shard(spec: dict, tmp_path: Path, aligner, config: dict):
    """Read the shard's documents, align them in batches and write one Parquet file to `tmp_path`.

    `aligner` is a `text_align.BatchAligner` or a `chat_align` aligner (`new_stats`, `align_documents`,
    `teachers`).
    """
    import pyarrow.parquet as pq

    from csd_pipeline.align.corpus import CorpusFile, ReadOptions, read_segment
    from csd_pipeline.runtime import progress
    from csd_pipeline.runtime.executor import ShardResult

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
                progress.advance(1)
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
