"""The align stage's shard writer: one corpus segment list -> one Parquet file of aligned rows.

`AlignShardWriter(config, chat, tokenizers)(task, tmp_path)` reads the shard's documents in order,
aligns them in batches of about `config.batch_bytes` of text with the mode's aligner
(`text_mode.TextAligner`, `chat_mode.ChatAligner`, or `capture.CaptureAligner` for `--capture-only`;
`against_capture.py` brings its own) and writes Parquet row groups of a fixed
number of rows (zstd). Shard bytes depend only on the shard's documents and the config.

The writer is picklable: the executor sends a copy to each worker process (`--workers N`), which
loads its own tokenizers; in the stage's own process it uses the tokenizers the stage loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROW_GROUP_ROWS = 1024
COMPRESSION_LEVEL = 3


@dataclass
class AlignTokenizers:
    """The student's and every teacher's tokenizer (`vocab.TokenizerBundle`) of an align run."""

    student: object
    teachers: list

    @classmethod
    def load(cls, config) -> AlignTokenizers:
        """Load the tokenizers an `AlignConfig` names (fixture names resolved). Raises `CsdError`."""
        from csd_pipeline.fixtures.names import resolve_tokenizer_arg
        from csd_pipeline.vocab.vocabulary import load_tokenizer

        def load(arg: str):
            return load_tokenizer(resolve_tokenizer_arg(arg), trust_remote_code=config.trust_remote_code)

        student = load(config.student_tokenizer) if config.student_tokenizer else None  # None: a capture
        return cls(student, [load(t) for t in config.teacher_tokenizers])


class AlignShardWriter:
    """Writes one aligned shard (the executor's shard writer for the align stage).

    config: the `AlignConfig`; chat: the chat-mode record of `chat_mode.prepare_chat` (None in text
    mode); tokenizers: already loaded `AlignTokenizers`, or None to load them on first use.
    """

    def __init__(self, config, chat: dict | None = None, tokenizers: AlignTokenizers | None = None):
        self.config = config
        self.chat = chat
        self._tokenizers = tokenizers
        self._aligner = None

    def __getstate__(self) -> dict:
        # A copy for a worker process carries only plain values; the worker loads its own tokenizers.
        return {"config": self.config, "chat": self.chat}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"], state["chat"])

    def aligner(self):
        """The mode's aligner (`new_stats`, `align_documents`, `teachers`), built once."""
        if self._aligner is None:
            config = self.config
            tokenizers = self._tokenizers or AlignTokenizers.load(config)
            if config.capture_only:
                from csd_pipeline.align.capture import CaptureAligner

                self._aligner = CaptureAligner(tokenizers.teachers[0], config.teacher_limits()[0], config.context_token)
            elif self.chat:
                from csd_pipeline.align.chat_mode import make_chat_aligner

                settings = {"chat": self.chat, "max_student_tokens": config.max_student_tokens,
                            "max_teacher_tokens": config.teacher_limits()}
                self._aligner = make_chat_aligner(settings, tokenizers.student, tokenizers.teachers)
            else:
                from csd_pipeline.align.text_mode import TextAligner

                self._aligner = TextAligner(tokenizers.student, tokenizers.teachers, config.max_student_tokens,
                                             config.teacher_limits(), config.context_token)
        return self._aligner

    def __call__(self, task, tmp_path: Path):
        """Write shard `task` (its spec lists corpus segments) to `tmp_path`; returns a `ShardResult`."""
        return write_shard(task.spec["segments"], tmp_path, self.aligner(), self.config, whole_record=bool(self.chat))


def _documents(segments: list[dict], options, stats: dict):
    """The shard's documents in order; rejected and empty ones are counted in `stats`, not yielded."""
    from csd_pipeline.align.corpus import CorpusFile, read_segment
    from csd_pipeline.runtime import progress

    for segment in segments:
        file = CorpusFile.from_spec(segment)
        for document in read_segment(file, segment, options):
            stats["documents"]["read"] += 1
            progress.advance(1)
            if document.text is None:
                _count(stats["rejected_documents"], document.reason)
            elif not document.text:
                _count(stats["rejected_documents"], "empty")
            else:
                yield document


def _aligned_batches(documents, aligner, stats: dict, batch_bytes: int):
    """Arrow tables of aligned rows, one per batch of about `batch_bytes` of document text."""
    batch, size = [], 0
    for document in documents:
        batch.append(document)
        size += len(document.text)
        if size >= batch_bytes:
            yield aligner.align_documents(batch, stats)
            batch, size = [], 0
    if batch:
        yield aligner.align_documents(batch, stats)


def write_shard(segments: list[dict], tmp_path: Path, aligner, config, *, whole_record: bool = False):
    """Read the documents of `segments`, align them in batches and write one Parquet file to `tmp_path`.

    Row groups hold exactly `ROW_GROUP_ROWS` rows (the last one fewer), whatever the batch sizes, so
    the file's bytes do not depend on `config.batch_bytes`. Returns the executor's `ShardResult`.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from csd_pipeline.align.corpus import ReadOptions
    from csd_pipeline.runtime.executor import ShardResult
    from csd_pipeline.runtime.integrity import PARQUET_CHECKSUMS

    options = ReadOptions(config.text_field, config.split_on_blank_lines, whole_record=whole_record)
    stats = aligner.new_stats()
    rows = 0
    pending: list = []  # aligned tables not yet written: fewer than ROW_GROUP_ROWS rows in all
    with pq.ParquetWriter(str(tmp_path), aligner.schema, compression="zstd",
                          compression_level=COMPRESSION_LEVEL, write_statistics=False, store_schema=True,
                          **PARQUET_CHECKSUMS) as writer:
        for table in _aligned_batches(_documents(segments, options, stats), aligner, stats, config.batch_bytes):
            rows += len(table)
            pending.append(table)
            if sum(len(t) for t in pending) >= ROW_GROUP_ROWS:
                table = pa.concat_tables(pending)
                cut = (len(table) // ROW_GROUP_ROWS) * ROW_GROUP_ROWS
                for start in range(0, cut, ROW_GROUP_ROWS):
                    writer.write_table(table.slice(start, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
                pending = [table.slice(cut)] if cut < len(table) else []
        if pending:
            writer.write_table(pa.concat_tables(pending), row_group_size=ROW_GROUP_ROWS)
    return ShardResult(rows=rows, stats=stats)


def _count(counter: dict, key: str, amount: int = 1) -> None:
    counter[key] = counter.get(key, 0) + amount
