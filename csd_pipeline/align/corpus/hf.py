"""Hugging Face `datasets` inputs.

- A folder written by `Dataset.save_to_disk` (format "dataset"; `DatasetDict.save_to_disk` writes one
  such folder per split, chosen with `--split`). It is opened with `datasets.load_from_disk`, which
  memory-maps its Arrow files: rows are read by index range, like Parquet rows (offset -1). Its
  identity is its path; its fingerprint adds the datasets fingerprint in `state.json`.
- `hf:NAME[:CONFIG]` (format "hf"): the split `--split` of `datasets.load_dataset(NAME, CONFIG)` read
  with `streaming=True`, so nothing is converted, copied or held in memory: from the local datasets
  cache when the dataset was loaded before (HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1 then keep
  everything off the network), else from its data files (a hub repository, or a local folder of
  parquet / jsonl / csv / txt files given by path). A streamed dataset has no random access: a row's
  position is a restart point, `offset` the index of the dataset's shard (data file) it is in and
  `skip` the rows before it in that shard. Its fingerprint adds the builder's config id and hash
  (the hub commit, or a hash of the data files).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from csd_pipeline.align.corpus.documents import CorpusFile, Document, ReadOptions
from csd_pipeline.align.corpus.files import table_documents
from csd_pipeline.errors import CsdError

PREFIX = "hf:"
_BATCH_ROWS = 1024
_OPENED: dict = {}  # per process: what this process opened, keyed by (path, split, revision)


def saved_kind(path: Path) -> str | None:
    """"dataset" for a `Dataset.save_to_disk` folder, "dict" for a `DatasetDict` one, else None."""
    if (path / "dataset_dict.json").is_file():
        return "dict"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return "dataset"
    return None


def saved_split(path: Path, shown: str, split: str | None) -> tuple[Path, str]:
    """(folder, source) of the split `split` of the DatasetDict folder `path`. Raises `CsdError`."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CsdError(f"corpus folder {shown} has an unreadable dataset_dict.json; save the dataset again with "
                       "DatasetDict.save_to_disk.") from None
    chosen = _choose_split(split, list(splits), shown)
    return path / chosen, f"{shown}/{chosen}"


def _choose_split(split: str | None, splits: list[str], shown: str) -> str:
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None:
        raise CsdError(f"corpus {shown} holds the splits {', '.join(splits)}; pick one with --split.")
    if split not in splits:
        raise CsdError(f"corpus {shown} has no split {split!r} (it holds {', '.join(splits)}); pass one of them "
                       "with --split.")
    return split


