"""The shared stage executor: resume after a kill, worker/rank determinism, run identity, manifest."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from csd_pipeline.errors import CsdError, ManifestError
from csd_pipeline.runtime.executor import (
    Placement,
    ShardResult,
    ShardTask,
    Stage,
    resolve_rank,
    run_configured,
    run_stage,
    shard_name,
)
from csd_pipeline.runtime.manifest import read_manifest, shard_paths, verify_shards
from csd_pipeline.runtime.run_record import finalize, stage_status

REPO = Path(__file__).resolve().parents[2]


class SquareWriter:
    """The toy stage's shard writer: each shard holds the squares of its spec's numbers, one per line."""

    def __init__(self, offset: int):
        self.offset = offset

    def __call__(self, task: ShardTask, tmp_path: Path) -> ShardResult:
        values = [(v + self.offset) ** 2 for v in task.spec["values"]]
        tmp_path.write_text("".join(f"{v}\n" for v in values))
        odd = sum(v % 2 for v in values)
        return ShardResult(rows=len(values), stats={"values": len(values), "parity": {"odd": odd, "even": len(values) - odd}})


class ToyStage(Stage):
    """A toy stage of `shards` shards of three numbers each; counts how often it is asked for its plan."""

    name = "toy"
    schema_version = 1
    suffix = ".txt"

    def __init__(self, out: Path, offset: int = 0, shards: int = 5):
        self.output_dir = out
        self.offset = offset
        self.shards = shards
        self.plans = 0

    def identity(self, world_size: int) -> dict:
        return {"config": {"offset": self.offset, "world_size": world_size}, "inputs": [{"path": "nowhere", "size": 0}]}

    def manifest_extra(self) -> dict:
        return {"note": "toy stage"}

    def plan(self, world_size: int, log) -> list[ShardTask]:
        self.plans += 1
        return [ShardTask(i, shard_name(i % world_size, i), {"values": list(range(i * 3, i * 3 + 3))})
                for i in range(self.shards)]

    def shard_writer(self) -> SquareWriter:
        return SquareWriter(self.offset)


def make_stage(out: Path, offset: int = 0) -> ToyStage:
    return ToyStage(out, offset)


def rank(r: int, world_size: int) -> Placement:
    return Placement(rank=r, world_size=world_size)


def tree_bytes(directory: Path) -> dict[str, str]:
    """Every file under `directory` (relative path -> sha256), skipping per-rank stats."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.parent.name != "stats"
    }


def test_one_and_two_workers_write_identical_bytes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    report = run_stage(make_stage(one), Placement(workers=1), log=lambda m: None)
    assert report.complete and len(report.processed) == 5
    run_stage(make_stage(two), Placement(workers=2), log=lambda m: None)
    assert tree_bytes(one) == tree_bytes(two)
    manifest = read_manifest(one, stage="toy", schema_versions=[1])
    assert [s["name"] for s in manifest["shards"]] == [shard_name(0, i) for i in range(5)]
    assert manifest["totals"]["rows"] == 15
    assert manifest["totals"]["stats"]["parity"] == {"odd": 7, "even": 8}  # squares of 0..14
    assert manifest["config"] == {"offset": 0, "world_size": 1} and manifest["note"] == "toy stage"
    assert verify_shards(manifest, one, check_hash=True) == []
    lines = [int(x) for p in shard_paths(manifest, one) for x in p.read_text().split()]
    assert lines == [v * v for v in range(15)]


def test_ranks_split_the_shards_and_the_last_rank_writes_the_manifest(tmp_path):
    out = tmp_path / "out"
    stage = make_stage(out)
    run_stage(stage, rank(1, 2), log=lambda m: None)
    status = stage_status(out)
    assert not status["complete"]
    assert status["missing"] == [shard_name(0, i) for i in (0, 2, 4)]
    assert not (out / "manifest.json").exists()
    report = run_stage(stage, rank(0, 2), log=lambda m: None)
    assert report.manifest_written
    assert stage.plans == 1  # the second rank resumed the recorded plan
    manifest = read_manifest(out)
    assert [s["name"] for s in manifest["shards"]] == [shard_name(i % 2, i) for i in range(5)]
    assert json.loads((out / "stats" / "rank-00001.json").read_text())["shards"] == [shard_name(1, 1), shard_name(1, 3)]
    # The shard contents do not depend on the world size, only their names do.
    single = tmp_path / "single"
    run_stage(make_stage(single), log=lambda m: None)
    for i in range(5):
        assert (out / f"{shard_name(i % 2, i)}.txt").read_bytes() == (single / f"{shard_name(0, i)}.txt").read_bytes()


def test_finalize_writes_the_manifest_once_everything_is_done(tmp_path):
    out = tmp_path / "out"
    stage = make_stage(out)
    run_stage(stage, rank(0, 2), log=lambda m: None)
    assert finalize(out, log=lambda m: None) is None
    run_stage(stage, rank(1, 2), log=lambda m: None)
    (out / "manifest.json").unlink()
    assert finalize(out, log=lambda m: None)["totals"]["shards"] == 5
    assert read_manifest(out)["stage"] == "toy"


