"""`csd-pipeline rounds`: the csd-train command of a round and the options it refuses. Two rounds end to end (their
outputs, seeds, KD-alone steps, chaining and resume) run in tests/runtime/test_storage_stages.py, into S3."""

from __future__ import annotations

import subprocess
import sys

import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.generate.rounds import RoundsConfig, train_command
from tests.onpolicy_cases import REPO


def _config(tmp_path, student, prompts, **overrides) -> RoundsConfig:
    values = dict(student=str(student), teacher="smollm2-135m-instruct", teacher_tokenizer="smollm2",
                  prompts=[str(prompts)], output=str(tmp_path / "rounds"), rounds=2, steps=2, prompt_field="text",
                  prompt_chars=80, max_new_tokens=8, samples_per_prompt=1, max_student_tokens=64, top_k=8,
                  train_args=["--batch-size 1 --workers 0 --progress false --warmup-steps 0"], device="cpu")
    return RoundsConfig(**(values | overrides))


def test_the_round_command_line(tmp_path):
    config = _config(tmp_path, tmp_path / "s", tmp_path / "p.jsonl", train_args=["--lr 1e-4 --batch-size 2"])
    command = train_command(config, "PREV", tmp_path / "round-2", seed=1)
    assert command[:3] == [sys.executable, "-m", "trainer.main"]
    joined = " ".join(command)
    assert "--student PREV" in joined and "--divergence reverse_kl" in joined and "--seed 1" in joined
    assert "--save-every 0 --no-save-final" in joined  # the export is what the next round reads; no checkpoint
    assert joined.endswith("--kd-scale ratio --kd-weight 1 --lr 1e-4 --batch-size 2")  # KD alone, as GKD
    with_ce = train_command(_config(tmp_path, tmp_path / "s", tmp_path / "p.jsonl", ce=True,
                                    train_args=["--kd-scale fixed --kd-weight 0.5"]), "PREV", tmp_path / "r", seed=0)
    assert "ratio" not in with_ce and " ".join(with_ce).endswith("--kd-scale fixed --kd-weight 0.5")
    for clash in ("--kd-weight 0.5", "--lr 1e-4 --kd-scale=fixed"):
        with pytest.raises(CsdError, match=r"^--train-arg sets --kd-.*pass --ce"):
            _config(tmp_path, tmp_path / "s", tmp_path / "p.jsonl", train_args=[clash]).validate()
    help_text = subprocess.run([sys.executable, "-m", "cli.main", "rounds", "--help"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert "--train-arg" in help_text and "--prompt-chars" in help_text and "--ce " in help_text
