"""The one home of atomic writes (`*.tmp`, then rename) and of sha256 helpers.

A reader never sees half a file: everything is written under a temporary name next to its final
path, flushed to disk, then renamed over it (`os.replace`, atomic on POSIX file systems).
Temporary names end with `.tmp`, so listings ignore them, and carry the host name, process id and
(outside the main thread) thread id, so ranks or threads never write the same temporary file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from csd_pipeline.runtime import storage

HASH_BLOCK = 1 << 20


def tmp_path(path) -> Path:
    """The temporary name of `path` for this host, process and thread: `<name>.<host>.<pid>[-<thread>].tmp`,
    same folder (the thread only outside the main thread, so threads that write one file never share it)."""
    path = Path(path)
    thread = "" if threading.current_thread() is threading.main_thread() else f"-{threading.get_ident()}"
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}{thread}.tmp")


def commit(tmp, path) -> None:
    """Flush the finished file `tmp` to disk and rename it to `path` (replacing what was there); for an
    object-store `path`, upload it whole instead (runtime/storage.py)."""
    if storage.is_remote(path):
        storage.upload(Path(tmp), path)
        return
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


@contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yield a temporary path to write `path` through; `commit` it when the block succeeds.

    The folder of `path` is created. If the block raises, the temporary file is removed and `path`
    is left as it was.
    """
    path = storage.location(path)
    if not storage.is_remote(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = storage.staging_path(path)
    try:
        yield tmp
        commit(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path, data: bytes) -> None:
    """Write `data` to `path` atomically (an object: in one request)."""
    path = storage.location(path)
    if storage.is_remote(path):
        storage.write_object(path, data)
        return
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def json_bytes(obj) -> bytes:
    """The canonical JSON encoding of run records, markers and manifests (sorted keys, indent 2, UTF-8)."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _unique_keys(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def strict_json(data: bytes | str):
    """Parse JSON written by this package, strictly: UTF-8, no duplicate keys, no NaN or Infinity.

    Raises `ValueError` (one line) for anything else, including nesting too deep to parse and
    integers too long to convert, which `json.loads` raises as other types or lets through.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except UnicodeDecodeError as err:
        raise ValueError(f"invalid UTF-8 at byte {err.start}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as err:
        raise ValueError(str(err).splitlines()[0]) from None


def atomic_write_json(path, obj) -> None:
    """Write `obj` as canonical JSON (`json_bytes`) to `path` atomically."""
    atomic_write_bytes(path, json_bytes(obj))


def atomic_copy(source, target) -> None:
    """Copy the file `source` to `target` atomically."""
    with atomic_path(target) as tmp, storage.open_input(source) as reader, open(tmp, "wb") as writer:
        shutil.copyfileobj(reader, writer)


def replace_directory(built, final) -> None:
    """Put the finished folder `built` at `final`, replacing a folder that is there.

    A folder cannot be renamed over one that has content, so the old one is first moved aside
    under a `*.tmp` name, then removed.
    """
    built, final = Path(built), Path(final)
    old = tmp_path(final.with_name(final.name + ".old"))
    if final.exists():
        os.replace(final, old)
    os.replace(built, final)
    shutil.rmtree(old, ignore_errors=True)


def remove_tmp_files(directory, names) -> None:
    """Remove the temporary files that any host or process left for the final file names `names` in
    `directory` (a killed writer leaves `<name>.<host>.<pid>.tmp`)."""
    directory = Path(directory)
    for name in names:
        for path in directory.glob(f"{name}.*.tmp"):
            path.unlink(missing_ok=True)


def file_sha256(path) -> str:
    """sha256 of a file's bytes, as hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with storage.open_input(path) as handle:
        for block in iter(lambda: handle.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def bytes_sha256(*parts: bytes) -> str:
    """sha256 of the concatenation of `parts`, as hex."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()
