"""The shared stage executor: shards, ranks, workers, atomic writes, markers, the manifest.

A stage (align, teacher-logits) describes its work as a list of `ShardTask`s, every shard of every
rank, each a pure description (JSON) of one output file's input. The executor:

1. records the run in `DIR/run.json` (stage, identity, tasks) or, on a re-run, checks that the
   recorded run is the same one (else a `CsdError`: another run's output);
2. runs this rank's tasks, `tasks[rank::world_size]`, in `workers` processes; each shard is written
   by the stage's processor to a temporary name, then renamed, then its completion marker
   `DIR/done/<name>.done` (rows, bytes, sha256, stats) is written; shards with a marker are skipped,
   so a killed run resumes where it stopped and ends with the same bytes;
3. writes `DIR/stats/rank-RRRRR.json` (this rank's stats, summed over its shards);
4. writes `DIR/manifest.json` last, if every shard of every rank is complete. Any rank that finds
   everything complete writes it (same bytes, atomic rename), and `finalize(DIR)` (the
   `csd-pipeline status DIR --finalize` command) does the same afterwards.

Shard bytes must depend only on the task's spec, never on rank, worker count or timing; the
manifest holds no timestamps or worker counts, so it is byte-identical too.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import progress
from csd_pipeline.runtime.manifest import MANIFEST_NAME, MANIFEST_VERSION

RUN_NAME = "run.json"
RUN_VERSION = 1
RESERVED_KEYS = {"manifest_version", "stage", "schema_version", "shards", "totals"}
CRASH_ENV = "CSD_TEST_CRASH"  # tests: "<point>:<n>" kills this process at <point> of its n-th shard


# ---------------------------------------------------------------------------------------------
# Atomic files


def _tmp_path(path: Path) -> Path:
    # Unique per host and process, so ranks sharing a file system never collide; ends with .tmp.
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")


def atomic_write_bytes(path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(path)
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def json_bytes(obj) -> bytes:
    """The canonical JSON encoding used for run files, markers and manifests (sorted keys)."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def atomic_write_json(path, obj) -> None:
    """Write `obj` as canonical JSON to `path`, atomically."""
    atomic_write_bytes(path, json_bytes(obj))


def file_sha256(path) -> str:
    """sha256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Ranks and shard names


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's (rank, world_size): from the flags when given, else from torchrun
    (RANK/WORLD_SIZE) or SLURM (SLURM_PROCID/SLURM_NTASKS) variables, else (0, 1).

    Raises `CsdError` when only one of the pair is given or the values are out of range.
    """
    source = "--rank/--world-size"
    if rank is None and world_size is None:
        for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
            if rank_var in os.environ and size_var in os.environ:
                source = f"{rank_var}/{size_var}"
                try:
                    rank, world_size = int(os.environ[rank_var]), int(os.environ[size_var])
                except ValueError:
                    raise CsdError(
                        f"the environment variables {source} are not integers "
                        f"({os.environ[rank_var]!r}, {os.environ[size_var]!r}); fix them or pass --rank/--world-size."
                    ) from None
                break
        else:
            return 0, 1
    if rank is None or world_size is None:
        raise CsdError("--rank and --world-size go together; pass both or neither.")
    if world_size < 1 or not 0 <= rank < world_size:
        raise CsdError(f"rank {rank} of world size {world_size} (from {source}) is out of range; "
                       "the rank must be in [0, world_size).")
    return rank, world_size


def shard_name(rank: int, index: int) -> str:
    """The file stem of shard `index` written by `rank`: `part-RRRRR-IIIII`."""
    return f"part-{rank:05d}-{index:05d}"


# ---------------------------------------------------------------------------------------------
# Stage description


@dataclass(frozen=True)
class ShardTask:
    """One output shard: its global index, file stem and the stage's JSON description of its input."""

    index: int
    name: str
    spec: dict

    def to_json(self) -> dict:
        return {"index": self.index, "name": self.name, "spec": self.spec}


@dataclass
class ShardResult:
    """What a processor reports about a shard it wrote: its row count and stats (nested dict of numbers)."""

    rows: int
    stats: dict = field(default_factory=dict)


