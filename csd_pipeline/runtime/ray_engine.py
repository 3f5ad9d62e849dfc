"""The Ray engine of the stage executor (`--engine ray`): a rank's pending shards as Ray actor tasks.

`run_stage` (executor.py) plans, resumes and finalises a stage the same way for every engine; only
the dispatch of the pending shards differs. With `--engine ray` the driver (the process that runs
the command) connects to a Ray cluster (`--ray-address`, else RAY_ADDRESS, else the cluster that
`ray start` started on this machine, else a Ray started for the run), starts `--workers` actors,
each with `--num-cpus-per-worker` CPUs and `--num-gpus-per-worker` GPUs, and hands every actor one
copy of the stage's shard writer. The writer loads its model or tokenizers on its first shard, so
an actor loads them once and then takes shard after shard as it becomes idle. Each shard is one actor task that runs the executor's
own `_write_shard` (temporary name, rename, completion marker; on an object store: staging file,
upload, completion record), on the output location the workers see (a shared file system or an
object-store URL; the driver's `--storage-options` and `--cache-dir` travel to each actor with its
constructor, through Ray's own channels, never into an output or a log line). The driver writes the
stats and the manifest, as with local workers.

Failures: an actor whose process dies (killed, out of memory) is restarted by Ray and its shard
retried, up to `RETRIES` times; the retried shard has the same bytes, and the driver removes the
temporary file the dead process left. A driver killed mid-run takes its actors with it; the same
command resumes from the completion markers. A cluster that cannot be reached is one `CsdError`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.options import option

ENGINES = ("local", "ray")
RETRIES = 3  # restarts of a dead actor, and retries of the shard it was writing
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineConfig:
    """Which engine runs a stage's shards, and the Ray settings when it is Ray."""

    engine: str = option("local", "Where the shards run: 'local' (this machine's processes, --workers) or 'ray' "
                                  "(actors of a Ray cluster; --workers actors, one driver, no --rank).",
                         choices=ENGINES)
    ray_address: str | None = option(None, "The Ray cluster of --engine ray: host:port of its head, or 'auto' "
                                           "(default: RAY_ADDRESS, else this machine's `ray start` cluster, else a Ray "
                                           "started for the run).")
    num_cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each worker actor (--engine ray).")
    num_gpus_per_worker: float = option(0.0, "GPUs Ray reserves for each worker actor (--engine ray); the actor "
                                             "sees them as cuda:0, ...")

    def validate(self) -> None:
        """Raise `CsdError` naming the option to change."""
        if self.engine not in ENGINES:
            raise CsdError(f"--engine {self.engine!r} is not one of {', '.join(ENGINES)}; pass --engine local or ray.")
        if self.engine == "local":
            for flag, value, default in (("--ray-address", self.ray_address, None),
                                         ("--num-cpus-per-worker", self.num_cpus_per_worker, 1.0),
                                         ("--num-gpus-per-worker", self.num_gpus_per_worker, 0.0)):
                if value != default:
                    raise CsdError(f"{flag} applies to --engine ray only; add --engine ray or drop {flag}.")
        if not self.num_cpus_per_worker >= 0 or not self.num_gpus_per_worker >= 0:
            raise CsdError(f"--num-cpus-per-worker {self.num_cpus_per_worker} / --num-gpus-per-worker "
                           f"{self.num_gpus_per_worker} must be 0 or more; pass e.g. --num-cpus-per-worker 1.")

    @property
    def is_ray(self) -> bool:
        return self.engine == "ray"


class ShardWorker:
    """A Ray actor's state: one copy of the stage's shard writer, which loads its model on first use.
    `storage_env`: the driver's `--storage-options` / `--cache-dir` (`storage.worker_env`), which an actor on
    another node (started by `ray start`, not by this driver) would not otherwise have."""

    def __init__(self, writer, storage_env: dict | None = None) -> None:
        os.environ.update(storage_env or {})
        self.writer = writer

    def write(self, task: dict, out: str, suffix: str) -> dict:
        """Write shard `task` (`ShardTask.to_json()`) into `out` (a folder or an object-store URL); returns its
        completion marker."""
        from csd_pipeline.runtime import executor, storage

        return executor._write_shard(self.writer, executor.ShardTask.from_json(task), storage.location(out), suffix)

    def pid(self) -> int:
        return os.getpid()


def _check_reachable(address: str) -> None:
    """Refuse a host:port address where nothing listens, in seconds (Ray itself retries for minutes)."""
    if address == "auto" or address.startswith("local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise CsdError(f"--ray-address {address!r} is not host:port, 'auto' or ray://host:port; pass the address "
                       "that `ray start --head` printed (e.g. 10.0.0.1:6379).")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise _unreachable(address, err.strerror or str(err)) from None


