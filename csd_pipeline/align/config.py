"""`AlignConfig`: the options of `csd-pipeline align`, each with its one default and help text.

The click command (`cli/align.py`) builds its flags from these fields. Chat-mode options are
checked by `csd_pipeline.align.chat_mode.chat_options` (user guide: docs/CHAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.options import MIB, option

MODES = ("text", "chat")


@dataclass
class AlignConfig:
    """Options of `csd-pipeline align` (see `option` help texts; byte sizes are bytes here, MiB on the command line)."""

    corpus: list[str] = option(
        help="A .txt/.jsonl/.json/.parquet file (.txt/.jsonl/.json also as .zst or .gz), a datasets "
             "save_to_disk folder, hf:NAME[:CONFIG] (datasets.load_dataset, streamed), or a directory of "
             "them; repeatable.")
    student_tokenizer: str = option(help="tokenizer.json, tokenizer folder, hub name or fixture name.")
    teacher_tokenizers: list[str] = option(
        help="A teacher's tokenizer; repeat for several teachers (columns teacher0_*, teacher1_*, ...).")
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
        if self.shard_bytes < 1:
            raise CsdError("--shard-mb must be positive.")
        if self.batch_bytes < 1:
            raise CsdError("--batch-mb must be positive.")
        chat_options(self)

    def teacher_limits(self) -> list[int]:
        """The window limit of each teacher."""
        if not self.max_teacher_tokens:
            return [self.max_student_tokens] * len(self.teacher_tokenizers)
        if len(self.max_teacher_tokens) == 1:
            return self.max_teacher_tokens * len(self.teacher_tokenizers)
        return list(self.max_teacher_tokens)
