"""DCP checkpoints in `OUTPUT/checkpoints/step-N/`, complete only once `complete.json` exists.

A checkpoint holds, for every rank, the sharded model and optimizer state
(`torch.distributed.checkpoint`), plus small JSON files: `trainer.json` (step, scheduler state,
run counters; rank 0) and `ranks/rank-RRRRR.json` (each rank's data-loader state and RNG
states). Everything is written into `step-N.tmp/`; after every rank has finished, rank 0 writes
`complete.json` and renames the folder to `step-N/`. A failed write (disk full, ...) is agreed
on by all ranks, the partial folder is removed and the previous checkpoints are left as they
were. Only the latest `save_total_limit` complete checkpoints are kept.

DCP itself pickles: its index `.metadata` is a pickle and the optimizer's non-tensor values are
`torch.save` pickles. So `complete.json` records the sha256 of `.metadata`, and a checkpoint is
only ever read through `trainer.checkpoint_guard` (hash check, then an unpickler that admits only
DCP's own classes, then `weights_only=True` for every value); the rest is JSON.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import storage
from csd_pipeline.runtime.files import atomic_write_text, replace_directory, strict_json
from trainer import checkpoint_guard, distributed

CHECKPOINT_VERSION = 1
COMPLETE_FILE = "complete.json"
CRASH_ENV = "CSD_TEST_CRASH"  # tests: "checkpoint_<point>:<step>" SIGKILLs this process at that point
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class ResumeState:
    """What a checkpoint restores besides the model and optimizer."""

    step: int
    trainer: dict       # scheduler state, counters
    loader_state: dict  # this rank's data-loader state
    path: Path


def checkpoint_root(output: str | os.PathLike) -> Path:
    return storage.location(output) / "checkpoints"


def complete_checkpoints(output: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first. Ignores `*.tmp` and unfinished folders."""
    root = checkpoint_root(output)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / COMPLETE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True))


def rng_state(device) -> dict:
    """The torch RNG states of this process (CPU and the current CUDA device), base64."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict, device) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8),
                                 device)


def save_checkpoint(output, step: int, wrapper, optimizer, trainer_state: dict, loader_state: dict,
                    ctx, save_total_limit: int) -> Path:
    """Write `checkpoints/step-{step}/` (collective: every rank calls it). Returns the folder.

    Raises `CsdError` on every rank when any rank failed to write; the partial folder is removed
    and older checkpoints stay intact.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = checkpoint_root(output)
    final = root / f"step-{step}"
    remote = storage.is_remote(root)
    # On an object store there is no folder rename: the files go straight into step-N/, and the
    # checkpoint counts once complete.json, written last, exists (a step-N/ without it is removed).
    tmp = final if remote else root / f"step-{step}.tmp"
    if ctx.is_main:
        if not remote:
            root.mkdir(parents=True, exist_ok=True)
        _remove_tree(tmp)  # a resumed run re-saving step N on an object store: the old step-N/ goes first
    distributed.barrier()
    failure = None
    try:
        (tmp / "ranks").mkdir(parents=True, exist_ok=True)
        _write_json(tmp / "ranks" / f"rank-{ctx.rank:05d}.json",
                    {"loader": loader_state, "rng": rng_state(ctx.device), "world": ctx.world})
        if ctx.is_main:
            _write_json(tmp / "trainer.json", {"version": CHECKPOINT_VERSION, "step": step,
                                               "world": ctx.world, **trainer_state})
    except OSError as err:
        failure = err
    # Agree before the collective DCP write, so that no rank waits on one that gave up.
    if distributed.agree_any(failure is not None, ctx.device):
        _discard(tmp, ctx)
        raise CsdError(_failure_message(final, failure, output))
    try:
        model_state, optim_state = get_state_dict(wrapper, optimizer)
        if remote:  # DCP's fsspec writer, straight into the object store
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            dcp.save({"model": model_state, "optim": optim_state},
                     storage_writer=FsspecWriter(str(tmp), **tmp.storage_options))
        else:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
        _maybe_crash("checkpoint_written", step)
    except (Exception, CheckpointException) as err:  # CheckpointException (every rank) is a BaseException
        failure = err
    if distributed.agree_any(failure is not None, ctx.device):
        _discard(tmp, ctx)
        raise CsdError(_failure_message(final, failure, output))
    distributed.barrier()
    if ctx.is_main:
        try:
            _write_json(tmp / COMPLETE_FILE, {"version": CHECKPOINT_VERSION, "step": step, "world": ctx.world,
                                              checkpoint_guard.HASH_KEY: checkpoint_guard.metadata_sha256(tmp)})
            _maybe_crash("checkpoint_complete", step)
            if not remote:
                replace_directory(tmp, final)  # a resumed run re-saving a step: the new one replaces it
        except OSError as err:
            failure = err
    if distributed.agree_any(failure is not None, ctx.device):
        _discard(tmp, ctx)
        raise CsdError(_failure_message(final, failure, output))
    if ctx.is_main:
        for _, old in complete_checkpoints(output)[:-save_total_limit]:
            _remove_tree(old)
    distributed.barrier()
    return final


