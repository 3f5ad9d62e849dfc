"""Processes the tools start end when their parent is killed with -9 (issue 35, item 3).

The children are stopped (SIGSTOP) before the parent is killed, as a worker stuck for good would be (the
hang once seen: a forked loader worker waiting in gloo's process-group destructor): a stopped process runs
none of its own checks, so only the kernel's parent-death signal (`csd_pipeline/runtime/lifetime.py`) can
end it. The bound is generous; without that signal the stopped children stay forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.cases import REPO, align_args
from tests.trainer_cases import DATA

BOUND_S = 60


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def children_left_after_killing_the_parent(argv: list[str], ready, *, stop: bool) -> list[int]:
    """Start `python -m argv` in its own session, wait until `ready(children)`, stop the children when
    `stop`, kill -9 the parent; the children still alive after the bound (the test then ends them)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", *map(str, argv)], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while not ready(children(process.pid)):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{argv[0]} ended before its children were ready: {process.stderr.read()[-2000:]}")
            time.sleep(0.02)
        started = children(process.pid)
        for pid in started if stop else ():
            os.kill(pid, signal.SIGSTOP)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        ends = time.monotonic() + BOUND_S
        while any(alive(pid) for pid in started) and time.monotonic() < ends:
            time.sleep(0.05)
        return [pid for pid in started if alive(pid)]
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_align_workers_end_with_their_killed_parent(tmp_path):
    """Without the parent-death signal a spawned worker waits for work from its dead parent forever (and
    multiprocessing's resource tracker with it, whose pipe the workers hold open)."""
    corpus = [DATA / "botchan-slice.txt", DATA / "kjv-genesis-slice.txt", DATA / "python-docs-slice.txt"]
    out = tmp_path / "aligned"
    argv = align_args(out, "--workers", "2", *[part for c in corpus for part in ("--corpus", c)])
    del argv[argv.index("--corpus"):argv.index("--corpus") + 2]  # not the devil slice: more to do
    # the tracker and both workers, and a shard complete: the workers took their first tasks
    assert children_left_after_killing_the_parent(
        argv, lambda found: len(found) >= 3 and any((out / "done").glob("*.done")), stop=False) == []


@pytest.mark.slow
def test_loader_workers_end_with_their_killed_trainer(trainer_data, tmp_path):
    """Stopped workers: torch's own parent check (every 5 s while a worker waits) cannot run in them."""
    out = tmp_path / "run"
    argv = ["trainer.main", "--aligned", trainer_data["train"], "--student-config", trainer_data["student_config"],
            "--student-tokenizer", "llama-spm", "--output", out, "--steps", "1000", "--seq-len", "128",
            "--batch-size", "2", "--loss", "ce", "--workers", "2", "--data-lanes", "2", "--save-every", "0",
            "--device", "cpu", "--progress", "false"]

    def both_workers_served(found):  # steps 1 and 2 come from lanes 0 and 1: both workers are past their start
        metrics = out / "metrics.jsonl"
        return len(found) >= 2 and metrics.is_file() and len(metrics.read_text().splitlines()) >= 2

    assert children_left_after_killing_the_parent(argv, both_workers_served, stop=True) == []


HANG_SCRIPT = """
import gc, sys
import torch.distributed as dist
from trainer import distributed
from trainer.loop import train
from trainer.options import parse_args

distributed.setup("cpu")  # a process group, destroyed, whose last reference is in a cycle (garbage)
cycle = [dist.group.WORLD]
cycle.append(cycle)
distributed.teardown()
del cycle
gc.disable()  # kept until the workers are forked; each worker collects at once (CSD_TEST_WORKER_GC)
train(parse_args(sys.argv[1:]))
print("trained")
"""


@pytest.mark.slow
def test_a_forked_loader_worker_never_runs_an_inherited_process_groups_destructor(trainer_data, tmp_path):
    """The hang of issue 35: a collection in a forked worker freeing a destroyed gloo process group runs
    gloo's destructor there, on threads that exist only in the parent (it hung once in a test session;
    here, without the fix, the worker dies of a segmentation fault). Workers are forked with the
    collector's objects frozen (trainer/loader.py), so the run ends normally."""
    argv = ["--aligned", trainer_data["train"], "--student-config", trainer_data["student_config"],
            "--student-tokenizer", "llama-spm", "--output", tmp_path / "run", "--steps", "2", "--seq-len", "128",
            "--batch-size", "2", "--loss", "ce", "--workers", "2", "--save-every", "0", "--device", "cpu",
            "--progress", "false"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CSD_TEST_WORKER_GC="1")
    process = subprocess.Popen([sys.executable, "-c", HANG_SCRIPT, *map(str, argv)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the run hung: a loader worker finalized the inherited process group")
    assert process.returncode == 0 and out.strip().endswith("trained"), err[-2000:]  # not a dead worker