@pytest.mark.parametrize("point", ["before_rename", "before_marker", "after_marker"])
def test_killed_run_resumes_to_the_same_bytes(tmp_path, point):
    clean = tmp_path / "clean"
    run_stage(make_stage(clean), log=lambda m: None)
    killed = tmp_path / "killed"
    script = (
        f"import sys; from pathlib import Path; import {__name__} as t; "
        "from csd_pipeline.runtime.executor import run_stage; "
        "run_stage(t.make_stage(Path(sys.argv[1])), log=lambda m: None)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), CSD_TEST_CRASH=f"{point}:3")
    first = subprocess.run([sys.executable, "-c", script, str(killed)], env=env, capture_output=True)
    assert first.returncode == -9, first.stderr
    assert not (killed / "manifest.json").exists()
    assert stage_status(killed)["shards_done"] == (3 if point == "after_marker" else 2)
    env.pop("CSD_TEST_CRASH")
    second = subprocess.run([sys.executable, "-c", script, str(killed)], env=env, capture_output=True)
    assert second.returncode == 0, second.stderr
    assert tree_bytes(killed) == tree_bytes(clean)
    assert not list(killed.rglob("*.tmp"))


def test_another_runs_output_is_refused(tmp_path):
    out = tmp_path / "out"
    run_stage(make_stage(out), log=lambda m: None)
    with pytest.raises(CsdError, match=r"another toy run \(its config.offset differ"):
        run_stage(make_stage(out, offset=1), log=lambda m: None)
    with pytest.raises(CsdError, match=r"another toy run \(its config.world_size differ"):
        run_stage(make_stage(out), rank(0, 2), log=lambda m: None)
    # A re-run of the same run is a no-op, and does not plan again.
    again = make_stage(out)
    assert run_stage(again, log=lambda m: None).processed == [] and again.plans == 0


def test_manifest_errors_name_the_stage_to_rerun(tmp_path):
    with pytest.raises(ManifestError, match="not a directory"):
        read_manifest(tmp_path / "absent", stage="align")
    out = tmp_path / "out"
    run_stage(make_stage(out), rank(0, 2), log=lambda m: None)
    with pytest.raises(ManifestError, match="no manifest.json.*csd-pipeline status"):
        read_manifest(out, stage="toy")
    run_stage(make_stage(out), rank(1, 2), log=lambda m: None)
    with pytest.raises(ManifestError, match="stage 'toy', not 'align'"):
        read_manifest(out, stage="align")
    with pytest.raises(ManifestError, match="schema version 1"):
        read_manifest(out, schema_versions=[2])


def test_resolve_rank_from_flags_and_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_rank() == (0, 1)
    assert resolve_rank(2, 4) == (2, 4)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert resolve_rank() == (3, 8)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank() == (1, 2)  # torchrun variables win over SLURM's
    with pytest.raises(CsdError, match="go together"):
        resolve_rank(1, None)
    with pytest.raises(CsdError, match="out of range"):
        resolve_rank(4, 4)
    with pytest.raises(CsdError, match="--workers 0"):
        Placement.resolve(workers=0)


class ToyConfig:
    """A config whose `validate` refuses a negative offset, as the stage configs refuse bad options."""

    def __init__(self, offset: int):
        self.offset = offset

    def validate(self) -> None:
        if self.offset < 0:
            raise CsdError(f"--offset {self.offset} is negative; pass 0 or more.")


def test_an_entry_point_checks_config_and_placement_before_it_builds_the_stage(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    built = []

    def build(config, out):
        def make() -> ToyStage:
            built.append(out)
            return make_stage(out, config.offset)
        return make

    with pytest.raises(CsdError, match="--offset -1"):
        run_configured(ToyConfig(-1), build(ToyConfig(-1), tmp_path / "bad"), workers=0)  # the config first
    with pytest.raises(CsdError, match="--workers 0"):
        run_configured(ToyConfig(1), build(ToyConfig(1), tmp_path / "bad"), workers=0)
    with pytest.raises(CsdError, match="out of range"):
        run_configured(ToyConfig(1), build(ToyConfig(1), tmp_path / "bad"), rank=2, world_size=2)
    assert built == [] and not (tmp_path / "bad").exists()
    out = tmp_path / "out"
    first = run_configured(ToyConfig(1), build(ToyConfig(1), out), rank=1, world_size=2, workers=2)
    assert (first.rank, first.world_size, first.complete) == (1, 2, False)
    assert first.processed == [shard_name(1, 1), shard_name(1, 3)]
    last = run_configured(ToyConfig(1), build(ToyConfig(1), out), rank=0, world_size=2)
    assert last.complete and built == [out, out]
    whole = tmp_path / "whole"
    run_stage(make_stage(whole, 1), rank(0, 2), log=lambda m: None)
    run_stage(make_stage(whole, 1), rank(1, 2), log=lambda m: None)
    assert tree_bytes(out) == tree_bytes(whole)
