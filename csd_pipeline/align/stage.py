"""The align stage: corpus -> aligned shards (schemas/aligned.py) and the tables, in DIR.

`AlignStage(config)` loads the tokenizers and checks the inputs, then declares what the shared
executor (`csd_pipeline.runtime.executor.run_stage`) needs:

- identity: the options in `RECORDED`, the corpus files' fingerprints and the tokenizers (with their
  vocabulary sizes, which teacher-logits reads);
- plan: the corpus cut into shards of about `config.shard_bytes` (`corpus.plan_shards`), shard i
  named for rank i % world size;
- prepare: each teacher's two sub-token tables, built or copied into `DIR/tables/teacher{i}/`;
- shard writer: `AlignShardWriter` (`shard_writer.py`).

`run_align(config)` runs it for this rank. With `--capture-only` the same stage writes a teacher capture
(no student, no tables; `capture.py`); with `--against-capture` it runs `against_capture.AgainstCaptureStage`
(docs/CAPTURE.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from csd_pipeline.align.config import AlignConfig
from csd_pipeline.align.shard_writer import AlignShardWriter, AlignTokenizers
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.executor import ShardTask, Stage, numbered_tasks, run_configured
from csd_pipeline.runtime.storage import location
from schemas.aligned import CAPTURE_KIND, SCHEMA_VERSION, STAGE

TABLE_NAMES = ("student_to_teacher.safetensors", "teacher_to_student.safetensors")
# The options that decide the aligned bytes, as the identity's "config" records them (and "chat" in chat mode).
RECORDED = ("mode", "max_student_tokens", "max_teacher_tokens", "context_token", "text_field", "split_on_blank_lines",
            "shard_bytes", "world_size")


def run_align(config: AlignConfig, *, rank: int | None = None, world_size: int | None = None, workers: int = 1,
              engine=None, log=None, tokenizers: AlignTokenizers | None = None):
    """Run (or resume) the align stage for this rank; returns the executor's `RunReport`.

    engine: the `EngineConfig` (default: local). tokenizers: already loaded tokenizers of `config`
    (default: load them). Raises `CsdError` for a
    bad option, a missing corpus path, an unsupported tokenizer, tables that do not match the
    tokenizers, or an output directory holding another run.
    """
    def build():
        if config.against_capture:
            from csd_pipeline.align.against_capture import AgainstCaptureStage

            return AgainstCaptureStage(config, tokenizers)
        return AlignStage(config, tokenizers)

    return run_configured(config, build, rank=rank, world_size=world_size, workers=workers, engine=engine, log=log)


class AlignStage(Stage):
    """The align stage of one `AlignConfig`, its tokenizers loaded and its inputs checked (nothing written)."""

    name = STAGE
    schema_version = SCHEMA_VERSION
    work_unit = "doc"

    def __init__(self, config: AlignConfig, tokenizers: AlignTokenizers | None = None):
        from csd_pipeline.align.corpus import discover

        self.config = config
        self.output_dir = location(config.output)
        self.files = discover(config.corpus, config.split)
        if self.output_dir.exists() and not self.output_dir.is_dir():
            raise CsdError(f"--output {self.output_dir} is a file; pass a directory.")
        self.tokenizers = tokenizers or AlignTokenizers.load(config)
        self.chat = None
        if config.mode == "chat":
            from csd_pipeline.align.chat_mode import prepare_chat

            self.chat = prepare_chat(config, self.tokenizers.student, self.tokenizers.teachers, self.files)

    @property
    def recorded(self) -> tuple[str, ...]:
        return RECORDED + (("chat",) if self.chat is not None else ()) + (("kind",) if self.config.capture_only else ())

    def derived(self, world_size: int) -> dict:
        derived = {"max_teacher_tokens": self.config.teacher_limits(), "world_size": world_size, "chat": self.chat}
        if self.config.capture_only:  # no student: its window limit does not apply
            derived |= {"max_student_tokens": None, "kind": CAPTURE_KIND}
        return derived

    def sources(self) -> dict:
        config = self.config
        tokenizers = {"teachers": [_tokenizer_record(t, arg) for t, arg in zip(self.tokenizers.teachers,
                                                                              config.teacher_tokenizers)]}
        if self.tokenizers.student is not None:
            tokenizers = {"student": _tokenizer_record(self.tokenizers.student, config.student_tokenizer), **tokenizers}
        return {"inputs": [f.fingerprint() for f in self.files], "tokenizers": tokenizers}

    def plan(self, world_size: int, log) -> list[ShardTask]:
        from csd_pipeline.align.corpus import ReadOptions, plan_shards, segment_spec

        log(f"planning shards over {len(self.files)} corpus file(s)...")
        options = ReadOptions(self.config.text_field, self.config.split_on_blank_lines, whole_record=self.chat is not None)
        shards = plan_shards(self.files, options, self.config.shard_bytes)
        return numbered_tasks([{"segments": [segment_spec(self.files, s) for s in segments]} for segments in shards],
                              world_size)

    def manifest_extra(self) -> dict:
        """Where each teacher's tables live inside DIR, with the fingerprints they were made for (a capture: its
        kind and the teacher tokenizer as `--against-capture` loads it again, no tables)."""
        if self.config.capture_only:
            return {"kind": CAPTURE_KIND, "tables": [],
                    "capture_teacher_tokenizer": loadable_tokenizer_arg(self.config.teacher_tokenizers[0])}
        student = self.tokenizers.student.vocab.fingerprint
        return {"tables": [{
            "teacher": i,
            "student_to_teacher": f"tables/teacher{i}/{TABLE_NAMES[0]}",
            "teacher_to_student": f"tables/teacher{i}/{TABLE_NAMES[1]}",
            "student_fingerprint": student,
            "teacher_fingerprint": teacher.vocab.fingerprint,
        } for i, teacher in enumerate(self.tokenizers.teachers)]}

    def prepare(self, log) -> None:
        """Copy (or build) each teacher's two tables into DIR/tables/teacher{i}/ unless already there (a capture has none)."""
        if self.tokenizers.student is None:
            return
        for i, teacher in enumerate(self.tokenizers.teachers):
            for position in (0, 1):
                self._prepare_table(i, teacher, position, log)

    def _prepare_table(self, i: int, teacher, position: int, log) -> None:
        from csd_pipeline.vocab.tables import build_table, read_table_fingerprints

        config, student = self.config, self.tokenizers.student
        source, destination = (student, teacher) if position == 0 else (teacher, student)
        wanted = (source.vocab.fingerprint, destination.vocab.fingerprint)
        target = self.output_dir / "tables" / f"teacher{i}" / TABLE_NAMES[position]
        if target.is_file() and read_table_fingerprints(target) == wanted:
            return
        if config.tables:
            given = config.tables[i][position]
            if read_table_fingerprints(given) != wanted:
                direction = "student->teacher" if position == 0 else "teacher->student"
                names = (config.student_tokenizer, config.teacher_tokenizers[i])
                raise CsdError(
                    f"table {given} does not match the tokenizers of teacher {i} ({direction} expected: "
                    f"{names[position]} -> {names[1 - position]}); pass the right tables or omit --tables to build them."
                )
            _copy_table(given, target)
        else:
            log(f"building table {TABLE_NAMES[position]} for teacher {i}...")
            build_table(source, destination).save(target)

    def check_recorded(self, tasks: list[ShardTask]) -> None:
        """An edited DIR/run.json may not name shards outside DIR or read files that are not --corpus files."""
        from csd_pipeline.runtime.safe_paths import check_recorded_tasks

        check_recorded_tasks(tasks, {f.path for f in self.files}, self.output_dir)

    def shard_writer(self) -> AlignShardWriter:
        return AlignShardWriter(self.config, self.chat, self.tokenizers)

    def work(self, spec: dict) -> int:
        """The shard's documents (records or blank-line blocks): the writer advances the bar by each one read."""
        return sum(segment["count"] for segment in spec["segments"])


def _copy_table(given, target: Path) -> None:
    """Copy a --tables file into DIR atomically; a failed copy (disk full) leaves nothing and is one line."""
    from csd_pipeline.runtime.files import atomic_copy
    from csd_pipeline.runtime.io_errors import reason_and_advice

    try:
        atomic_copy(given, target)
    except OSError as err:
        reason, advice = reason_and_advice(err)
        raise CsdError(f"copying table {given} into {target.parent} failed ({reason}); {advice}, then re-run the "
                       "same command (it resumes)") from None


def loadable_tokenizer_arg(arg: str) -> str:
    """`arg` as a later process loads it again: an existing path made absolute, a fixture or hub name as given."""
    path = Path(arg)
    return str(path.resolve()) if path.exists() else arg


def _tokenizer_record(bundle, arg: str) -> dict:
    vocab = bundle.vocab
    return {
        "fingerprint": vocab.fingerprint,
        "size": vocab.size,
        "family": vocab.family,
        "context_token": vocab.context_token(),
        "dummy_prefix": vocab.dummy_prefix,
        "name": Path(arg).name if os.sep in arg else arg,
    }
