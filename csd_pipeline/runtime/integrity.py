"""Shard integrity: readers check the bytes they train on, without reading them twice.

Two layers, both cheap next to training:

- Page checksums. Every Parquet shard writer passes `PARQUET_CHECKSUMS` (a CRC-32 of each data
  page, `write_page_checksum=True`), and the shard schemas (schemas/) carry `PAGE_CHECKSUM_MARK`
  (metadata `csd.page_checksum = crc32`) so a reader can tell; readers pass
  `page_checksum_verification=True`, so a damaged page fails to decode instead of decoding to other
  values.
- Shard sha256. The manifest records every shard's sha256. The training loader reads an aligned
  shard's bytes once into memory, hashes them and decodes from that copy
  (`open_verified`, which `AlignedOutput.read` uses): any changed byte, in a page, a page header or the footer, is refused
  before a value is used. Teacher top-k shards are read block by block, so there the page
  checksums do the work; a shard written before they existed (no mark) is hashed once when opened
  (`verify_unmarked`).

`check_shard_rows` and `check_table_fingerprints` compare a manifest with its own files
(footers, table headers), so a hand-edited `rows` or a swapped table names the stage that made it.
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import bytes_sha256, file_sha256
from csd_pipeline.runtime.storage import location, parquet_source, readable

PAGE_CHECKSUM_KEY = b"csd.page_checksum"
PAGE_CHECKSUM_VALUE = b"crc32"
PAGE_CHECKSUM_MARK = {PAGE_CHECKSUM_KEY: PAGE_CHECKSUM_VALUE}  # schema metadata of shards written with them
PARQUET_CHECKSUMS = {"write_page_checksum": True}  # ParquetWriter keyword of every shard writer
STAGE_COMMANDS = {"align": "csd-pipeline align", "teacher-logits": "csd-pipeline teacher-logits"}


def has_page_checksums(parquet_file) -> bool:
    """True when a `pq.ParquetFile` was written with page checksums (it carries the mark)."""
    metadata = parquet_file.schema_arrow.metadata or {}
    return metadata.get(PAGE_CHECKSUM_KEY) == PAGE_CHECKSUM_VALUE


def rewrite_hint(path, stage: str) -> str:
    """What to do about one damaged shard: drop it and its marker, re-run the stage (same bytes come back)."""
    path = location(path)
    command = STAGE_COMMANDS.get(stage, stage)
    return (f"delete it and {path.parent / 'done' / (path.stem + '.done')}, then re-run the same `{command}` "
            "command (it rewrites that shard with the same bytes)")


def _damaged(path, stage: str, detail: str) -> CsdError:
    kind = "aligned" if stage == "align" else "teacher top-k"
    return CsdError(f"{kind} shard {path} is damaged ({detail}); {rewrite_hint(path, stage)}")


def open_verified(path, sha256: str | None, stage: str = "align"):
    """A `pq.ParquetFile` over the bytes of shard `path`, read once into memory and checked against the
    recorded `sha256` (None skips the hash: callers without a manifest); page checksums are verified
    on read where the shard has them. Raises `CsdError` naming the shard and what to do when the
    file is missing, differs from its record or has a damaged footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = location(path)
    try:
        data = readable(path, sha256).read_bytes()
    except OSError as err:
        raise CsdError(f"cannot read shard {path} ({err.strerror or err}); check the file, "
                       f"or {rewrite_hint(path, stage)}") from None
    if sha256 is not None and bytes_sha256(data) != sha256:
        raise _damaged(path, stage, "its sha256 is not the one its manifest records")
    try:
        return pq.ParquetFile(pa.BufferReader(data), page_checksum_verification=True)
    except (OSError, KeyError, pa.ArrowException, UnicodeDecodeError) as err:
        raise damaged_read(path, stage, err) from None


def read_verified_table(path, sha256: str | None, columns: list[str] | None, stage: str = "align"):
    """The Arrow table (`columns`, None: all) of a shard opened with `open_verified`; a page that fails
    its checksum or does not decode is a `CsdError` naming the shard."""
    import pyarrow as pa

    parquet = open_verified(path, sha256, stage)
    try:
        return parquet.read(columns=columns)
    except (OSError, KeyError, pa.ArrowException, UnicodeDecodeError) as err:
        raise damaged_read(path, stage, err) from None


