"""`AlignConfig`: the options of `csd-pipeline align`, each with its one default and help text.

The click command (`cli/align.py`) builds its flags from these fields. Chat-mode options are
checked by `csd_pipeline.align.chat_mode.chat_options` (user guide: docs/CHAT.md); a teacher capture
(`--capture-only`) and a student aligned against one (`--against-capture`) by `check_capture_options`
(docs/CAPTURE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.options import MIB, option

MODES = ("text", "chat")


@dataclass(kw_only=True)
class AlignConfig:
    """Options of `csd-pipeline align` (see `option` help texts; byte sizes are bytes here, MiB on the command line)."""

    corpus: list[str] = option(
        [], "A .txt/.jsonl/.json/.parquet file (.txt/.jsonl/.json also as .zst or .gz), a datasets "
             "save_to_disk folder, hf:NAME[:CONFIG] (datasets.load_dataset, streamed), or a directory of "
             "them; repeatable (not with --against-capture, which re-reads the capture's).")
    student_tokenizer: str | None = option(
        None, "tokenizer.json, tokenizer folder, hub name or fixture name (not with --capture-only).")
    teacher_tokenizers: list[str] = option(
        [], "A teacher's tokenizer; repeat for several teachers (columns teacher0_*, teacher1_*, ...); with "
            "--against-capture, optional: the capture's, where it moved.")
    output: str = option(help="Output directory (resumable).")
    mode: str = option("text", "text: align the whole text; chat: render each model's chat template and align the "
                               "final assistant turn (docs/CHAT.md).", choices=MODES)
    max_student_tokens: int = option(2048, "Window limit of the student, context token included.")
    max_teacher_tokens: list[int] = option(
        [], "Window limit of the teachers, context token included: once for all, or once per teacher "
            "(default: --max-student-tokens).")
    context_token: bool = option(True, "Do not start each window with the BOS / document-separator token.")
    text_field: str = option("text", "The text field of .jsonl/.json/.parquet records.")
    split_on_blank_lines: bool = option(False, ".txt files: one document per blank-line-separated block.")
    split: str | None = option(
        None, "The split of a DatasetDict folder or an hf:NAME corpus (needed when it has several).")
    shard_bytes: int = option(4 * MIB, "Source text per output shard, in MiB.")
    tables: list[tuple[str, str]] = option(
        [], "S2T T2S: existing student->teacher and teacher->student tables, once per teacher in order "
            "(default: build them).")
    batch_bytes: int = option(MIB, "Text tokenized per encode_batch call, in MiB (memory vs speed; output is the same).")
    trust_remote_code: bool = option(False, "Allow a hub tokenizer's remote code (off by default).")
    # one teacher capture, many students (csd_pipeline/align/capture.py, against_capture.py; docs/CAPTURE.md)
    capture_only: bool = option(
        False, "Write a teacher capture: windows cut by the one --teacher-tokenizer alone, no student (run "
               "teacher-logits on it once, then align each student with --against-capture).")
    against_capture: str | None = option(
        None, "A capture folder (--capture-only): align --student-tokenizer against its windows and teacher ids, "
              "re-reading the corpus it recorded; its teacher-logits output then trains this student.")
    # chat mode (csd_pipeline/align/chat_mode.py)
    student_chat_template: str | None = option(
        None, "Chat mode: the student's template (.jinja, tokenizer_config.json or GGUF; default: the tokenizer's).")
    teacher_chat_templates: list[str] = option(
        [], "Chat mode: a teacher's template file, once for all or once per teacher in order "
            "(`default`: that teacher tokenizer's own).")
    include_thinking: bool = option(
        False, "Chat mode: train on the final turn's reasoning and its closing marker too (not the opening scaffold).")
    alignment_regions: list[str] = option(
        [], "Chat mode with --include-thinking: KD only on these regions, comma-separated from "
            "reasoning,close,answer,eot (default: all).")
    drop_first_assistant_chunk: list[int] = option(
        [], "Chat mode: for this teacher index (repeatable), exclude the first accepted chunk of the final "
            "assistant message from KD.")

    def validate(self) -> None:
        """Raise `CsdError` naming the option that is wrong."""
        from csd_pipeline.align.chat_mode import chat_options

        if self.mode not in MODES:
            raise CsdError(f"--mode {self.mode!r} is unknown; use --mode text or --mode chat.")
        if self.capture_only or self.against_capture:
            check_capture_options(self)
            return
        if not self.corpus:
            raise CsdError("no corpus given; pass --corpus at least once.")
        if not self.student_tokenizer:
            raise CsdError("no student tokenizer given; pass --student-tokenizer (or --capture-only for a teacher "
                           "capture without a student).")
        if not self.teacher_tokenizers:
            raise CsdError("no teacher tokenizer given; pass --teacher-tokenizer at least once.")
        if self.max_student_tokens < 2:
            raise CsdError(f"--max-student-tokens {self.max_student_tokens} is too small; use at least 2.")
        if len(self.max_teacher_tokens) not in (0, 1, len(self.teacher_tokenizers)):
            raise CsdError(
                f"--max-teacher-tokens was given {len(self.max_teacher_tokens)} times for {len(self.teacher_tokenizers)} "
                "teachers; give it once (for all) or once per --teacher-tokenizer, in the same order."
            )
        check_teacher_limits(self)
        if self.tables and len(self.tables) != len(self.teacher_tokenizers):
            raise CsdError(
                f"--tables was given {len(self.tables)} times for {len(self.teacher_tokenizers)} teachers; give one "
                "S2T T2S pair per --teacher-tokenizer, in the same order, or none to build them."
            )
        check_sizes(self)
        chat_options(self)

    def teacher_limits(self) -> list[int]:
        """The window limit of each teacher."""
        if not self.max_teacher_tokens:
            return [self.max_student_tokens] * len(self.teacher_tokenizers)
        if len(self.max_teacher_tokens) == 1:
            return self.max_teacher_tokens * len(self.teacher_tokenizers)
        return list(self.max_teacher_tokens)


def check_teacher_limits(config: AlignConfig) -> None:
    """Refuse a --max-teacher-tokens below 2."""
    if any(m < 2 for m in config.max_teacher_tokens):
        raise CsdError(f"--max-teacher-tokens {min(config.max_teacher_tokens)} is too small; use at least 2.")


def check_sizes(config: AlignConfig) -> None:
    """Refuse a --shard-mb or --batch-mb that is not a positive size."""
    for size, flag in ((config.shard_bytes, "--shard-mb"), (config.batch_bytes, "--batch-mb")):
        if size < 1:
            raise CsdError(f"{flag} {size / MIB:g} is not a positive size; pass a number of MiB above 0 "
                           f"(e.g. {flag} 1).")


def check_capture_options(config: AlignConfig) -> None:
    """Raise `CsdError` naming the option that a capture (--capture-only) or an alignment against one
    (--against-capture) does not take."""
    if config.capture_only and config.against_capture:
        raise CsdError("--capture-only and --against-capture exclude each other; capture once with --capture-only, "
                       "then align each student with --against-capture CAPTURE_DIR.")
    if config.mode != "text":
        raise CsdError("a teacher capture is text mode only; drop --mode chat (or align chat data without "
                       "--capture-only / --against-capture).")
    if config.capture_only and config.tables:
        raise CsdError("--capture-only writes no student, so no tables; drop --tables (give them to --against-capture).")
    if len(config.tables) > 1:
        raise CsdError(f"--tables was given {len(config.tables)} times for the capture's one teacher; give one S2T T2S "
                       "pair, or none to build them.")
    check_sizes(config)
    if config.capture_only:
        if config.student_tokenizer:
            raise CsdError("--capture-only writes no student; drop --student-tokenizer, then align it with "
                           "--against-capture CAPTURE_DIR --student-tokenizer S.")
        if len(config.teacher_tokenizers) != 1:
            raise CsdError(f"--capture-only takes exactly one --teacher-tokenizer, got {len(config.teacher_tokenizers)}; "
                           "capture each teacher into its own --output.")
        if not config.corpus:
            raise CsdError("no corpus given; pass --corpus at least once.")
        if len(config.max_teacher_tokens) > 1:
            raise CsdError("--max-teacher-tokens was given more than once for the one captured teacher; give it once.")
        check_teacher_limits(config)
        return
    if not config.student_tokenizer:
        raise CsdError(f"--against-capture {config.against_capture} needs the student: pass --student-tokenizer.")
    if config.corpus:
        raise CsdError(f"--against-capture re-reads the corpus that {config.against_capture} recorded; drop --corpus.")
    if len(config.teacher_tokenizers) > 1:
        raise CsdError("--against-capture takes at most one --teacher-tokenizer (the capture's, where it moved).")
    if config.max_student_tokens < 2:
        raise CsdError(f"--max-student-tokens {config.max_student_tokens} is too small; use at least 2.")
