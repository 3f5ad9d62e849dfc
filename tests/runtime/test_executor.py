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
    ShardResult,
    ShardTask,
    StageRun,
    finalize,
    resolve_rank,
    run_stage,
    shard_name,
    stage_status,
)
from csd_pipeline.runtime.manifest import read_manifest, shard_paths, verify_shards

REPO = Path(__file__).resolve().parents[2]


def make_square_processor(config: dict):
    """A toy stage: each shard holds the squares of its spec's numbers, one per line."""
    offset = config["offset"]

    def process(task: ShardTask, tmp_path: Path) -> ShardResult:
        values = [(v + offset) ** 2 for v in task.spec["values"]]
        tmp_path.write_text("".join(f"{v}\n" for v in values))
        odd = sum(v % 2 for v in values)
        return ShardResult(rows=len(values), stats={"values": len(values), "parity": {"odd": odd, "even": len(values) - odd}})

    return process


def make_run(out: Path, world_size: int = 1, offset: int = 0, shards: int = 5) -> StageRun:
    tasks = [ShardTask(i, shard_name(i % world_size, i), {"values": list(range(i * 3, i * 3 + 3))}) for i in range(shards)]
    return StageRun(
        stage="toy",
        schema_version=1,
        output_dir=out,
        identity={"config": {"offset": offset}, "inputs": [{"path": "nowhere", "size": 0}]},
        tasks=tasks,
        processor=f"{__name__}:make_square_processor",
        processor_config={"offset": offset},
        extra={"note": "toy stage"},
        suffix=".txt",
    )


def tree_bytes(directory: Path) -> dict[str, str]:
    """Every file under `directory` (relative path -> sha256), skipping per-rank stats."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.parent.name != "stats"
    }


def test_one_and_two_workers_write_identical_bytes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    report = run_stage(make_run(one), workers=1, log=lambda m: None)
    assert report.complete and len(report.processed) == 5
    run_stage(make_run(two), workers=2, log=lambda m: None)
    assert tree_bytes(one) == tree_bytes(two)
    manifest = read_manifest(one, stage="toy", schema_versions=[1])
    assert [s["name"] for s in manifest["shards"]] == [shard_name(0, i) for i in range(5)]
    assert manifest["totals"]["rows"] == 15
    assert manifest["totals"]["stats"]["parity"] == {"odd": 7, "even": 8}  # squares of 0..14
    assert manifest["config"] == {"offset": 0} and manifest["note"] == "toy stage"
    assert verify_shards(manifest, one, check_hash=True) == []
    lines = [int(x) for p in shard_paths(manifest, one) for x in p.read_text().split()]
    assert lines == [v * v for v in range(15)]


def test_ranks_split_the_shards_and_the_last_rank_writes_the_manifest(tmp_path):
    out = tmp_path / "out"
    run_stage(make_run(out, world_size=2), rank=1, world_size=2, log=lambda m: None)
    status = stage_status(out)
    assert not status["complete"]
    assert status["missing"] == [shard_name(0, i) for i in (0, 2, 4)]
    assert not (out / "manifest.json").exists()
    report = run_stage(make_run(out, world_size=2), rank=0, world_size=2, log=lambda m: None)
    assert report.manifest_written
    manifest = read_manifest(out)
    assert [s["name"] for s in manifest["shards"]] == [shard_name(i % 2, i) for i in range(5)]
    assert json.loads((out / "stats" / "rank-00001.json").read_text())["shards"] == [shard_name(1, 1), shard_name(1, 3)]
    # The shard contents do not depend on the world size, only their names do.
    single = tmp_path / "single"
    run_stage(make_run(single), log=lambda m: None)
    for i in range(5):
        assert (out / f"{shard_name(i % 2, i)}.txt").read_bytes() == (single / f"{shard_name(0, i)}.txt").read_bytes()


def test_finalize_writes_the_manifest_once_everything_is_done(tmp_path):
    out = tmp_path / "out"
    run = make_run(out, world_size=2)
    run_stage(run, rank=0, world_size=2, log=lambda m: None)
    assert finalize(out, log=lambda m: None) is None
    run_stage(run, rank=1, world_size=2, log=lambda m: None)
    (out / "manifest.json").unlink()
    assert finalize(out, log=lambda m: None)["totals"]["shards"] == 5
    assert read_manifest(out)["stage"] == "toy"


@pytest.mark.parametrize("point", ["before_rename", "before_marker", "after_marker"])
def test_killed_run_resumes_to_the_same_bytes(tmp_path, point):
    clean = tmp_path / "clean"
    run_stage(make_run(clean), log=lambda m: None)
    killed = tmp_path / "killed"
    script = (
        f"import sys; from pathlib import Path; import {__name__} as t; "
        "from csd_pipeline.runtime.executor import run_stage; "
        "run_stage(t.make_run(Path(sys.argv[1])), log=lambda m: None)"
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
    run_stage(make_run(out), log=lambda m: None)
    with pytest.raises(CsdError, match="another toy run.*config"):
        run_stage(make_run(out, offset=1), log=lambda m: None)
    with pytest.raises(CsdError, match="different shard layout"):
        run_stage(make_run(out, world_size=2), log=lambda m: None)
    # A re-run of the same run is a no-op.
    assert run_stage(make_run(out), log=lambda m: None).processed == []


def test_manifest_errors_name_the_stage_to_rerun(tmp_path):
    with pytest.raises(ManifestError, match="not a directory"):
        read_manifest(tmp_path / "absent", stage="align")
    out = tmp_path / "out"
    run_stage(make_run(out, world_size=2), rank=0, world_size=2, log=lambda m: None)
    with pytest.raises(ManifestError, match="no manifest.json.*csd-pipeline status"):
        read_manifest(out, stage="toy")
    run_stage(make_run(out, world_size=2), rank=1, world_size=2, log=lambda m: None)
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