def verify_unmarked(parquet_file, path, sha256: str | None, stage: str) -> None:
    """For a shard written without page checksums: check its whole-file sha256 (when recorded)."""
    if sha256 is None or has_page_checksums(parquet_file):
        return
    try:
        actual = file_sha256(path)
    except OSError as err:
        raise CsdError(f"cannot read shard {path} ({err.strerror or err}); {rewrite_hint(path, stage)}") from None
    if actual != sha256:
        raise _damaged(path, stage, "its sha256 is not the one its manifest records")


def damaged_read(path, stage: str, err: BaseException) -> CsdError:
    """The `CsdError` for a read that failed mid-shard (a page checksum or decode error)."""
    return _damaged(path, stage, str(err).splitlines()[0] if str(err) else type(err).__name__)


def check_shards(manifest: dict, directory, what: str, rerun: str) -> None:
    """Raise `CsdError` unless every shard a stage manifest lists exists with its recorded size and row count
    (footer); `what` names the output ("aligned directory"), `rerun` the command that made it."""
    from csd_pipeline.runtime.manifest import verify_shards

    problems = verify_shards(manifest, directory) or check_shard_rows(manifest, directory)
    if problems:
        raise CsdError(f"{what} {directory}: {problems[0]}; run `csd-pipeline status {directory} --finalize` to "
                       f"rewrite its manifest from the shards' completion records, or re-run `{rerun}` into a new --output")


def check_shard_rows(manifest: dict, directory) -> list[str]:
    """Problems (one sentence each) where a shard's footer row count differs from the manifest's `rows`."""
    import pyarrow.parquet as pq

    problems = []
    for shard in manifest.get("shards") or []:
        path = location(directory) / shard["file"]
        try:
            rows = pq.read_metadata(parquet_source(path)).num_rows
        except (OSError, ValueError) as err:
            problems.append(f"shard {shard['file']} is unreadable ({str(err).splitlines()[0] if str(err) else err})")
            continue
        if rows != shard.get("rows"):
            problems.append(f"the manifest says shard {shard['file']} has {shard.get('rows')!r} rows, the file has "
                            f"{rows}")
    return problems


def check_table_fingerprints(manifest: dict, directory, teacher: int) -> tuple[Path, Path]:
    """The (student->teacher, teacher->student) tables of teacher `teacher` of an aligned output, checked.

    Each table's header must name the tokenizers the manifest records for that teacher (and the
    right direction). Raises `CsdError` naming `csd-pipeline align` when a table is missing, swapped
    or made for other tokenizers.
    """
    from csd_pipeline.runtime.safe_paths import path_inside
    from csd_pipeline.vocab.tables import read_table_fingerprints

    directory = location(directory)
    rerun = f"re-run `csd-pipeline align` into a new --output (or restore {directory}/tables)"
    tables = manifest.get("tables")
    entries = [t for t in tables if isinstance(t, dict) and t.get("teacher") == teacher] if isinstance(tables, list) else []
    entry = entries[0] if entries else None
    if not isinstance(entry, dict) or "student_to_teacher" not in entry:
        raise CsdError(f"aligned manifest of {directory} lists no tables for teacher {teacher}; {rerun}")
    student = (manifest.get("tokenizers") or {}).get("student", {}).get("fingerprint")
    teachers = (manifest.get("tokenizers") or {}).get("teachers") or []
    teacher_fp = teachers[teacher].get("fingerprint") if teacher < len(teachers) else None
    paths = []
    for key, wanted in (("student_to_teacher", (student, teacher_fp)), ("teacher_to_student", (teacher_fp, student))):
        path = path_inside(directory, entry.get(key), f"the manifest of {directory} names a table", rerun)
        if not path.is_file():
            raise CsdError(f"table {path} listed by the aligned manifest is missing; {rerun}")
        try:
            found = tuple(read_table_fingerprints(path))
        except (OSError, ValueError, CsdError) as err:
            raise CsdError(f"table {path} is unreadable ({str(err).splitlines()[0]}); {rerun}") from None
        if found != wanted:
            direction = key.replace("_to_", "->")
            raise CsdError(f"table {path} is not the {direction} table of the tokenizers {directory} was aligned "
                           f"with (its header names {found[0][:12]} -> {found[1][:12]}); {rerun}")
        paths.append(path)
    return paths[0], paths[1]
