"""Paths read from a manifest, run record or checkpoint index stay inside their folder.

A stage output names its files relative to its own directory (`shards[].file`, `tables[]`);
a checkpoint index names its storage files relative to the checkpoint folder. Such a name is
refused when it is not a plain relative path, or when the path it gives, with every symlink
resolved, lies outside the (equally resolved) folder: an edited `file: ../../elsewhere.parquet`
or `/etc/passwd` is never opened.
"""

from __future__ import annotations

import os
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import is_remote, location


def path_inside(folder, relative, what: str, hint: str) -> Path:
    """`folder / relative`, checked to lie inside `folder` (symlinks resolved); returns the joined path.

    `what` names the entry in the error ("shard file of /data/aligned"), `hint` says what to do.
    Raises `CsdError` (one line) for a name that is not a non-empty string, is absolute, or
    resolves outside `folder`.
    """
    folder = location(folder)
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise CsdError(f"{what} {relative!r}, which is not a file name inside {folder}; refused: {hint}")
    if os.path.isabs(relative) or Path(relative).is_absolute():
        raise CsdError(f"{what} {relative!r}, an absolute path, not a name inside {folder}; refused: {hint}")
    joined = folder / relative
    if is_remote(folder):  # an object store has no symlinks: a plain name without `..` stays inside
        if ".." in Path(relative).parts:
            raise CsdError(f"{what} {relative!r}, which leads outside {folder}; refused: {hint}")
        return joined
    root = folder.resolve()
    target = joined.resolve()
    if target != root and root not in target.parents:
        raise CsdError(f"{what} {relative!r}, which leads outside {folder} (to {target}); refused: {hint}")
    return joined


def check_manifest_paths(manifest: dict, directory, hint: str) -> None:
    """Check every file a stage manifest names (shards, tables) with `path_inside`; raises `CsdError`."""
    directory = location(directory)
    for shard in manifest.get("shards") or []:
        file = shard.get("file") if isinstance(shard, dict) else None
        path_inside(directory, file, f"the manifest of {directory} names a shard file", hint)
    for entry in manifest.get("tables") or []:
        if not isinstance(entry, dict):
            continue
        for key in ("student_to_teacher", "teacher_to_student"):
            if key in entry:
                path_inside(directory, entry[key], f"the manifest of {directory} names a table", hint)


def check_recorded_tasks(tasks, corpus_paths: set[str], directory) -> None:
    """The tasks of a recorded align run (`DIR/run.json`) name shards inside DIR and read only `corpus_paths`,
    the files the given --corpus expands to; raises `CsdError` otherwise (an edited run record)."""
    fix = f"delete {directory} or pass a new --output"
    for task in tasks:
        path_inside(directory, f"{task.name}.parquet", f"{directory}/run.json names a shard", fix)
        if "/" in task.name or "\\" in task.name:
            raise CsdError(f"{directory}/run.json names a shard {task.name!r} in a sub-folder (an edited run record; "
                           f"refused); {fix}")
        for segment in task.spec.get("segments") or []:
            if segment.get("path") not in corpus_paths:
                raise CsdError(f"{directory}/run.json has shard {task.name} read {segment.get('path')!r}, which is not "
                               f"one of the --corpus files (an edited run record; refused); {fix}")
