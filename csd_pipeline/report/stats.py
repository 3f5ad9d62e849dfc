"""The tables of an aligned output, computed from its shards with polars lazy scans.

`csd-pipeline inspect` and `csd-pipeline report` take their numbers from here. The output is read
through its reader (`AlignedOutput`): the shards read are the ones the manifest lists, never a glob of
the folder, and the column names are the reader's. Each query is one streaming scan that reads
only the columns it needs, so memory stays flat and a many-GB output is read at the speed of its
compressed columns:

- windows: per (source, window length of each side): rows, text bytes and supervised student tokens
  (the loss mask). A window's length on each side is the sum of a teacher's chunk lengths, so the
  token-id columns (the largest) are never read.
- documents: distinct (source, record index) pairs per source.
- chunks, per teacher: per (source, status, shape): chunks and the tokens they cover on each side.

Tokens are content tokens, as the align stage counts them: in text mode the context-token chunk at
the head of each row (status SPECIAL) is left out; in chat mode every token of the rendering counts.
What the shards cannot say (documents read or refused before a row was written, window regions
dropped) stays in the manifest's totals; `inspect_summary` joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from csd_pipeline.align.output import STUDENT_COLUMNS, AlignedOutput
from schemas.aligned import SHAPES, ChunkStatus

_SHAPE_CODE = {name: code for code, name in enumerate(SHAPES)}  # (student_len > 1) * 2 + (teacher_len > 1)


@dataclass
class AlignedTables:
    """What the shards of an aligned output hold (see the module docstring).

    tokens: side ("student", "teacher0", ...) -> content tokens. chunk_status: teacher -> status
    name -> chunks. chunk_shapes: teacher -> shape -> accepted chunks. window_tokens: side -> tokens
    in a window (context token included) -> windows. sources: one dict per source file (rows,
    documents, text_bytes, tokens, chunks {teacher: {"content", "accepted"}}), most rows first.
    """

    rows: int = 0
    documents: int = 0
    text_bytes: int = 0
    supervised_student_tokens: int = 0
    tokens: dict = field(default_factory=dict)
    chunk_status: dict = field(default_factory=dict)
    chunk_shapes: dict = field(default_factory=dict)
    window_tokens: dict = field(default_factory=dict)
    sources: list = field(default_factory=list)


def _polars():
    try:
        import polars as pl
    except ImportError:  # a declared dependency; only a broken install lands here
        from csd_pipeline.errors import CsdError

        raise CsdError("polars is not installed; run `pip install polars` (csd-pipeline depends on it).") from None
    return pl


def aligned_tables(aligned: AlignedOutput) -> AlignedTables:
    """Scan the shards of `aligned` (an `AlignedOutput.open(DIR)`) that its manifest lists.

    Returns an `AlignedTables`. Raises `CsdError` when a listed shard is missing or unreadable.
    """
    teachers = aligned.num_teachers
    tables = AlignedTables(tokens={"student": 0, **{f"teacher{i}": 0 for i in range(teachers)}})
    if not aligned.total_rows:
        for i in range(teachers):
            tables.chunk_status[f"teacher{i}"] = {s.name: 0 for s in ChunkStatus}
            tables.chunk_shapes[f"teacher{i}"] = {shape: 0 for shape in SHAPES}
        return tables
    aligned.verify()
    pl = _polars()
    from csd_pipeline.runtime.storage import is_remote, open_input

    shards = [aligned.shard_path(shard) for shard in aligned.shards]  # objects are streamed through fsspec
    scan = pl.scan_parquet([open_input(p) if is_remote(p) else str(p) for p in shards])
    chat = aligned.mode == "chat"
    windows = _collect(_windows_query(pl, scan, aligned, chat))
    documents = _collect(_documents_query(pl, scan))
    chunks = [_collect(_chunks_query(pl, scan, aligned.chunk_columns(i))) for i in range(teachers)]
    _fill_windows(tables, windows, teachers)
    tables.documents = int(documents["documents"].sum())
    per_source = {row["source"]: row for row in _source_rows(windows, documents, teachers)}
    for i, frame in enumerate(chunks):
        _fill_chunks(tables, per_source, frame, i, exclude_special=not chat)
    tables.sources = sorted(per_source.values(), key=lambda r: (-r["rows"], r["source"]))
    return tables


def _collect(query):
    from csd_pipeline.errors import CsdError

    pl = _polars()
    try:
        return query.collect(engine="streaming")
    except (OSError, pl.exceptions.PolarsError) as err:
        raise CsdError(f"an aligned shard could not be read ({str(err).splitlines()[0]}); run "
                       "`csd-pipeline status` on the folder, or re-run `csd-pipeline align` into it.") from None


def _windows_query(pl, scan, aligned: AlignedOutput, chat: bool):
    sides = {"student": "student", **{f"teacher{i}": i for i in range(aligned.num_teachers)}}
    # a side's window length: the sum of its chunk lengths (the student's from teacher 0's chunks)
    lengths = [pl.col(aligned.side_columns(side).chunk_len).list.sum().cast(pl.Int64).alias(name)
               for name, side in sides.items()]
    supervised = pl.col(STUDENT_COLUMNS[1]).list.sum() if chat else pl.lit(0)
    return (scan.select(pl.col("source").cast(pl.Categorical), *lengths,
                        pl.col("text").str.len_bytes().cast(pl.Int64).alias("text_bytes"),
                        supervised.cast(pl.Int64).alias("supervised"))
            .group_by("source", *sides)
            .agg(pl.len().cast(pl.Int64).alias("rows"), pl.col("text_bytes").sum(), pl.col("supervised").sum()))


def _documents_query(pl, scan):
    return (scan.select(pl.col("source").cast(pl.Categorical), "record_index").unique()
            .group_by("source").agg(pl.len().cast(pl.Int64).alias("documents")))


def _chunks_query(pl, scan, columns):
    student_len, teacher_len, status = columns.student_len, columns.teacher_len, columns.status
    shape = (pl.col(student_len) > 1).cast(pl.UInt8) * 2 + (pl.col(teacher_len) > 1).cast(pl.UInt8)
    return (scan.select(pl.col("source").cast(pl.Categorical), student_len, teacher_len, status)
            .explode([student_len, teacher_len, status])
            .with_columns(shape.alias("shape"))
            .group_by("source", status, "shape")
            .agg(pl.len().cast(pl.Int64).alias("chunks"), pl.col(student_len).cast(pl.Int64).sum().alias("student"),
                 pl.col(teacher_len).cast(pl.Int64).sum().alias("teacher"))
            .rename({status: "status"}))


def _fill_windows(tables: AlignedTables, windows, teachers: int) -> None:
    tables.rows = int(windows["rows"].sum())
    tables.text_bytes = int(windows["text_bytes"].sum())
    tables.supervised_student_tokens = int(windows["supervised"].sum())
    for side in ["student", *(f"teacher{i}" for i in range(teachers))]:
        counts = windows.group_by(side).agg(_sum("rows")).sort(side)
        tables.window_tokens[side] = dict(zip(counts[side].to_list(), counts["rows"].to_list()))


def _sum(column: str):
    pl = _polars()
    return pl.col(column).sum()


def _source_rows(windows, documents, teachers: int) -> list[dict]:
    pl = _polars()
    sums = windows.with_columns(pl.col("source").cast(pl.String)).group_by("source").agg(
        _sum("rows"), _sum("text_bytes"))
    docs = dict(zip(documents["source"].cast(pl.String).to_list(), documents["documents"].to_list()))
    return [{"source": row["source"], "rows": int(row["rows"]), "documents": int(docs.get(row["source"], 0)),
             "text_bytes": int(row["text_bytes"]),
             "tokens": {"student": 0, **{f"teacher{i}": 0 for i in range(teachers)}},
             "chunks": {f"teacher{i}": {"content": 0, "accepted": 0} for i in range(teachers)}}
            for row in sums.iter_rows(named=True)]


def _fill_chunks(tables: AlignedTables, per_source: dict, frame, i: int, *, exclude_special: bool) -> None:
    """Add teacher i's chunk counts (and the token totals they give) to `tables` and `per_source`."""
    pl = _polars()
    teacher = f"teacher{i}"
    status_counts = {s.name: 0 for s in ChunkStatus}
    shapes = {shape: 0 for shape in SHAPES}
    names = {int(s): s.name for s in ChunkStatus}
    for row in frame.with_columns(pl.col("source").cast(pl.String)).iter_rows(named=True):
        status = names.get(int(row["status"]), f"UNKNOWN_{row['status']}")
        status_counts[status] = status_counts.get(status, 0) + row["chunks"]
        source = per_source[row["source"]]
        counted = not (exclude_special and status == ChunkStatus.SPECIAL.name)
        if counted:
            if i == 0:
                source["tokens"]["student"] += row["student"]
            source["tokens"][teacher] += row["teacher"]
        if status != ChunkStatus.SPECIAL.name:
            source["chunks"][teacher]["content"] += row["chunks"]
        if status == ChunkStatus.ACCEPTED.name:
            source["chunks"][teacher]["accepted"] += row["chunks"]
            shapes[SHAPES[row["shape"]]] += row["chunks"]
    tables.chunk_status[teacher] = status_counts
    tables.chunk_shapes[teacher] = shapes
    if i == 0:
        tables.tokens["student"] = sum(s["tokens"]["student"] for s in per_source.values())
    tables.tokens[teacher] = sum(s["tokens"][teacher] for s in per_source.values())


