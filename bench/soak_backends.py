"""Where the chaos soak's stages run and write: a local Ray cluster (`--engine ray`) and moto's S3 server on
127.0.0.1 (`--storage s3`), both started by the soak itself so that they outlive every command it kills.

`--engine ray`: the soak process hosts a local Ray cluster of 2 CPUs (as the tests' `ray_cluster`
fixture does, `bench/bench_engines.py::start_local_ray`); `align` and `teacher-logits` run as drivers
on it (`--engine ray --ray-address ...`), and the soak kills the driver. Their shards are written by Ray
actors, which do not see the driver's `CSD_TEST_CRASH`, so their only hook kill is the manifest's.

`--storage s3`: moto's server as a process (`tests/s3_cases.py::start_moto`), the `AWS_*` variables of
every command pointing at it, and the outputs of `align`, `teacher-logits` and `csd-train` in
`s3://soak/run/...`. The tables stay local (`tables --output-dir` takes a folder) and the rounds are left
out (`rounds --output` and `--student` are local folders). Every command's temporary folder (TMPDIR,
where the object-store writers stage a file before its upload) is OUT/tmp, checked for leftovers too.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BUCKET = "soak"


@dataclass
class Backends:
    """What the soak started: the Ray address (or None), the object-store root (or None), and the
    variables every command gets."""

    ray_address: str | None = None
    store_url: str | None = None
    env: dict = field(default_factory=dict)
    tmp: Path | None = None

    def store(self, work: Path):
        """Where the stage outputs of a run in `work` go: `work` itself, or its place in the bucket."""
        if self.store_url is None:
            return work
        from upath import UPath

        return UPath(f"{self.store_url}/{work.name}", use_listings_cache=False)

    def engine_args(self) -> list[str]:
        return ["--engine", "ray", "--ray-address", self.ray_address] if self.ray_address else []

    def fetch(self, work: Path) -> None:
        """Copy the run's objects into `work` (same names as a local run's) and remove them from the bucket."""
        if self.store_url is None:
            return
        store = self.store(work)
        if store.exists():
            store.fs.get(store.path + "/", str(work) + "/", recursive=True)
            store.fs.rm(store.path, recursive=True)

    def leftovers(self) -> list[str]:
        """Staging files a killed writer left in the commands' TMPDIR."""
        if self.tmp is None:
            return []
        return sorted(str(p.relative_to(self.tmp)) for p in self.tmp.rglob("*.tmp"))


@contextmanager
def backends(engine: str, storage: str, out: Path):
    """Start the Ray cluster and the S3 server that `engine` and `storage` ask for; stop them afterwards."""
    root = Path(__file__).resolve().parent.parent
    started = Backends()
    server = None
    saved = dict(os.environ)
    try:
        if storage == "s3":
            from tests.s3_cases import start_moto

            server, endpoint = start_moto()
            started.tmp = out / "tmp"
            started.tmp.mkdir(parents=True, exist_ok=True)
            started.env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "soak-secret", "AWS_DEFAULT_REGION": "us-east-1",
                           "TMPDIR": str(started.tmp)}
            os.environ.update(started.env)  # this process reads the bucket, and Ray's workers inherit them
            import fsspec

            fsspec.filesystem("s3").mkdir(BUCKET)
            started.store_url = f"s3://{BUCKET}"
        if engine == "ray":
            os.environ.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
            import ray

            from bench.bench_engines import start_local_ray

            start_local_ray(num_cpus=2)
            started.ray_address = ray.get_runtime_context().gcs_address
        yield started
    finally:
        if started.ray_address:
            import ray

            ray.shutdown()
        if server is not None:
            server.kill()
            server.wait()
        os.environ.clear()
        os.environ.update(saved)