@dataclass
class StageRun:
    """Everything the executor needs to run (or finalize) one stage output.

    - `stage`: the stage name recorded in the manifest ("align", ...).
    - `schema_version`: the version of the Arrow schema of the shards.
    - `output_dir`: the stage output directory.
    - `identity`: JSON dict (e.g. {"config": ..., "inputs": ..., "tokenizers": ...}) that a re-run
      into the same directory must match exactly; its keys become top-level manifest keys.
    - `extra`: JSON dict of more top-level manifest keys that do not decide identity (e.g. "tables").
    - `tasks`: every shard of every rank, in index order (index i at position i).
    - `processor`: "module:function"; `function(processor_config)` is called once per process and
      returns a callable `(task: ShardTask, tmp_path: Path) -> ShardResult` that writes the shard.
    - `processor_config`: JSON-able dict passed to that factory.
    - `suffix`: the shard file suffix (".parquet").
    - `work`, `work_unit`: a shard's units of work from its spec, and their name, for the progress bar
      (the processor calls `progress.advance` in that unit); None: one per shard.
    """

    stage: str
    schema_version: int
    output_dir: Path
    identity: dict
    tasks: list[ShardTask]
    processor: str
    processor_config: dict
    extra: dict = field(default_factory=dict)
    suffix: str = ".parquet"
    work: Callable[[dict], int] | None = None
    work_unit: str = "shard"


@dataclass
class RunReport:
    """What `run_stage` did on this rank."""

    rank: int
    world_size: int
    processed: list[str]
    skipped: list[str]
    manifest_written: bool
    complete: bool


# ---------------------------------------------------------------------------------------------
# Run record


def _run_record(run: StageRun) -> dict:
    return {
        "run_version": RUN_VERSION,
        "stage": run.stage,
        "schema_version": run.schema_version,
        "identity": run.identity,
        "extra": run.extra,
        "suffix": run.suffix,
        "tasks": [task.to_json() for task in run.tasks],
    }