def _remove_tree(folder) -> None:
    """Remove a checkpoint folder (quietly when it is not there)."""
    if not storage.is_remote(folder):
        shutil.rmtree(folder, ignore_errors=True)
    elif folder.exists():
        folder.fs.rm(folder.path, recursive=True)


def _maybe_crash(point: str, step: int) -> None:
    # Test hook: CSD_TEST_CRASH="checkpoint_written:4" kills this process once step 4's DCP files are written.
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _discard(tmp: Path, ctx) -> None:
    distributed.barrier()
    if ctx.is_main:
        _remove_tree(tmp)


def _failure_message(final: Path, failure, output) -> str:
    reason = checkpoint_guard.first_failure(failure) if failure is not None else "another rank failed"
    previous = complete_checkpoints(output)
    kept = f"the previous checkpoint {previous[-1][1].name} is intact" if previous else "no earlier checkpoint exists"
    try:  # DCP reports a full disk as e.g. "RuntimeError: unexpected pos": say how much space is left
        free = "" if storage.is_remote(final) else f"; {shutil.disk_usage(final.parent).free >> 20} MiB free there"
    except OSError:
        free = ""
    return (f"writing checkpoint {final} failed ({reason}{free}); {kept}; free space or fix the output "
            f"directory and re-run with --resume")


def load_checkpoint(output, wrapper, optimizer, ctx) -> ResumeState | None:
    """Restore the latest complete checkpoint into `wrapper` and `optimizer` (collective).

    Returns None when there is none. Raises `CsdError` when it was written by a different number
    of ranks (each rank's data position would be wrong), is unreadable, or fails the checks of
    `trainer.checkpoint_guard` (nothing of it is unpickled before they pass).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = complete_checkpoints(output)
    # every rank must pick the same folder: rank 0 decides
    choice = distributed.broadcast_json(str(found[-1][1]) if found else None, ctx.device)
    if choice is None:
        return None
    path = storage.location(choice)
    trainer = _read_record(path, "trainer.json")
    rank_file = f"ranks/rank-{ctx.rank:05d}.json"
    if trainer.get("world") != ctx.world or not (path / rank_file).is_file():
        raise CsdError(
            f"checkpoint {path} was written by {trainer.get('world')} ranks, this run has {ctx.world}; "
            f"resume with --nproc-per-node/--nnodes giving {trainer.get('world')} ranks"
        )
    rank_state = _read_record(path, rank_file)
    metadata = checkpoint_guard.read_checked_metadata(path, read_complete(path))
    model_state, optim_state = get_state_dict(wrapper, optimizer)
    state = {"model": model_state, "optim": optim_state}
    checkpoint_guard.guarded_load(state, path, metadata)
    set_state_dict(wrapper, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    set_rng_state(rank_state["rng"], ctx.device)
    return ResumeState(step=int(trainer["step"]), trainer=trainer, loader_state=rank_state["loader"], path=path)


def read_complete(path) -> dict:
    """The `complete.json` of checkpoint folder `path`. Raises `CsdError` when it is unreadable or not an object."""
    return _read_record(storage.location(path), COMPLETE_FILE)


def _read_record(path: Path, name: str) -> dict:
    try:
        record = strict_json((path / name).read_bytes())
    except (OSError, ValueError) as err:
        raise CsdError(f"checkpoint {path} is unreadable ({name}: {err}); delete it to resume from an earlier one") from None
    if not isinstance(record, dict):
        raise CsdError(f"checkpoint {path} is unreadable ({name} is not a JSON object); delete it to resume from an "
                       "earlier one")
    return record


def clean_partial(output, ctx) -> None:
    """Remove `step-N.tmp/` folders left by a killed run (rank 0); on an object store, the `step-N/`
    folders without `complete.json`."""
    root = checkpoint_root(output)
    if ctx.is_main and root.is_dir():
        remote = storage.is_remote(root)
        for entry in root.iterdir():
            partial = (_STEP_DIR.match(entry.name) and not (entry / COMPLETE_FILE).is_file()) if remote else (
                entry.name.endswith(".tmp"))
            if partial and entry.is_dir():
                _remove_tree(entry)
    distributed.barrier()
