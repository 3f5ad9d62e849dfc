"""What the corpus readers share: an input (`CorpusFile`), how records become documents
(`ReadOptions`), a document or the reason it has none (`Document`), and the record -> document rules
every format applies the same way."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# Formats of the records inside an input: plain and compressed files carry txt/jsonl/json; parquet;
# a folder written by `datasets` save_to_disk ("dataset"); a dataset loaded by name ("hf").
FORMATS = ("txt", "jsonl", "json", "parquet", "dataset", "hf")
WHITESPACE = b" \t\r\n\f\v"
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class CorpusFile:
    """One input: where it is, how it is named in row ids, its format and fingerprint.

    `compression` is "zst" or "gz" for a compressed file (its `format` is that of the records
    inside). `split` is the split of an "hf" input; `revision` what identifies a dataset's data
    beyond its size (the datasets fingerprint of a saved folder, the builder hash of a loaded one).
    """

    path: str  # absolute path; for "hf" the dataset name (and config) as given after `hf:`
    source: str  # identity used in row ids
    format: str
    size: int
    mtime_ns: int
    compression: str | None = None
    split: str | None = None
    revision: str | None = None

    def fingerprint(self) -> dict:
        """What a re-run must find unchanged."""
        record = {"source": self.source, "size": self.size, "mtime_ns": self.mtime_ns}
        if self.revision is not None:
            record["revision"] = self.revision
        return record

    def spec(self) -> dict:
        """The JSON fields a shard task carries to rebuild this input in a worker (`from_spec`)."""
        return {k: v for k, v in asdict(self).items() if k not in ("size", "mtime_ns") and v is not None}

    @classmethod
    def from_spec(cls, spec: dict) -> CorpusFile:
        """The input of a segment that carries `spec()`'s fields (extra segment keys are ignored)."""
        return cls(spec["path"], spec["source"], spec["format"], 0, 0, spec.get("compression"), spec.get("split"),
                   spec.get("revision"))


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents."""

    text_field: str = "text"
    split_on_blank_lines: bool = False
    whole_record: bool = False  # chat mode: a document's text is its whole record as JSON (messages, tools)


@dataclass(frozen=True)
class Document:
    """A document's identity and text, or the reason it has none.

    `prompt_bytes`: for a prompt/completion record, the UTF-8 length of the prompt at the start of
    `text` (context, no loss; the rest is the completion), else None.
    """

    source: str
    record_index: int
    text: str | None
    reason: str | None = None
    prompt_bytes: int | None = None


def text_document(source: str, index: int, raw: bytes) -> Document:
    """A text document from raw bytes: strict UTF-8 or `invalid_utf8`."""
    try:
        return Document(source, index, raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Document(source, index, None, "invalid_utf8")


def jsonl_document(source: str, index: int, raw: bytes, options: ReadOptions) -> Document:
    """A document from one JSON line (`blank_line`, `invalid_utf8`, `broken_json` or the record's rules)."""
    if not raw.strip(WHITESPACE):
        return Document(source, index, None, "blank_line")
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        return Document(source, index, None, "invalid_utf8")
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return Document(source, index, None, "broken_json")
    return record_document(source, index, record, options)


def record_document(source: str, index: int, record, options: ReadOptions) -> Document:
    """A document from a parsed record (`record_not_object`, `missing_text_field`, the text's rules)."""
    if not isinstance(record, dict):
        return Document(source, index, None, "record_not_object")
    if options.whole_record:
        return checked_text(source, index, json.dumps(record, ensure_ascii=False, default=str))
    if options.text_field not in record and PROMPT_FIELDS[1] in record:
        return prompt_completion_document(source, index, record)
    if options.text_field not in record or record[options.text_field] is None:
        return Document(source, index, None, "missing_text_field")
    return checked_text(source, index, record[options.text_field])


PROMPT_FIELDS = ("prompt", "completion")


def prompt_completion_document(source: str, index: int, record: dict) -> Document:
    """A document from a {"prompt", "completion"} record (`csd-pipeline generate` writes them): the text is
    prompt + completion, the prompt is context (`empty_completion`, `text_not_string`, `lone_surrogate`)."""
    prompt, completion = (record.get(name) for name in PROMPT_FIELDS)
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return Document(source, index, None, "text_not_string")
    if not completion:
        return Document(source, index, None, "empty_completion")
    document = checked_text(source, index, prompt + completion)
    if document.text is None:
        return document
    return Document(source, index, document.text, prompt_bytes=len(prompt.encode("utf-8")))


def checked_text(source: str, index: int, text) -> Document:
    """A document from a text value (`text_not_string`, `lone_surrogate`)."""
    if not isinstance(text, str):
        return Document(source, index, None, "text_not_string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return Document(source, index, None, "lone_surrogate")
    return Document(source, index, text)


def record_size(record, options: ReadOptions) -> int:
    """The planning size of a parsed record: its text's length (its JSON's for whole records), 1 if none."""
    if options.whole_record:
        return len(json.dumps(record, ensure_ascii=False, default=str))
    text = record.get(options.text_field) if isinstance(record, dict) else None
    if text is None and isinstance(record, dict) and PROMPT_FIELDS[1] in record:
        text = "".join(v for v in map(record.get, PROMPT_FIELDS) if isinstance(v, str))
    return len(text) if isinstance(text, str) else 1