def _unreachable(address: str, reason: str) -> CsdError:
    return CsdError(f"the Ray cluster at {address} cannot be reached ({reason}); start it with `ray start --head`, "
                    "or pass the right --ray-address / RAY_ADDRESS.")


def preflight(config: EngineConfig) -> None:
    """Before a Ray run loads anything: refuse a missing ray package or a cluster address where nothing
    listens (`CsdError`). Imports nothing heavy."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise CsdError("--engine ray needs the ray package; pip install 'csd-pipeline[ray]'.")
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)


def connect(config: EngineConfig) -> bool:
    """Connect this process to the Ray cluster of `config` (reusing a connection it already has).
    Returns whether it connected now (then `ray.shutdown()` is due after the run). Raises `CsdError`."""
    import ray

    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        return False
    import logging

    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    except ConnectionError as err:
        raise _unreachable(address or "auto", str(err).strip().splitlines()[0]) from None
    return True


def run_on_ray(config: EngineConfig, writer, pending: list, workers: int, out: Path, suffix: str,
               done: Callable[[object, dict], None]) -> None:
    """Write the `pending` `ShardTask`s of a stage into `out` with `workers` Ray actors that each hold a
    copy of `writer`; call `done(task, marker)` in this process as each shard completes.

    Raises `CsdError` when the cluster cannot be reached, cannot hold one worker, or a shard's actor
    died more than `RETRIES` times; a shard writer's own `CsdError` (bad input) comes through as it is."""
    import ray

    from csd_pipeline.runtime import storage
    from csd_pipeline.runtime.leftovers import remove_dead_writers_tmp
    from csd_pipeline.runtime.storage import is_remote, remove_staged

    started = connect(config)
    actors = []
    try:
        _check_fits(config, ray.cluster_resources())
        actor = ray.remote(ShardWorker).options(num_cpus=config.num_cpus_per_worker,
                                                num_gpus=config.num_gpus_per_worker,
                                                max_restarts=RETRIES, max_task_retries=RETRIES)
        # The writer goes to each actor by value (a config, no model): a restarted actor rebuilds from it.
        actors = [actor.remote(writer, storage.worker_env()) for _ in range(workers)]
        _dispatch(actors, pending, lambda a, task: a.write.remote(task.to_json(), str(out), suffix), done)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, CsdError):
            raise err.cause from None
        raise
    except ray.exceptions.RayActorError as err:
        raise CsdError(f"a Ray worker writing {out} died {RETRIES + 1} times or could not start "
                       f"({str(err).strip().splitlines()[0][:200]}); re-run the same command to resume, with more "
                       "memory per worker (--num-cpus-per-worker) if it was killed.") from None
    finally:
        for a in actors:
            ray.kill(a)
        if is_remote(out):  # an object store holds no temporary objects: the staging files on this host
            remove_staged([f"{task.name}{suffix}" for task in pending], out)
        else:
            remove_dead_writers_tmp(out)  # the temporary shards of killed workers on this host
        if started:
            ray.shutdown()


def _check_fits(config: EngineConfig, resources: dict) -> None:
    """Refuse a worker that no node of the cluster could hold (Ray would wait for it for ever)."""
    for flag, value, name in (("--num-cpus-per-worker", config.num_cpus_per_worker, "CPU"),
                              ("--num-gpus-per-worker", config.num_gpus_per_worker, "GPU")):
        if value > resources.get(name, 0):
            raise CsdError(f"{flag} {value:g} is more than the Ray cluster's {resources.get(name, 0):g} {name}s; "
                           f"pass a smaller {flag}, or add nodes that have them.")


def _dispatch(actors: list, tasks: list, submit, done) -> None:
    """Give each task to an actor once that actor is up and idle (`submit(actor, task)` -> a Ray reference),
    calling `done(task, result)` as results come. An actor the cluster has no room for yet (more workers
    than CPUs) gets nothing, so it can never hold a shard back; it joins when room appears."""
    import ray

    queue = list(reversed(tasks))
    starting = {a.pid.remote(): a for a in actors}  # answers once the actor is up
    running: dict = {}
    while queue or running:
        [ref], _ = ray.wait([*starting, *running], num_returns=1)
        if ref in starting:
            idle = starting.pop(ref)
            ray.get(ref)
        else:
            idle, task = running.pop(ref)
            done(task, ray.get(ref))
        if queue:
            task = queue.pop()
            running[submit(idle, task)] = (idle, task)
