"""From `--corpus` arguments to inputs (`discover`), shards (`plan_shards`) and documents (`read_segment`)."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from pathlib import Path
from stat import S_ISREG

from csd_pipeline.align.corpus import compressed, files, hf
from csd_pipeline.align.corpus.documents import CorpusFile, Document, ReadOptions
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import is_url, location

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
# Shards that start inside one frame of a compressed file (or one shard of a streamed dataset) each
# decompress (read) it from its start: at most this many, so the thrown-away work stays below about
# (this / 2) x the region, a few percent of the time the align stage spends on it.
MAX_SHARDS_PER_REGION = 32
ACCEPTED = (".txt, .jsonl, .json, .parquet, .jsonl/.json/.txt compressed as .zst or .gz, a datasets save_to_disk "
            "folder, or hf:NAME[:CONFIG]")


# ---------------------------------------------------------------------------------------------
# Discovery


def discover(paths, split: str | None = None) -> list[CorpusFile]:
    """Expand corpus arguments into a sorted, de-duplicated list of inputs.

    An argument is a file, a folder (walked recursively, sorted, hidden entries skipped; a
    save_to_disk folder inside it is one input), a save_to_disk folder, or `hf:NAME[:CONFIG]`.
    `split` picks the split of DatasetDict folders and named datasets (needed when they have several).
    Raises `CsdError` for a path that does not exist, an unsupported file or one that is not a
    regular file (a FIFO would block), a folder without any input, a missing split, or a dataset
    that does not load.
    """
    if not paths:
        raise CsdError(f"no corpus given; pass at least one --corpus ({ACCEPTED}).")
    found: dict[str, CorpusFile] = {}
    for arg in paths:
        if str(arg).startswith(hf.PREFIX):
            named = hf.named_file(str(arg), split)
            found.setdefault(named.source, named)
            continue
        if is_url(str(arg)):
            _add_objects(found, str(arg))
            continue
        given = Path(str(arg)[len("file://"):] if str(arg).startswith("file://") else arg)
        shown = Path(os.path.normpath(str(arg))).as_posix()
        if not given.exists():
            raise CsdError(f"corpus path {arg} does not exist; check the path.")
        if given.is_dir() and hf.saved_kind(given):
            _add_saved(found, given, shown, split)
        elif given.is_dir() and (given / "run.json").is_file():
            for shard in _generated_shards(given):  # a `csd-pipeline generate` output: its shards only
                _add_file(found, shard, f"{shown}/{shard.name}")
        elif given.is_dir():
            members = _walk(given)
            if not members:
                raise CsdError(f"corpus directory {arg} holds no corpus file ({ACCEPTED}); point --corpus at your data.")
            for member in members:
                source = f"{shown}/{member.relative_to(given).as_posix()}"
                if member.is_dir():
                    _add_saved(found, member, source, split)
                else:
                    _add_file(found, member, source)
        elif file_format(given.name):
            _add_file(found, given, shown)
        else:
            raise CsdError(f"corpus file {arg} has an unsupported type; use {ACCEPTED}.")
    return sorted(found.values(), key=lambda f: f.source)


def _add_objects(found: dict, url: str) -> None:
    """The corpus files of an object-store URL: one object, or every corpus object under a prefix
    (sorted, hidden names skipped). Each is named in row ids by its key without the protocol and
    bucket (`s3://b/corpus/a.jsonl` -> `corpus/a.jsonl`), as a local run from the folder the corpus
    was copied from names it, so both runs write the same rows."""
    root = location(url)
    try:
        if root.is_file():
            members = [root]
        elif root.is_dir():
            members = [location(f"{root.protocol}://{p}") for p in sorted(root.fs.find(root.path))
                       if file_format(p.rsplit("/", 1)[-1]) and not any(part.startswith(".") for part in
                                                                        p[len(root.path):].split("/"))]
        else:
            raise CsdError(f"corpus path {url} does not exist; check the URL (and the credentials that list it).")
    except FileNotFoundError:
        raise CsdError(f"corpus path {url} does not exist; check the URL (and the credentials that list it).") from None
    if not members:
        raise CsdError(f"corpus prefix {url} holds no corpus file ({ACCEPTED}); point --corpus at your data.")
    for member in members:
        fmt = file_format(member.name)
        if fmt is None:
            raise CsdError(f"corpus file {url} has an unsupported type; use {ACCEPTED}.")
        info = member.fs.info(member.path)
        stamp = info.get("LastModified") or info.get("mtime") or info.get("updated")
        version = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or stamp or "")
        key = member.path.split("/", 1)[1] if "/" in member.path else member.path
        found.setdefault(str(member), CorpusFile(str(member), key, fmt[0], int(info["size"]), _stamp_ns(stamp),
                                                 compression=fmt[1], revision=version or None))


def _stamp_ns(stamp) -> int:
    """An object's modification time in nanoseconds (0 when the store reports none)."""
    if hasattr(stamp, "timestamp"):
        return int(stamp.timestamp() * 1_000_000_000)
    return int(float(stamp) * 1_000_000_000) if isinstance(stamp, int | float) else 0


def _generated_shards(directory: Path) -> list[Path]:
    """The shards of a complete `csd-pipeline generate` output, in manifest order."""
    from csd_pipeline.runtime.manifest import read_manifest

    if not (directory / "manifest.json").is_file():
        raise CsdError(f"corpus directory {directory} is a stage output without a manifest (not complete); finish "
                       "it by re-running its command, or check `csd-pipeline status` on it.")
    manifest = read_manifest(directory, stage="generate")
    return [directory / shard["file"] for shard in manifest["shards"]]


