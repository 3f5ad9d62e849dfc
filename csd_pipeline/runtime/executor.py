"""The shared stage executor: stages declare, the executor runs.

A stage (align, teacher-logits) is a `Stage`: it declares its name and schema version, its
identity, its plan (every shard of every rank as a `ShardTask`, a JSON description of one output
file's input) and its shard writer. `run_stage(stage, placement)`:

1. checks that the output directory holds no other run (`run_record.check_identity`: the identity
   and stage of `DIR/run.json` and `DIR/manifest.json`), once;
2. plans once: a re-run resumes the plan recorded in `DIR/run.json` and never plans again; a new
   run asks the stage for its plan and records it;
3. lets the stage `prepare` the directory (the align stage's tables);
4. runs this rank's tasks, `tasks[rank::world_size]`, in `workers` processes (or, with `--engine
   ray`, `workers` Ray actors: `ray_engine.py`); each shard is written
   by the stage's shard writer to a temporary name, then renamed, then its completion marker
   `DIR/done/<name>.done` (rows, bytes, sha256, stats) is written; shards with a marker are skipped,
   so a killed run resumes where it stopped and ends with the same bytes;
5. writes `DIR/stats/rank-RRRRR.json`, then `DIR/manifest.json` if every shard of every rank is
   complete (any rank may; `csd-pipeline status DIR --finalize` does the same afterwards).

Shard bytes must depend only on the task's spec, never on rank, worker count or timing; the
manifest holds no timestamps or worker counts, so it is byte-identical too.

A stage's entry point (`run_align`, ...) is `run_configured(config, build, ...)`: it validates the
config and the placement before `build()` loads anything, then calls `run_stage`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import progress, storage
from csd_pipeline.runtime.files import atomic_write_json, commit, file_sha256, remove_tmp_files, tmp_path
from csd_pipeline.runtime.io_errors import discard, reason_and_advice
from csd_pipeline.runtime.leftovers import remove_dead_writers_tmp
from csd_pipeline.runtime.manifest import MANIFEST_NAME
from csd_pipeline.runtime.ray_engine import EngineConfig, preflight
from csd_pipeline.runtime.run_record import (
    check_identity,
    finalize,
    marker_path,
    read_marker,
    record_run,
    recorded_tasks,
    run_record,
    sorted_stats,
    write_rank_stats,
)

CRASH_ENV = "CSD_TEST_CRASH"  # tests: "<point>:<n>" kills this process at <point> of its n-th shard


# ---------------------------------------------------------------------------------------------
# Placement: ranks, world size, workers


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


@dataclass(frozen=True)
class Placement:
    """Where this process's part of a stage runs: its rank of `world_size`, in `workers` processes
    (`--engine local`) or Ray actors (`--engine ray`: one driver, rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    workers: int = 1
    engine: EngineConfig = field(default_factory=EngineConfig)

    @classmethod
    def resolve(cls, rank: int | None = None, world_size: int | None = None, workers: int = 1,
                engine: EngineConfig | None = None) -> Placement:
        """From the flags (see `resolve_rank` for the environment). Raises `CsdError` for bad values."""
        engine = engine or EngineConfig()
        engine.validate()
        if engine.is_ray:  # the driver runs every shard; RANK or SLURM_PROCID of a launcher do not apply
            if (world_size or 1) > 1:
                raise CsdError("--engine ray runs every shard from one driver; drop --rank/--world-size, or use "
                               "--engine local under torchrun or SLURM.")
            rank, world_size = 0, 1
            preflight(engine)
        rank, world_size = resolve_rank(rank, world_size)
        if workers < 1:
            raise CsdError(f"--workers {workers} is not positive; pass --workers 1 or more.")
        return cls(rank, world_size, workers, engine)


def shard_name(rank: int, index: int) -> str:
    """The file stem of shard `index` written by `rank`: `part-RRRRR-IIIII`."""
    return f"part-{rank:05d}-{index:05d}"


def numbered_tasks(specs, world_size: int) -> list:
    """One `ShardTask` per spec, in order: task i is named for rank i % world_size (`shard_name`)."""
    return [ShardTask(index, shard_name(index % world_size, index), spec) for index, spec in enumerate(specs)]


# ---------------------------------------------------------------------------------------------
# What a stage declares


@dataclass(frozen=True)
class ShardTask:
    """One output shard: its global index, file stem and the stage's JSON description of its input."""

    index: int
    name: str
    spec: dict

    def to_json(self) -> dict:
        return {"index": self.index, "name": self.name, "spec": self.spec}

    @classmethod
    def from_json(cls, task: dict) -> ShardTask:
        return cls(task["index"], task["name"], task["spec"])


@dataclass
class ShardResult:
    """What a shard writer reports about a shard it wrote: its row count and stats (nested dict of numbers)."""

    rows: int
    stats: dict = field(default_factory=dict)


class Stage:
    """A stage as the executor sees it. Subclasses set `name` (the manifest's "stage"),
    `schema_version`, `config`, `output_dir` (and `suffix`) and define:

    - `identity(world_size)`: a JSON dict that a re-run into the same directory must match
      exactly; its keys become top-level manifest keys (config, inputs, fingerprints). A stage
      declares it in two parts, and the executor's `Stage.identity` joins them: `recorded`, the
      names of its "config" in their order (a config field's value unless `derived(world_size)`
      gives one: a resolved dtype, the world size), then `sources()`, what else decides its bytes
      (input fingerprints, models, tokenizers);
    - `plan(world_size, log)`: every shard of every rank, `ShardTask`s in index order (task i
      has index i); called once per output directory;
    - `shard_writer()`: a picklable callable `(task, tmp_path) -> ShardResult` that writes one
      shard; each worker process gets a copy;
    - optionally `manifest_extra()` (more manifest keys that do not decide identity; recorded in
      run.json, so they must not change between re-runs), `prepare(log)` (runs once the run
      is recorded, before any shard), `check_recorded(tasks)` (refuses the tasks of an edited
      run.json before a shard is written) and `work(spec)` with `work_unit`: a shard's units of
      work for the progress bar, the unit in which its writer calls `progress.advance` (default:
      one per shard).
    """

    name: str
    schema_version: int
    output_dir: Path
    suffix: str = ".parquet"
    work_unit: str = "shard"

    recorded: tuple[str, ...] = ()

    def identity(self, world_size: int) -> dict:
        """{"config": each `recorded` name's value, in order, then `sources()`}."""
        derived = self.derived(world_size)
        config = {name: derived[name] if name in derived else getattr(self.config, name) for name in self.recorded}
        return {"config": config, **self.sources()}

    def derived(self, world_size: int) -> dict:
        """The `recorded` values that are not the config field of that name as given."""
        return {}

    def sources(self) -> dict:
        """The identity's keys after "config": what else the output's bytes depend on."""
        raise NotImplementedError

    def plan(self, world_size: int, log: Callable[[str], None]) -> list[ShardTask]:
        raise NotImplementedError

    def shard_writer(self) -> Callable[[ShardTask, Path], ShardResult]:
        raise NotImplementedError

    def manifest_extra(self) -> dict:
        return {}

    def prepare(self, log: Callable[[str], None]) -> None:
        return None

    def check_recorded(self, tasks: list[ShardTask]) -> None:
        return None

    def work(self, spec: dict) -> int:
        return 1


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
# Running a stage


def check_output_dir(out: Path) -> None:
    """Create the output directory `out`; raise `CsdError` when it is a file or cannot be written."""
    if storage.is_remote(out):
        storage.check_writable(out)
        return
    if out.exists() and not out.is_dir():
        raise CsdError(f"--output {out} is a file; pass a directory.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tmp_path(out / ".write-probe")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:  # a read-only disk, a path under a file, no permission
        reason, advice = reason_and_advice(err)
        raise CsdError(f"--output {out} is not writable ({reason}); {advice}") from None


def run_configured(config, build: Callable[[], Stage], *, rank: int | None = None, world_size: int | None = None,
                   workers: int = 1, engine: EngineConfig | None = None,
                   log: Callable[[str], None] | None = None) -> RunReport:
    """What a stage's entry point (`run_align`, `run_teacher_logits`, `run_generate`) does: validate
    `config` and resolve this process's `Placement` (both before anything is loaded), then `build()`
    the stage and run it (`run_stage`). Raises `CsdError` for a bad option or placement."""
    config.validate()
    placement = Placement.resolve(rank, world_size, workers, engine)
    return run_stage(build(), placement, log=log)


def run_stage(stage: Stage, placement: Placement | None = None, *,
              log: Callable[[str], None] | None = None) -> RunReport:
    """Run this rank's shards of `stage` (skipping completed ones), then write its stats and, if every
    shard of every rank is complete, the manifest. `log`: progress lines (None: quiet).

    Returns a `RunReport`. Raises `CsdError` when the directory holds another run, or when a worker
    process dies (re-running resumes).
    """
    placement = placement or Placement.resolve()
    rank, world_size = placement.rank, placement.world_size
    log = log or (lambda message: None)
    out = storage.location(stage.output_dir)
    identity = stage.identity(world_size)
    check_identity(out, stage.name, identity)  # before anything is written into the directory
    check_output_dir(out)
    recorded = recorded_tasks(out)
    if recorded is None:
        tasks = stage.plan(world_size, log)
    else:
        tasks = [ShardTask.from_json(task) for task in recorded]
        stage.check_recorded(tasks)
    record = run_record(stage.name, stage.schema_version, identity, stage.manifest_extra(), stage.suffix, tasks)
    record_run(out, record)
    stage.prepare(log)

    mine = tasks[rank::world_size]
    if storage.is_remote(out):  # what killed writers of this host were staging: a shard, a table copy, a record
        remove_dead_writers_tmp(storage.staging_root())
    if (out / MANIFEST_NAME).is_file() and all(read_marker(out, t.name, stage.suffix) for t in mine):
        log(f"{out}: already complete (manifest present); nothing to do.")
        return RunReport(rank, world_size, [], [t.name for t in mine], False, True)
    pending = [t for t in mine if read_marker(out, t.name, stage.suffix) is None]
    skipped = [t.name for t in mine if t not in pending]
    if skipped:
        log(f"rank {rank}: {len(skipped)} of {len(mine)} shards already complete, resuming.")
    if storage.is_remote(out):  # an object store holds no temporary objects: only this host's staging files
        storage.remove_staged([f"{t.name}{stage.suffix}" for t in pending], out)
    else:
        remove_tmp_files(out, [f"{t.name}{stage.suffix}" for t in pending])
        remove_dead_writers_tmp(out)  # markers, stats, run.json, manifest of killed writers on this host
    workers = max(1, min(placement.workers, len(pending)))
    with progress.StageProgress(stage.name, pending, stage.work, stage.work_unit, rank) as tracker:
        log = tracker.wrap_log(log)

        def done(task: ShardTask, marker: dict) -> None:
            tracker.shard_done(task)
            log(f"rank {rank}: wrote {marker['file']} ({marker['rows']} rows)")

        if pending and placement.engine.is_ray:
            from csd_pipeline.runtime.ray_engine import run_on_ray

            run_on_ray(placement.engine, stage.shard_writer(), pending, workers, out, stage.suffix, done)
        elif pending and workers == 1:
            writer = stage.shard_writer()
            for task in pending:
                done(task, _write_shard(writer, task, out, stage.suffix))
        elif pending:
            _run_in_workers(stage, pending, workers, out, rank, tracker, done)
    write_rank_stats(out, record, rank, world_size)
    manifest = finalize(out, log=log)
    return RunReport(rank, world_size, [t.name for t in pending], skipped, manifest is not None, manifest is not None)


# ---------------------------------------------------------------------------------------------
# Writing one shard

_shards_started = 0  # shards this process began (for the CSD_TEST_CRASH hook)


def _maybe_crash(point: str) -> None:
    # Test hook: CSD_TEST_CRASH="before_rename:2" kills this process at that point of its 2nd shard.
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    want_point, _, count = wanted.partition(":")
    if want_point == point and str(_shards_started) == count:
        os.kill(os.getpid(), signal.SIGKILL)


def _write_shard(writer, task: ShardTask, out: Path, suffix: str) -> dict:
    """Run one shard to completion: write to a temporary file, rename, write the marker."""
    global _shards_started
    _shards_started += 1
    final = out / f"{task.name}{suffix}"
    tmp = storage.staging_path(final)  # next to `final` on a disk; a local staging file for an object
    try:
        result = writer(task, tmp)
        _maybe_crash("before_rename")
    except BaseException:
        discard(tmp)  # a failed shard (disk full, bad input) leaves no partial file
        raise
    marker = {
        "name": task.name,
        "index": task.index,
        "file": final.name,
        "rows": int(result.rows),
        "bytes": tmp.stat().st_size,
        "sha256": file_sha256(tmp),
        "stats": sorted_stats(result.stats),
    }
    commit(tmp, final)
    _maybe_crash("before_marker")
    atomic_write_json(marker_path(out, task.name), marker)
    _maybe_crash("after_marker")
    return marker


# Each worker process holds the one shard writer it was started with (set by `_start_worker`).
_worker_writer = None


def _start_worker(writer, counter=None, parent_pid: int | None = None) -> None:
    global _worker_writer
    if parent_pid is not None:
        from csd_pipeline.runtime.lifetime import end_with_parent

        end_with_parent(parent_pid)  # a command killed with -9 takes its workers with it
    _worker_writer = writer
    progress.use_counter(counter)


def _worker_write_shard(task: ShardTask, out: Path, suffix: str) -> dict:
    marker = _write_shard(_worker_writer, task, out, suffix)
    progress.shard_finished()
    return marker


def _run_in_workers(stage: Stage, pending: list[ShardTask], workers: int, out: Path, rank: int,
                    tracker: progress.StageProgress, done: Callable[[ShardTask, dict], None]) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                 initargs=(stage.shard_writer(), tracker.worker_counter(), os.getpid())) as pool:
            futures = {pool.submit(_worker_write_shard, task, out, stage.suffix): task for task in pending}
            try:
                for future in as_completed(futures):
                    done(futures[future], future.result())
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # one shard failed: start no other
                raise
    except BrokenProcessPool:
        raise CsdError(
            f"a worker process of rank {rank} died (killed or out of memory) while writing {out}; "
            "re-run the same command to resume, with fewer --workers if memory is short."
        ) from None
