"""`kill -9` of align with two workers, then a re-run: byte-identical shards (issue 16, item 6).

The other kill checks live with their stage: one-worker align (tests/align/test_stage.py), the executor's
three kill points (tests/runtime/test_executor.py), teacher-logits (tests/teacher/test_stage.py) and csd-train during a
checkpoint (tests/reliability/test_checkpoint.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from csd_pipeline.runtime.executor import CRASH_ENV
from tests.reliability.cases import REPO, align_args, assert_one_line_error, run, tree

SMALL_SHARDS = ["--shard-mb", str(500 / (1 << 20))]  # the devil slice in about a dozen shards


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "aligned"
    result = run(*align_args(out, *SMALL_SHARDS))
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_rename", "before_marker", "after_marker"])
def test_worker_killed_at_a_point_then_rerun_gives_the_same_bytes(reference, tmp_path, point):
    out = tmp_path / "aligned"
    killed = run(*align_args(out, *SMALL_SHARDS, "--workers", "2"), env={CRASH_ENV: f"{point}:2"})
    assert_one_line_error(killed, "a worker process of rank 0 died", "re-run the same command")
    assert not (out / "manifest.json").exists()
    again = run(*align_args(out, *SMALL_SHARDS, "--workers", "2"))
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(reference)
    assert not list(out.rglob("*.tmp"))


@pytest.mark.slow
def test_whole_command_killed_mid_run_then_rerun_gives_the_same_bytes(reference, tmp_path):
    out = tmp_path / "aligned"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # its own session, so that kill -9 reaches the command and both of its workers
    process = subprocess.Popen([sys.executable, "-m", *align_args(out, *SMALL_SHARDS, "--workers", "2")], cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not any((out / "done").glob("*.done")):  # kill once the first shard is complete
        assert process.poll() is None and time.monotonic() < deadline, "align ended before its first shard"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "manifest.json").exists(), "the kill came after the end: nothing was tested"
    again = run(*align_args(out, *SMALL_SHARDS, "--workers", "2"))
    assert again.returncode == 0, again.stderr
    assert tree(out) == tree(reference)
    assert not list(out.rglob("*.tmp"))


def test_a_rerun_removes_temporary_files_of_killed_writers_only(reference, tmp_path):
    """A kill between a write and its rename leaves `<name>.<host>.<pid>.tmp` (a marker, the manifest, ...)."""
    import shutil
    import socket

    out = tmp_path / "aligned"
    shutil.copytree(reference, out)
    host = socket.gethostname()
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead, alive = finished.pid, os.getpid()
    leftovers = [out / "done" / f"part-00000-00003.done.{host}.{dead}.tmp", out / f"manifest.json.{host}.{dead}.tmp",
                 out / "tables" / "teacher0" / f"student_to_teacher.safetensors.{host}.{dead}.tmp"]
    kept = [out / f"manifest.json.{host}.{alive}.tmp", out / f"manifest.json.another-host.{dead}.tmp"]
    for path in leftovers + kept:
        path.write_text("partial")
    os.unlink(out / "manifest.json")  # so that the re-run does work
    again = run(*align_args(out, *SMALL_SHARDS))
    assert again.returncode == 0, again.stderr
    assert not any(path.exists() for path in leftovers)
    assert all(path.exists() for path in kept)
    for path in kept:
        path.unlink()
    assert tree(out) == tree(reference)
