"""Corpus readers with stable document identities.

Inputs (`discover`): `.txt`, `.jsonl`, `.json` and `.parquet` files; `.txt`, `.jsonl` and `.json`
compressed as `.zst` or `.gz` (`compressed.py`, streamed); folders written by `datasets`
`save_to_disk` and datasets loaded by name, `hf:NAME[:CONFIG]` (`hf.py`); and directories of any of
these (walked recursively, sorted, hidden entries skipped). Every document is identified by
`(source, record_index)`: `source` is the path as given (plus the path inside a given directory,
with `/`; a DatasetDict folder adds `/SPLIT`, a named dataset is `hf:NAME[:CONFIG][SPLIT]`),
`record_index` the line (jsonl), block (`.txt` with blank-line splitting), element (json) or row
(parquet, datasets) index in that input, counted over every record, rejected ones included. A
compressed file numbers its records as the same file uncompressed would. Identities do not depend
on worker counts or ranks: the plan is made once, by one process, from the inputs alone.

Reading never stops at a bad record; it yields a `Document` whose `reason` says why it has no
text. Reasons: `invalid_utf8`, `broken_json`, `record_not_object`, `missing_text_field`,
`text_not_string`, `lone_surrogate`, `blank_line` (an empty line inside a jsonl file). A bad input
as a whole (a truncated or damaged compressed file, an unreadable Parquet file or dataset) is one
`CsdError` before anything is written.

Choices:
- `.txt` is decoded as strict UTF-8; a document with invalid bytes is rejected (`invalid_utf8`)
  rather than changed by a replacement character. A BOM at the very start of a file is an encoding
  mark and is removed; a BOM anywhere else is text.
- `--split-on-blank-lines`: a document is a maximal run of non-blank lines (a blank line holds only
  ASCII whitespace), taken byte-exactly from the start of its first line to the end of its last line
  (without that line's `\\n`). Runs of blank lines separate documents and are not documents.
- `.jsonl` is read line by line with `json.loads`; `.json` is a JSON array of records (or an object
  holding the text field, or columns), and falls back to JSON lines when it is not one JSON value.
- `.parquet` is read with pyarrow, one row group at a time; datasets rows in batches of Arrow rows.

Work is split into shards by `plan_shards`: records in input order are cut into consecutive
segments of about `target_bytes` source bytes each, a pure function of the inputs.
"""

from csd_pipeline.align.corpus.documents import CorpusFile, Document, ReadOptions
from csd_pipeline.align.corpus.plan import (
    MAX_SHARDS_PER_REGION,
    SUFFIXES,
    discover,
    plan_shards,
    read_segment,
    segment_spec,
)

__all__ = ["CorpusFile", "Document", "ReadOptions", "MAX_SHARDS_PER_REGION", "SUFFIXES", "discover",
           "plan_shards", "read_segment", "segment_spec"]