def saved_file(path: Path, source: str) -> CorpusFile:
    """The input of a `Dataset.save_to_disk` folder."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        data = [path / f["filename"] for f in state["_data_files"]]
        stats = [p.stat() for p in data]
    except (OSError, ValueError, KeyError, TypeError):
        raise CsdError(f"corpus folder {source} is not a readable save_to_disk folder (state.json or its Arrow "
                       "files); save the dataset again with Dataset.save_to_disk.") from None
    return CorpusFile(str(path.resolve()), source, "dataset", sum(s.st_size for s in stats),
                      max((s.st_mtime_ns for s in stats), default=0), revision=state.get("_fingerprint"))


def named_file(arg: str, split: str | None) -> CorpusFile:
    """The input of `hf:NAME[:CONFIG]` and `--split` (the only split when there is one). Raises `CsdError`."""
    name, config = parse_name(arg)
    builder = _builder(name, config, arg)
    try:
        splits = list(builder.as_streaming_dataset().keys())
    except Exception as err:  # datasets raises many types for an unusable dataset
        raise _load_error(arg, err) from None
    chosen = _choose_split(split, splits, arg)
    revision = f"{builder.config_id}@{builder.hash}"
    return CorpusFile(arg[len(PREFIX):], f"{arg}[{chosen}]", "hf", 0, 0, split=chosen, revision=revision)


def parse_name(arg: str) -> tuple[str, str | None]:
    """(NAME, CONFIG or None) of `hf:NAME[:CONFIG]`; a config has no `/`."""
    body = arg[len(PREFIX):]
    name, sep, config = body.rpartition(":")
    if not sep or not name or "/" in config:
        name, config = body, None
    if not name:
        raise CsdError(f"--corpus {arg} names no dataset; write hf:NAME or hf:NAME:CONFIG.")
    return name, config or None


def _builder(name: str, config: str | None, arg: str):
    try:
        import datasets
    except ImportError:
        raise CsdError("--corpus hf:NAME needs the datasets package; pip install datasets.") from None
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # its "using the cached version" notes, once per process and shard
    try:
        return datasets.load_dataset_builder(name, config)
    except Exception as err:  # ConnectionError offline, FileNotFoundError, ValueError for a config, ...
        raise _load_error(arg, err) from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _load_error(arg: str, err: Exception) -> CsdError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return CsdError(
        f"--corpus {arg}: datasets could not load it ({type(err).__name__}: {first_line}); check the name and "
        "config, and with HF_HUB_OFFLINE=1 load it once online first (it must be in the local datasets cache)."
    )


# ---------------------------------------------------------------------------------------------
# Planning and reading


def record_positions(file: CorpusFile, options: ReadOptions) -> Iterator[tuple[object, int]]:
    """(position, size) of each row: offset -1 for a saved folder, a restart point for a named dataset."""
    if file.format == "dataset":
        for table in _saved(file).with_format("arrow").iter(batch_size=_BATCH_ROWS):
            for size in _row_sizes(table, options):
                yield -1, size
        return
    stream = _streamed(file)
    for shard in range(stream.num_shards):
        skip = 0
        for table in _shard(stream, shard).with_format("arrow").iter(batch_size=_BATCH_ROWS):
            for size in _row_sizes(table, options):
                yield {"offset": shard, "skip": skip}, size
                skip += 1


def read_segment(file: CorpusFile, segment: dict, options: ReadOptions) -> Iterator[Document]:
    """Yield the documents of one segment of a datasets input, in row order, rejected ones included."""
    first, count = segment["first"], segment["count"]
    if file.format == "dataset":
        rows = _saved(file).with_format("arrow")
        for lo in range(first, first + count, _BATCH_ROWS):
            yield from table_documents(rows[lo:min(lo + _BATCH_ROWS, first + count)], file.source, lo, options)
        return
    stream, index, skip = _streamed(file), first, segment["skip"]
    for shard in range(segment["offset"], stream.num_shards):
        for table in _shard(stream, shard).with_format("arrow").iter(batch_size=_BATCH_ROWS):
            if skip >= table.num_rows:
                skip -= table.num_rows
                continue
            table = table.slice(skip, first + count - index)
            skip = 0
            yield from table_documents(table, file.source, index, options)
            index += table.num_rows
            if index == first + count:
                return
    raise CsdError(f"corpus {file.source} ended {first + count - index} rows early; it changed since the shards "
                   "were planned: run with a new --output.")


def _row_sizes(table, options: ReadOptions) -> list[int]:
    """Planning sizes of a batch of rows: the text's UTF-8 length (1 if none), or the row's Arrow bytes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if options.whole_record or options.text_field not in table.column_names:
        return [max(1, table.nbytes // max(1, table.num_rows))] * table.num_rows
    column = table.column(options.text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return [1] * table.num_rows
    return pc.fill_null(pc.binary_length(column), 1).to_pylist()


def _saved(file: CorpusFile):
    key = (file.path, None, file.revision)
    if key not in _OPENED:
        import datasets

        try:
            _OPENED[key] = datasets.load_from_disk(file.path)
        except Exception as err:  # FileNotFoundError, ArrowInvalid for damaged files
            raise CsdError(f"corpus folder {file.source} does not load with datasets.load_from_disk ({err}); save "
                           "it again.") from None
    return _OPENED[key]


def _streamed(file: CorpusFile):
    key = (file.path, file.split, file.revision)
    if key not in _OPENED:
        name, config = parse_name(PREFIX + file.path)
        builder = _builder(name, config, PREFIX + file.path)
        if f"{builder.config_id}@{builder.hash}" != file.revision:
            raise CsdError(f"corpus {file.source} changed since the shards were planned (now {builder.config_id}@"
                           f"{builder.hash}, planned {file.revision}); run with a new --output.")
        _OPENED[key] = builder.as_streaming_dataset(split=file.split)
    return _OPENED[key]


def _shard(stream, index: int):
    # Contiguous shards of `num_shards` are the dataset's own shards (its data files), in order.
    return stream.shard(num_shards=stream.num_shards, index=index, contiguous=True)

