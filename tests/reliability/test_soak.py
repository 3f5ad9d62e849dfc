"""The chaos soak, short: five kill -9s over the four stages (issue 35, item 1), each stage killed at least once.

`python -m bench.soak --no-rounds --no-heldout` with tiny models (a random 2-layer teacher with the SmolLM2
tokenizer, a 2-layer student), three documents and four steps; every process start costs a few seconds of
imports, so the rounds and the held-out set are left to `make soak`. Besides the soak's own verdict, the
test compares the two runs itself: each shard's sha256 as the manifests record it, and the losses of
every step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.reliability.cases import REPO
from tests.trainer_cases import STUDENT_CONFIG


def shard_hashes(folder) -> dict[str, str]:
    return {s["file"]: s["sha256"] for s in json.loads((folder / "manifest.json").read_text())["shards"]}


def losses(folder) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce"], r["kd"], r["grad_norm"]) for r in rows]


@pytest.mark.slow
def test_five_kills_over_the_four_stages_leave_the_same_outputs(tiny_teacher, tmp_path):
    """Five kills are the fewest that reach every stage and the soak's three phases (a re-run's recovery, a
    checkpoint write in csd-train, a manifest write): bench/soak.py's plan gives each command one."""
    config = tmp_path / "student.json"
    config.write_text(json.dumps(STUDENT_CONFIG))
    out = tmp_path / "soak"
    result = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--kills", "5", "--seed", "14", "--out", str(out), "--docs", "3",
         "--no-heldout", "--no-rounds", "--steps", "4", "--save-every", "2", "--shard-kb", "2", "--teacher",
         str(tiny_teacher), "--student-config", str(config), "--orphan-bound", "20"],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["verdict"]["ok"] and report["verdict"]["problems"] == [], report["verdict"]
    kills = report["kills"]
    assert len(kills) == 5, kills  # kills left after the last command go round again
    assert {k["command"] for k in kills} == {"tables", "align aligned", "teacher-logits", "csd-train csd"}, kills
    phases = {k["trigger"] for k in kills} | {k["hook"].split("_")[0] for k in kills if k["hook"]}
    assert {"recovery", "checkpoint", "manifest"} <= phases, kills  # a re-run's start, a DCP write, a manifest
    assert all(kill["where"] and not kill["orphans"] for kill in kills)
    reference, run = out / "reference", out / "run"
    for stage in ("aligned", "teacher"):
        assert shard_hashes(run / stage) == shard_hashes(reference / stage), stage
    assert losses(run / "student-csd") == losses(reference / "student-csd")
    assert len(losses(run / "student-csd")) == 4
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_kills_left_after_the_last_command_go_round_again(tmp_path):
    """Five kills drawn for moments the second command never reaches: lap 1 delivers none, lap 2 deals
    them over both commands (now complete) and kills each re-run; with one lap allowed, all five are
    reported as not delivered."""
    from bench import soak

    nap = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    commands = [soak.Command(name, nap, tmp_path / name, "tables") for name in ("first", "second")]
    options = SimpleNamespace(attempt_timeout=60, orphan_bound=5, max_laps=4, engine="local")
    planned = [soak.Kill(1, "time", 0.9) for _ in range(5)]
    with open(tmp_path / "soak.log", "w") as log_file:
        outcomes, undelivered = soak.soak(commands, planned, [0.3, 60.0], [0.1, 0.1], options, log_file)
        assert undelivered == 0
        assert [(o.lap, o.command, o.trigger, o.killed) for o in outcomes] == \
            [(2, "first", "rerun", True)] * 3 + [(2, "second", "rerun", True)] * 2
        options.max_laps = 1
        assert soak.soak(commands, planned, [0.3, 60.0], [0.1, 0.1], options, log_file) == ([], 5)


def test_a_recovery_kill_passed_on_by_a_command_that_finished_first_still_follows_a_kill(tmp_path):
    """The first command finishes before its `time` kill, so its recovery kill passes to the second command ahead of
    that command's own kill: the second is killed first (by the passed-on `time` kill), and the recovery falls in its
    re-run (a fresh clone's slow
    reference run once made the soak test's recovery kill a `time` kill this way)."""
    from bench import soak

    nap = [sys.executable, "-c", "import time; time.sleep(0.3)"]
    commands = [soak.Command(name, nap, tmp_path / name, "tables") for name in ("first", "second")]
    options = SimpleNamespace(attempt_timeout=60, orphan_bound=5, max_laps=1, engine="local")
    planned = [soak.Kill(0, "time", 0.9), soak.Kill(0, "recovery", 0.5), soak.Kill(1, "time", 0.5)]
    with open(tmp_path / "soak.log", "w") as log_file:
        outcomes, undelivered = soak.soak(commands, planned, [60.0, 0.3], [0.1, 0.1], options, log_file)
    assert [(o.command, o.trigger) for o in outcomes] == [("second", "time"), ("second", "recovery"), ("second", "time")]