def file_format(name: str) -> tuple[str, str | None] | None:
    """(record format, compression or None) of a corpus file name, or None when it is not one."""
    lower = name.lower()
    stem, suffix = os.path.splitext(lower)
    compression = compressed.SUFFIXES.get(suffix)
    if compression:
        inner = os.path.splitext(stem)[1]
        return (inner[1:], compression) if inner in compressed.RECORD_SUFFIXES else None
    return (suffix[1:], None) if suffix in SUFFIXES else None


def _walk(directory: Path) -> list[Path]:
    members = []
    for root, dirs, names in os.walk(directory):
        saved = sorted(d for d in dirs if not d.startswith(".") and hf.saved_kind(Path(root) / d))
        members += [Path(root) / d for d in saved]
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in saved)
        for name in sorted(names):
            if not name.startswith(".") and file_format(name):
                members.append(Path(root) / name)
    return members


def _add_file(found: dict, path: Path, source: str) -> None:
    resolved = str(path.resolve())
    if resolved in found:
        return
    stat = path.stat()
    if not S_ISREG(stat.st_mode):  # a FIFO or device would block the planner or never end
        raise CsdError(f"corpus path {source} is not a regular file (a pipe, socket or device); save the text to a "
                       "file and pass that.")
    fmt, compression = file_format(path.name)
    found[resolved] = CorpusFile(resolved, source, fmt, stat.st_size, stat.st_mtime_ns, compression)


def _add_saved(found: dict, path: Path, source: str, split: str | None) -> None:
    if hf.saved_kind(path) == "dict":
        path, source = hf.saved_split(path, source, split)
    resolved = str(path.resolve())
    if resolved not in found:
        found[resolved] = hf.saved_file(path, source)


# ---------------------------------------------------------------------------------------------
# Planning


def plan_shards(inputs: list[CorpusFile], options: ReadOptions, target_bytes: int) -> list[list[dict]]:
    """Cut the records of `inputs` (in order) into shards of about `target_bytes` source bytes.

    Returns one list of segments per shard; a segment is a JSON dict {"file": index into `inputs`,
    "first": first record index, "count": records, "offset": where reading starts} plus, for a
    compressed file or a streamed dataset, "skip" (what is read and thrown away after `offset`; see
    `compressed.py`, `hf.py`). `offset` is a byte offset for .txt/.jsonl, -1 for records found by
    index. A shard closes after the record that brings it to `target_bytes` or more (to 1 /
    MAX_SHARDS_PER_REGION of the region when more, inside a compressed frame or a streamed dataset
    shard); a record is never split. Planning reads every input once, whatever the worker count.
    """
    if target_bytes < 1:
        raise CsdError(f"the shard size must be positive (got {target_bytes} bytes); pass a positive --shard-mb.")
    shards: list[list[dict]] = []
    current: list[dict] = []
    filled = 0
    for file_index, file in enumerate(inputs):
        segment = None
        record_index = 0
        for region_bytes, records in _regions(file, options):
            limit = target_bytes if region_bytes is None else max(target_bytes, -(-region_bytes // MAX_SHARDS_PER_REGION))
            for position, size in records:
                if segment is None:
                    where = position if isinstance(position, dict) else {"offset": position}
                    segment = {"file": file_index, "first": record_index, "count": 0, **where}
                    current.append(segment)
                segment["count"] += 1
                record_index += 1
                filled += size
                if filled >= limit:
                    shards.append(current)
                    current, filled, segment = [], 0, None
    if current:
        shards.append(current)
    return shards


def segment_spec(inputs: list[CorpusFile], segment: dict) -> dict:
    """A planned segment as a shard task carries it: its keys but the file index, and that file's own spec
    (`CorpusFile.spec`), so that a worker reopens it (`CorpusFile.from_spec`) without the input list."""
    return {**{key: value for key, value in segment.items() if key != "file"}, **inputs[segment["file"]].spec()}


def _regions(file: CorpusFile, options: ReadOptions) -> Iterator[tuple[int | None, Iterator]]:
    """(bytes of the region or None when seekable, its (position, size) records) of `file`."""
    if file.compression:
        positions = compressed.record_positions(file, options)
    elif file.format == "hf":
        positions = hf.record_positions(file, options)
    else:
        yield None, hf.record_positions(file, options) if file.format == "dataset" else files.record_sizes(file, options)
        return
    # Restart points: group the records of each frame / dataset shard to size it first.
    template, skips, sizes = None, array("q"), array("q")
    for position, size in positions:
        if template is not None and position["offset"] != template["offset"]:
            yield _region(template, skips, sizes)
            template, skips, sizes = None, array("q"), array("q")
        template = template or position
        skips.append(position["skip"])
        sizes.append(size)
    if template is not None:
        yield _region(template, skips, sizes)


def _region(template: dict, skips: array, sizes: array) -> tuple[int, Iterator]:
    return sum(sizes), ((dict(template, skip=skip), size) for skip, size in zip(skips, sizes))


# ---------------------------------------------------------------------------------------------
# Reading


def read_segment(file: CorpusFile, segment: dict, options: ReadOptions) -> Iterator[Document]:
    """Yield the documents of one segment (see `plan_shards`), in record order, rejected ones included.

    Raises `CsdError` for a compressed file that is truncated or damaged, or a dataset that changed.
    """
    if file.compression:
        return compressed.read_segment(file, segment, options)
    if file.format in ("dataset", "hf"):
        return hf.read_segment(file, segment, options)
    return files.read_segment(file, segment, options)
