"""Progress bars (csd_pipeline/runtime/progress.py): on a terminal a bar with rate and ETA; nothing in
a log (stderr not a terminal) or with --quiet; the align stage's bar counts every document, also
when its shards are written by worker processes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"

# A loop with a bar and a stage run with a processor that advances, as the stages use them.
SCRIPT = """
import sys
from csd_pipeline.runtime import progress
from csd_pipeline.runtime.executor import ShardTask
progress.set_quiet("--quiet" in sys.argv)
with progress.bar(5, "loop", "doc") as shown:
    for _ in range(5):
        shown.update(1)
tasks = [ShardTask(i, f"part-{i}", {"rows": 3}) for i in range(2)]
with progress.StageProgress("stage", tasks, lambda spec: spec["rows"], "row") as tracker:
    log = tracker.wrap_log(lambda message: print(message, file=sys.stderr))
    for task in tasks:
        for _ in range(3):
            progress.advance(1)
        tracker.shard_done(task)
        log(f"wrote {task.name}")
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CSD_PROGRESS"}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def run_on_terminal(args: list[str], env: dict) -> str:
    """Run with stderr on a pseudo-terminal; return what it showed there."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    process = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    process.wait()
    os.close(leader)
    assert process.returncode == 0, shown
    return shown.decode("utf-8", "replace")


def test_terminal_shows_rate_and_eta():
    shown = run_on_terminal([sys.executable, "-c", SCRIPT], _env())
    assert re.search(r"loop: 100%.*5/5 \[\d\d:\d\d<\d\d:\d\d, .*doc/s\]", shown), shown
    assert re.search(r"stage: 100%.*6/6 \[", shown) and "row/s" in shown, shown
    assert "wrote part-0" in shown and "wrote part-1" in shown


def test_quiet_and_logs_show_no_bar():
    assert run_on_terminal([sys.executable, "-c", SCRIPT, "--quiet"], _env()).replace("\r\n", "\n") == \
        "wrote part-0\nwrote part-1\n"
    # stderr to a file or a pipe (a log): the lines, no bar
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=_env(), capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "wrote part-0\nwrote part-1\n"
    forced = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=_env(CSD_PROGRESS="1"),
                            capture_output=True, text=True)
    assert "doc/s" in forced.stderr  # CSD_PROGRESS=1: a bar even without a terminal


@pytest.mark.slow
def test_align_bar_counts_every_document_with_workers(tmp_path, tables_for, tokenizer_path):
    corpus = [str(DATA / "devil-slice.txt"), str(DATA / "kjv-genesis-slice.txt")]
    base = [sys.executable, "-m", "cli.main", "align", "--corpus", corpus[0], "--corpus", corpus[1],
            "--split-on-blank-lines", "--student-tokenizer", str(tokenizer_path("llama-spm")),
            "--teacher-tokenizer", str(tokenizer_path("smollm2")), "--tables", *tables_for("llama-spm", "smollm2"),
            "--shard-mb", "0.002"]
    quiet = subprocess.run(base + ["--output", str(tmp_path / "a")], cwd=REPO, env=_env(), capture_output=True,
                           text=True)
    assert quiet.returncode == 0 and "doc/s" not in quiet.stderr and "\r" not in quiet.stderr
    shown = subprocess.run(base + ["--output", str(tmp_path / "b"), "--workers", "2"], cwd=REPO,
                           env=_env(CSD_PROGRESS="1"), capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    documents = json.loads((tmp_path / "b" / "manifest.json").read_text())["totals"]["stats"]["documents"]["read"]
    assert re.search(rf"align: 100%.*{documents}/{documents} \[.*doc/s\]", shown.stderr), shown.stderr
    # the bar changes nothing in the output
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()