def _differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ, one level into nested dicts (`config.max_student_tokens`)."""
    keys = []
    for key in sorted(set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if left == right:
            continue
        if isinstance(left, dict) and isinstance(right, dict) and not prefix:
            keys += _differing_keys(left, right, f"{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def check_identity(directory, stage: str, identity: dict) -> None:
    """Raise `CsdError` when `directory` holds the output (manifest) or the run record of another run:
    a different stage, or identity values (config, inputs, fingerprints) that differ from `identity`.

    Cheap; stages call it before doing any work that writes into the directory.
    """
    out = Path(directory)
    for key in identity:
        if key in RESERVED_KEYS:
            raise ValueError(f"identity key {key!r} is reserved by the manifest format")
    for path, kind in ((out / MANIFEST_NAME, "manifest"), (out / RUN_NAME, "run")):
        if not path.is_file():
            continue
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            found = None
        if not isinstance(found, dict):
            raise CsdError(f"{path} is unreadable; delete {out} (or pass a new --output) and run the stage again.")
        recorded = found.get("identity", {}) if kind == "run" else {key: found.get(key) for key in identity}
        differ = _differing_keys(recorded, identity)
        if found.get("stage") != stage or differ:
            raise CsdError(
                f"{out} already holds the output of another {found.get('stage', 'unknown')} run "
                f"(its {', '.join(differ) or 'stage'} differ from this run's); pass a new --output or delete {out}."
            )


def check_or_record_run(run: StageRun) -> dict:
    """Record `run` in `DIR/run.json`, or check that the recorded run is this one.

    Returns the recorded run dict. Raises `CsdError` when the directory holds another run's
    output (a different stage, config or inputs, or a different shard layout).
    """
    out = Path(run.output_dir)
    check_identity(out, run.stage, run.identity)
    record = _run_record(run)
    run_path = out / RUN_NAME
    if not run_path.is_file():
        atomic_write_json(run_path, record)
        return record
    existing = json.loads(run_path.read_text(encoding="utf-8"))
    if existing.get("tasks") != record["tasks"]:
        old, new = existing.get("tasks") or [], record["tasks"]
        raise CsdError(
            f"{out} was started with a different shard layout ({len(old)} shards, first "
            f"{old[0]['name'] if old else '-'}; now {len(new)}, first {new[0]['name'] if new else '-'}), "
            "usually a different --world-size or shard size; re-run with the original settings or use a new --output."
        )
    differ = [key for key in record if existing.get(key) != record[key]]
    if differ:
        raise CsdError(
            f"{out} was started by another version or setting of the {run.stage} stage (its {', '.join(differ)} "
            f"differ); use a new --output or delete {out}."
        )
    return existing


def read_run_record(directory) -> dict:
    """Read `DIR/run.json`. Raises `CsdError` when the directory holds no run."""
    path = Path(directory) / RUN_NAME
    if not path.is_file():
        raise CsdError(f"{directory} holds no stage run ({RUN_NAME} is missing); check the path or start the stage.")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CsdError(f"{path} is unreadable ({err}); delete {directory} and run the stage again.") from None


# ---------------------------------------------------------------------------------------------
# Markers and stats


def marker_path(directory, name: str) -> Path:
    """Where the completion marker of shard `name` lives."""
    return Path(directory) / "done" / f"{name}.done"


def read_marker(directory, name: str, suffix: str) -> dict | None:
    """The completion marker of shard `name` if it exists and its shard file has the recorded size."""
    path = marker_path(directory, name)
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    shard = Path(directory) / f"{name}{suffix}"
    if not shard.is_file() or shard.stat().st_size != marker.get("bytes"):
        return None
    return marker


def merge_stats(total: dict, part: dict) -> dict:
    """Add the nested counters of `part` into `total` (in place) and return `total`."""
    for key, value in part.items():
        if isinstance(value, dict):
            merge_stats(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def _sorted_stats(stats: dict) -> dict:
    return {k: _sorted_stats(v) if isinstance(v, dict) else v for k, v in sorted(stats.items())}


# ---------------------------------------------------------------------------------------------
# Running shards

_WORKER_PROCESSOR = None
_WORKER_COUNT = 0


def _load_processor(processor: str, config: dict):
    import importlib

    module_name, attr = processor.split(":")
    return getattr(importlib.import_module(module_name), attr)(config)


def _init_worker(processor: str, config: dict, counter=None) -> None:
    global _WORKER_PROCESSOR
    progress.use_counter(counter)
    _WORKER_PROCESSOR = _load_processor(processor, config)


def _maybe_crash(point: str) -> None:
    # Test hook: CSD_TEST_CRASH="before_rename:2" kills this process at that point of its 2nd shard.
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    want_point, _, count = wanted.partition(":")
    if want_point == point and str(_WORKER_COUNT) == count:
        os.kill(os.getpid(), signal.SIGKILL)


def _write_shard(processor, task: dict, directory: str, suffix: str) -> dict:
    """Run one shard to completion: write to a temporary file, rename, write the marker."""
    global _WORKER_COUNT
    _WORKER_COUNT += 1
    task_obj = ShardTask(task["index"], task["name"], task["spec"])
    final = Path(directory) / f"{task_obj.name}{suffix}"
    tmp = _tmp_path(final)
    result = processor(task_obj, tmp)
    _maybe_crash("before_rename")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    marker = {
        "name": task_obj.name,
        "index": task_obj.index,
        "file": final.name,
        "rows": int(result.rows),
        "bytes": tmp.stat().st_size,
        "sha256": file_sha256(tmp),
        "stats": _sorted_stats(result.stats),
    }
    os.replace(tmp, final)
    _maybe_crash("before_marker")
    atomic_write_json(marker_path(directory, task_obj.name), marker)
    _maybe_crash("after_marker")
    return marker


def _worker_write_shard(task: dict, directory: str, suffix: str) -> dict:
    marker = _write_shard(_WORKER_PROCESSOR, task, directory, suffix)
    progress.shard_finished()
    return marker


def _remove_stale_tmp(directory: Path, names: list[str], suffix: str) -> None:
    # A killed run leaves `<shard>.<host>.<pid>.tmp`; this rank owns its shards' names.
    prefixes = tuple(f"{name}{suffix}." for name in names)
    if not prefixes:
        return
    for path in directory.glob(f"*{suffix}.*.tmp"):
        if path.name.startswith(prefixes):
            path.unlink(missing_ok=True)


def run_stage(run: StageRun, *, rank: int = 0, world_size: int = 1, workers: int = 1,
              log: Callable[[str], None] | None = None) -> RunReport:
    """Run this rank's shards of `run` (skipping completed ones), then write its stats and, if every
    shard of every rank is complete, the manifest.

    Returns a `RunReport`. Raises `CsdError` when the directory holds another run, or when a worker
    process dies (re-running resumes).
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_or_record_run(run)
    mine = run.tasks[rank::world_size]
    if (out / MANIFEST_NAME).is_file() and all(read_marker(out, t.name, run.suffix) for t in mine):
        log(f"{out}: already complete (manifest present); nothing to do.")
        return RunReport(rank, world_size, [], [t.name for t in mine], False, True)
    pending = [t for t in mine if read_marker(out, t.name, run.suffix) is None]
    skipped = [t.name for t in mine if t not in pending]
    if skipped:
        log(f"rank {rank}: {len(skipped)} of {len(mine)} shards already complete, resuming.")
    _remove_stale_tmp(out, [t.name for t in pending], run.suffix)
    workers = max(1, min(workers, len(pending)))
    with progress.StageProgress(run.stage, pending, run.work, run.work_unit, rank) as tracker:
        log = tracker.wrap_log(log)
        if pending and workers == 1:
            processor = _load_processor(run.processor, run.processor_config)
            for task in pending:
                marker = _write_shard(processor, task.to_json(), str(out), run.suffix)
                tracker.shard_done(task)
                log(f"rank {rank}: wrote {marker['file']} ({marker['rows']} rows)")
        elif pending:
            _run_in_workers(run, pending, workers, out, rank, log, tracker)
    _write_rank_stats(out, run, rank, world_size)
    manifest = finalize(out, log=log)
    return RunReport(rank, world_size, [t.name for t in pending], skipped, manifest is not None, manifest is not None)


