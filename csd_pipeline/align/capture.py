"""A teacher capture (`csd-pipeline align --capture-only`): windows cut by one teacher's tokenization alone.

A capture is what `teacher-logits` needs and nothing of a student, so that one teacher run serves every
student (docs/CAPTURE.md). It is the normal text-mode align with the teacher standing in for the student:
`TextAligner(teacher, [teacher])` encodes each whole document once, `chunks.align` of the teacher with
itself gives one chunk per teacher token, and `chunks.cut_windows` cuts each document as the normal align
does when it has a choice (the longest run of whole chunks within the window limit, cut at a character
start; a run that does not fit is a rejected region, counted). So every byte of a document lies in
exactly one window or one rejected region, and a window holds the teacher's context token and at most
`--max-teacher-tokens - 1` content tokens. Of each row the capture keeps `schemas.aligned.CAPTURE_COLUMNS`
(the capture schema); `against_capture.py` aligns a student against those windows.
"""

from __future__ import annotations

from csd_pipeline.errors import CsdError
from schemas.aligned import CAPTURE_COLUMNS, capture_schema


def refuse_prompt_completion(documents: list, option: str) -> None:
    """Raise `CsdError` for a prompt/completion record: a capture keeps no loss mask, so it cannot carry one."""
    for document in documents:
        if document.prompt_bytes is not None:
            raise CsdError(f"record {document.source}:{document.record_index} is a prompt/completion record, which "
                           f"{option} does not take (a capture keeps no loss mask); align it without {option}.")


def capture_stats() -> dict:
    """Zeroed counters of one capture shard: the align stage's, without a student or chunks."""
    from csd_pipeline.align.text_mode import shard_stats

    stats = shard_stats(1)
    del stats["teacher0"]
    del stats["tokens"]["student"]
    return stats


class CaptureAligner:
    """A batch of documents -> capture rows (Arrow, capture schema), for the align stage's shard writer."""

    def __init__(self, teacher, max_teacher: int, context_token: bool):
        from csd_pipeline.align.text_mode import TextAligner

        self.inner = TextAligner(teacher, [teacher], max_teacher, [max_teacher], context_token)
        self.teachers = [teacher]
        self.schema = capture_schema()

    def new_stats(self) -> dict:
        return capture_stats()

    def align_documents(self, documents: list, stats: dict):
        """The capture rows of a batch of non-empty documents; `stats` counts documents, windows, rejections."""
        import pyarrow as pa

        from csd_pipeline.runtime.run_record import merge_stats

        refuse_prompt_completion(documents, "--capture-only")
        scratch = self.inner.new_stats()
        table = self.inner.align_documents(documents, scratch)
        del scratch["teacher0"]  # chunks of the teacher with itself: one per token, nothing to count
        del scratch["tokens"]["student"]
        merge_stats(stats, scratch)
        return pa.Table.from_arrays([table.column(name) for name in CAPTURE_COLUMNS], schema=self.schema)