# ---------------------------------------------------------------------------------------------
# The `inspect` summary


def inspect_summary(directory) -> dict:
    """The `csd-pipeline inspect` report of a stage output: manifest totals, and for an aligned output
    the tables of its shards (rows, tokens, bytes per token, chunk statuses and shapes, rejections,
    per source, window lengths) joined with what only the manifest knows (documents read, refusals).

    Raises `ManifestError`/`CsdError` when the folder is not a complete stage output.
    """
    from csd_pipeline.runtime.manifest import read_manifest
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from csd_pipeline.teacher.store.schema import STAGE as TEACHER_STAGE
    from schemas.aligned import STAGE as ALIGN_STAGE

    manifest = read_manifest(directory)  # any stage; the output's own reader checks its schema version
    aligned = AlignedOutput.open(directory) if manifest["stage"] == ALIGN_STAGE else None
    if manifest["stage"] == TEACHER_STAGE:
        manifest = TeacherTopkOutput.open(directory).manifest
    manifest = aligned.manifest if aligned is not None else manifest
    totals = manifest["totals"]
    stats = totals.get("stats", {})
    report = {"stage": manifest["stage"], "schema_version": manifest["schema_version"], "shards": totals["shards"],
              "rows": totals["rows"], "bytes_on_disk": totals["bytes"]}
    if aligned is None:
        report["stats"] = stats
        return report
    if aligned.kind == "capture":  # a teacher capture has no student and no chunks: what its manifest counts
        report.update({"kind": "capture", "windows": stats.get("windows", 0), "documents": stats.get("documents", {}),
                       "tokens": stats.get("tokens", {}),
                       "rejections": {"documents": stats.get("rejected_documents", {}),
                                      "window_regions": stats.get("rejected_regions", {}),
                                      "window_region_bytes": stats.get("rejected_region_bytes", 0)}})
        return report
    tables = aligned_tables(aligned)
    teachers = sorted(tables.chunk_status)
    report.update({
        "rows": tables.rows,
        "windows": tables.rows,
        "documents": {**stats.get("documents", {}), "aligned": tables.documents},
        "tokens": tables.tokens,
        "text_bytes": tables.text_bytes,
        "bytes_per_token": {side: round(tables.text_bytes / n, 4) if n else None for side, n in tables.tokens.items()},
        "chunk_status": tables.chunk_status,
        "chunk_shapes": tables.chunk_shapes,
        "rejections": {
            "documents": stats.get("rejected_documents", {}),
            "window_regions": stats.get("rejected_regions", {}),
            "window_region_bytes": stats.get("rejected_region_bytes", 0),
            "chunks": {t: {k: v for k, v in tables.chunk_status[t].items() if k not in ("ACCEPTED", "SPECIAL") and v}
                       for t in teachers},
        },
        "sources": tables.sources,
        "window_tokens": {side: _quantiles(counts) for side, counts in tables.window_tokens.items()},
    })
    if "chat" in stats:  # chat mode: supervised (loss-mask) tokens and bytes, first chunks dropped from KD
        per_row = round(tables.supervised_student_tokens / tables.rows, 2) if tables.rows else None
        report["chat"] = {**stats["chat"], "supervised_student_tokens": tables.supervised_student_tokens,
                          "supervised_student_tokens_per_row": per_row}
    return report


