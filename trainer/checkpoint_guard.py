"""Reading a DCP checkpoint without letting it run code.

`torch.distributed.checkpoint` stores its index, `.metadata`, as a pickle, and the non-tensor
values of the state (optimizer hyper-parameters) as `torch.save` pickles inside the `.distcp`
files; its own reader unpickles both without restriction, so a planted file could run any
command on `--resume`. Here a checkpoint is read in three guarded steps, before DCP touches it:

1. `.metadata`'s sha256 is compared with the one `complete.json` recorded when the checkpoint was
   written (`metadata_sha256`); a mismatch is refused before anything is unpickled. Checkpoints
   written before the hash was recorded have none and go on to step 2 alone.
2. `.metadata` is unpickled by `MetadataUnpickler`, which admits only the classes DCP writes
   there (its metadata dataclasses, `torch.Size`, torch dtypes and layouts, paths); anything else
   is refused. Every storage file it names must lie inside the checkpoint folder.
3. DCP then loads with `GuardedReader` (which hands DCP the metadata parsed in step 2) and
   `GuardedPlanner` (which loads each non-tensor value with `torch.load(weights_only=True)`;
   tensors already are). Any failure becomes a `CsdError`: DCP's `CheckpointException` derives
   from `BaseException`, so it is caught by name.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import bytes_sha256, file_sha256
from csd_pipeline.runtime.storage import is_remote, location

METADATA_FILE = ".metadata"
HASH_KEY = "metadata_sha256"

# (module, name) pairs DCP writes into `.metadata` (torch 2.x FileSystemWriter).
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


def metadata_sha256(folder) -> str:
    """sha256 (hex) of a checkpoint folder's `.metadata`."""
    return file_sha256(location(folder) / METADATA_FILE)


def _fix_hint(folder: Path) -> str:
    return (f"delete {folder} to resume from the checkpoint before it, or restore the folder from where "
            "you copied it")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP `.metadata` only: any global outside `_DCP_CLASSES` (and torch dtypes) raises."""

    def __init__(self, file, folder: Path):
        super().__init__(file)
        self.folder = folder

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CsdError(f"checkpoint {self.folder}: its {METADATA_FILE} asks to load {module}.{name}, which DCP never "
                       f"writes there (refused: unpickling it could run code); {_fix_hint(self.folder)}")


def read_checked_metadata(folder, complete: dict):
    """The DCP `Metadata` of a checkpoint folder, checked as the module docstring says (steps 1 and 2).

    `complete`: the folder's parsed `complete.json`. Raises `CsdError` (one line) when the metadata
    does not match its recorded sha256, names a class DCP does not write, points outside the folder
    or is not a readable pickle.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    folder = location(folder)
    path = folder / METADATA_FILE
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CsdError(f"checkpoint {folder}: cannot read {METADATA_FILE} ({err.strerror or err}); "
                       f"{_fix_hint(folder)}") from None
    recorded = complete.get(HASH_KEY)
    if recorded is not None and bytes_sha256(data) != recorded:
        raise CsdError(f"checkpoint {folder}: its {METADATA_FILE} does not have the sha256 recorded in complete.json "
                       f"(it changed after the checkpoint was written, and loading it could run code); "
                       f"{_fix_hint(folder)}")
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), folder).load()
    except CsdError:
        raise
    except Exception as err:  # a damaged pickle fails in many ways (EOFError, UnpicklingError, TypeError, ...)
        raise CsdError(f"checkpoint {folder}: its {METADATA_FILE} is not a readable DCP index "
                       f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                       f"{_fix_hint(folder)}") from None
    if not isinstance(metadata, Metadata):
        raise CsdError(f"checkpoint {folder}: its {METADATA_FILE} holds a {type(metadata).__name__}, not a DCP "
                       f"index; {_fix_hint(folder)}")
    _check_storage_paths(metadata, folder)
    return metadata


def _check_storage_paths(metadata, folder: Path) -> None:
    from csd_pipeline.runtime.safe_paths import path_inside

    for info in (metadata.storage_data or {}).values():
        path_inside(folder, getattr(info, "relative_path", None), f"the index of checkpoint {folder} names a storage file",
                    f"{_fix_hint(folder)}")


def guarded_load(state: dict, folder, metadata) -> None:
    """`dcp.load(state, ...)` from `folder` with the checked `metadata` (step 3); raises `CsdError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = location(folder)
    try:
        dcp.load(state, storage_reader=GuardedReader(folder, metadata), planner=GuardedPlanner())
    except CsdError:
        raise
    except (Exception, CheckpointException) as err:
        raise CsdError(f"checkpoint {folder} could not be loaded ({first_failure(err)}); "
                       f"{_fix_hint(folder)}") from None


def first_failure(err: BaseException) -> str:
    """The first line of the underlying error (DCP wraps each rank's failure in CheckpointException)."""
    failures = getattr(err, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CsdError):
            return str(inner)
        text = str(inner).splitlines()[0] if str(inner) else ""
        return f"{type(inner).__name__}: {text}" if text else type(inner).__name__
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@functools.cache
def _reader_class(remote: bool):
    if remote:  # DCP's fsspec reader: the same reads, through fsspec
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as FileSystemReader
    else:
        from torch.distributed.checkpoint import FileSystemReader

    class GuardedReaderImpl(FileSystemReader):
        """A FileSystemReader that never unpickles `.metadata` itself: it returns the checked one."""

        def __init__(self, path, metadata):
            if remote:
                super().__init__(str(path), **path.storage_options)
            else:
                super().__init__(path)
            self._checked = metadata

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(self._checked, "storage_meta", None) is None:
                self._checked.storage_meta = StorageMeta()
            self._checked.storage_meta.load_id = self.load_id
            return self._checked

    return GuardedReaderImpl


@functools.cache
def _planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class GuardedPlannerImpl(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values must pass `torch.load(weights_only=True)` first."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                first = str(err).splitlines()[0] if str(err) else ""
                raise CsdError(f"value {read_item.dest_index.fqn} is not plain data ({first[:160]}); refused, "
                               "since loading it could run code") from None
            value.seek(0)
            super().load_bytes(read_item, value)  # the same bytes, now known to hold only plain data

    return GuardedPlannerImpl


def GuardedReader(path, metadata):  # noqa: N802 (a class factory: DCP is imported only when a checkpoint is read)
    return _reader_class(is_remote(path))(path, metadata)


def GuardedPlanner():  # noqa: N802
    return _planner_class()()