def _run_in_workers(run: StageRun, pending: list[ShardTask], workers: int, out: Path, rank: int, log, tracker) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                 initargs=(run.processor, run.processor_config, tracker.worker_counter())) as pool:
            futures = {pool.submit(_worker_write_shard, task.to_json(), str(out), run.suffix): task for task in pending}
            for future in as_completed(futures):
                marker = future.result()
                tracker.shard_done(futures[future])
                log(f"rank {rank}: wrote {marker['file']} ({marker['rows']} rows)")
    except BrokenProcessPool:
        raise CsdError(
            f"a worker process of rank {rank} died (killed or out of memory) while writing {out}; "
            "re-run the same command to resume, with fewer --workers if memory is short."
        ) from None


def _write_rank_stats(out: Path, run: StageRun, rank: int, world_size: int) -> None:
    mine = run.tasks[rank::world_size]
    markers = [read_marker(out, t.name, run.suffix) for t in mine]
    if any(m is None for m in markers):
        return
    stats: dict = {}
    for marker in markers:
        merge_stats(stats, marker["stats"])
    atomic_write_json(out / "stats" / f"rank-{rank:05d}.json", {
        "rank": rank,
        "world_size": world_size,
        "shards": [m["name"] for m in markers],
        "rows": sum(m["rows"] for m in markers),
        "bytes": sum(m["bytes"] for m in markers),
        "stats": _sorted_stats(stats),
    })


# ---------------------------------------------------------------------------------------------
# Status and manifest


def stage_status(directory) -> dict:
    """Which shards of the run in `directory` are complete.

    Returns {"stage", "complete" (manifest present), "shards_total", "shards_done", "missing"
    (names), "tasks": [{"name", "done", "rows"}]}. Raises `CsdError` when `directory` holds no run.
    """
    out = Path(directory)
    record = read_run_record(out)
    tasks = []
    for task in record["tasks"]:
        marker = read_marker(out, task["name"], record["suffix"])
        tasks.append({"name": task["name"], "done": marker is not None, "rows": marker["rows"] if marker else None})
    missing = [t["name"] for t in tasks if not t["done"]]
    return {
        "directory": str(out),
        "stage": record["stage"],
        "complete": (out / MANIFEST_NAME).is_file(),
        "shards_total": len(tasks),
        "shards_done": len(tasks) - len(missing),
        "missing": missing,
        "tasks": tasks,
    }


def build_manifest(record: dict, markers: list[dict]) -> dict:
    """The manifest of a run record whose shards are all complete (`markers` in task order)."""
    stats: dict = {}
    for marker in markers:
        merge_stats(stats, marker["stats"])
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "stage": record["stage"],
        "schema_version": record["schema_version"],
        "shards": [{key: m[key] for key in ("name", "file", "rows", "bytes", "sha256")} for m in markers],
        "totals": {
            "shards": len(markers),
            "rows": sum(m["rows"] for m in markers),
            "bytes": sum(m["bytes"] for m in markers),
            "stats": _sorted_stats(stats),
        },
    }
    manifest.update(record["identity"])
    manifest.update(record["extra"])
    return manifest


def finalize(directory, log: Callable[[str], None] | None = None) -> dict | None:
    """Write `DIR/manifest.json` if every shard of the recorded run is complete.

    Returns the manifest, or None (and logs what is missing) when shards are missing.
    Safe to call from several ranks at once: they write the same bytes through atomic renames.
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    out = Path(directory)
    record = read_run_record(out)
    markers = [read_marker(out, t["name"], record["suffix"]) for t in record["tasks"]]
    missing = [t["name"] for t, m in zip(record["tasks"], markers, strict=True) if m is None]
    if missing:
        log(f"{out}: {len(missing)} of {len(markers)} shards not complete yet (first: {missing[0]}); "
            "no manifest written.")
        return None
    manifest = build_manifest(record, markers)
    data = json_bytes(manifest)
    path = out / MANIFEST_NAME
    if not path.is_file() or path.read_bytes() != data:
        atomic_write_bytes(path, data)
        log(f"{out}: all {len(markers)} shards complete; wrote {MANIFEST_NAME}.")
    return manifest