def _quantiles(counts: dict) -> dict:
    """min, p50, p90, max and mean of a histogram {value: count}."""
    total = sum(counts.values())
    if not total:
        return {"windows": 0}
    values = sorted(counts)
    out = {"windows": total, "min": values[0], "max": values[-1],
           "mean": round(sum(v * n for v, n in counts.items()) / total, 2)}
    seen, wanted = 0, [(0.5, "p50"), (0.9, "p90")]
    for value in values:
        seen += counts[value]
        while wanted and seen >= wanted[0][0] * total:
            out[wanted.pop(0)[1]] = value
    return out


def source_label(source: str, width: int = 40) -> str:
    """A source path shortened for a table or a plot axis (its end kept: the file name says most)."""
    return source if len(source) <= width else "…" + source[-(width - 1):]


def source_lines(sources: list[dict], limit: int = 10) -> list[str]:
    """The per-source table as text lines (most rows first; the rest summed on one line)."""
    if not sources:
        return []
    lines = [f"sources: {len(sources)}"]
    for entry in sources[:limit]:
        accepted = ", ".join(f"{t} {_share(c['accepted'], c['content'])}" for t, c in entry["chunks"].items())
        lines.append(f"  {source_label(entry['source'])}: {entry['rows']} windows, {entry['documents']} documents, "
                     f"{entry['tokens']['student']} student tokens; content chunks accepted: {accepted}")
    if len(sources) > limit:
        rest = sources[limit:]
        lines.append(f"  ... and {len(rest)} more sources ({sum(e['rows'] for e in rest)} windows); see --json")
    return lines


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"
