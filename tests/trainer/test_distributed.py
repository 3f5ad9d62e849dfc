"""Two gloo ranks on CPU through torchrun: the loss falls, each rank checkpoints its own part.

(Stop-and-resume equality is tested in one process in tests/trainer/test_run.py; the checkpoint code
path is the same for every world size.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    script = Path(sys.executable).parent / "csd-train"
    # the documented command (`torchrun ... --no-python csd-train`) when the package is installed
    entry = ["--no-python", str(script)] if script.is_file() else ["-m", "trainer.main"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *entry, *args]
    # its own session, so that a hang can be stopped with every rank it started
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def two_rank_run(trainer_data, tmp_path_factory):
    """One `torchrun --nproc-per-node 2` run, shared by the tests below: 8 CE steps, a checkpoint every 4, one
    worker per rank, the harness task at the end and held-out rows of two sources; (output, held-out dir)."""
    from tests.trainer_cases import DATA, align

    root = tmp_path_factory.mktemp("two-ranks")
    heldout = align([DATA / "devil-slice.txt", DATA / "kjv-genesis-slice.txt"], root / "heldout")
    output = root / "run"
    args = ["--aligned", str(trainer_data["train"]), "--student-config", str(trainer_data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "8",
            "--seq-len", "128", "--batch-size", "1", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "4",
            "--workers", "1", "--no-progress", "--eval-aligned", str(heldout),
            # rank 0 runs the harness in its own process at the end while rank 1 waits (docs/TRAINING.md)
            "--eval-tasks", "csd_next_sentence_devil", "--eval-tasks-limit", "2"]
    run = torchrun(2, args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return output, heldout


@pytest.mark.slow
def test_two_gloo_ranks_learn(two_rank_run):
    output, _ = two_rank_run
    rows = [json.loads(line) for line in open(output / "metrics.jsonl", encoding="utf-8")]
    assert [r["step"] for r in rows] == list(range(1, 9))
    first_half = sum(r["ce"] for r in rows[:3]) / 3
    assert sum(r["ce"] for r in rows[-3:]) / 3 < first_half - 0.1
    final = output / "checkpoints" / "step-8"
    assert sorted(p.name for p in (final / "ranks").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    states = [json.loads((final / "ranks" / f"rank-{r:05d}.json").read_text())["loader"] for r in (0, 1)]
    assert all(s["version"] == 2 and len(s["lanes"]) == 2 for s in states)
    assert (output / "export" / "model.safetensors").is_file()
    tasks, = [json.loads(line) for line in open(output / "eval_tasks.jsonl", encoding="utf-8")]
    harness = json.loads((output / "eval-tasks" / "step-00000008.json").read_text())
    assert tasks["step"] == 8 and harness["n-samples"]["csd_next_sentence_devil"]["effective"] == 2
    assert tasks["eval/csd_next_sentence_devil/acc"] == harness["results"]["csd_next_sentence_devil"]["acc,none"]


@pytest.mark.slow
def test_two_gloo_ranks_sum_the_heldout_figures_per_source(two_rank_run):
    """Each rank scores its own held-out rows; the per-source sums are all-reduced like the overall ones, so
    they match one process scoring every row of the exported student."""
    import torch
    from transformers import AutoModelForCausalLM

    from csd_pipeline.evaluation.bits_per_byte import bits_per_byte

    output, heldout = two_rank_run
    logged = [json.loads(line) for line in open(output / "eval.jsonl", encoding="utf-8")][-1]
    assert logged["step"] == 8
    model = AutoModelForCausalLM.from_pretrained(output / "export", dtype=torch.float32).eval()
    alone = bits_per_byte(model, heldout, seq_len=128, batch_size=1)
    assert len(logged["sources"]) == 2 and set(logged["sources"]) == set(alone["sources"])
    for source, figures in alone["sources"].items():
        assert {k: logged["sources"][source][k] for k in ("bytes", "tokens", "rows")} == \
            {k: figures[k] for k in ("bytes", "tokens", "rows")}
        assert logged["sources"][source]["bits_per_byte"] == pytest.approx(figures["bits_per_byte"], rel=1e-5)
