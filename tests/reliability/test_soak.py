"""The chaos soak, short: eight kill -9s over the four stages (issue 35, item 1).

`bench/soak.py --no-rounds --no-heldout` with tiny models (a random 2-layer teacher with the SmolLM2
tokenizer, a 2-layer student), three documents and six steps; every process start costs a few seconds of
imports, so the rounds and the held-out set are left to `make soak`. Besides the soak's own verdict, the
test compares the two runs itself: each shard's sha256 as the manifests record it, and the losses of
every step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.reliability.cases import REPO
from tests.trainer_cases import STUDENT_CONFIG


def shard_hashes(folder) -> dict[str, str]:
    return {s["file"]: s["sha256"] for s in json.loads((folder / "manifest.json").read_text())["shards"]}


def losses(folder) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["ce"], r["kd"], r["grad_norm"]) for r in rows]


@pytest.mark.slow
def test_eight_kills_over_the_four_stages_leave_the_same_outputs(tiny_teacher, tmp_path):
    config = tmp_path / "student.json"
    config.write_text(json.dumps(STUDENT_CONFIG))
    out = tmp_path / "soak"
    result = subprocess.run(
        [sys.executable, "bench/soak.py", "--kills", "8", "--seed", "1", "--out", str(out), "--docs", "3",
         "--no-heldout", "--no-rounds", "--steps", "6", "--save-every", "2", "--shard-kb", "2", "--teacher",
         str(tiny_teacher), "--student-config", str(config), "--orphan-bound", "20"],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((out / "soak.json").read_text())
    assert report["verdict"] == {"ok": True, "problems": [], "kills": len(report["kills"])}
    assert len(report["kills"]) >= 6, report["kills"]  # a kill whose command finished first is not delivered
    assert all(kill["where"] and not kill["orphans"] for kill in report["kills"])
    reference, run = out / "reference", out / "run"
    for stage in ("aligned", "teacher"):
        assert shard_hashes(run / stage) == shard_hashes(reference / stage), stage
    assert losses(run / "student-csd") == losses(reference / "student-csd")
    assert len(losses(run / "student-csd")) == 6
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
