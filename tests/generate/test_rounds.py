"""`csd-pipeline rounds`, two rounds end to end (slow): a tiny random-init student with the real llama-spm
tokenizer samples prompts cut from the demo corpus, the real teacher (SmolLM2-135M-Instruct) scores the
samples, csd-train fine-tunes; every round's outputs and manifests stay on disk, round 2 starts from
round 1's export, and a re-run resumes instead of redoing finished rounds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.generate.rounds import RoundsConfig, run_rounds, train_command
from csd_pipeline.runtime.manifest import read_manifest
from tests.onpolicy_cases import REPO, prompt_corpus


def _config(tmp_path, student, prompts, **overrides) -> RoundsConfig:
    values = dict(student=str(student), teacher="smollm2-135m-instruct", teacher_tokenizer="smollm2",
                  prompts=[str(prompts)], output=str(tmp_path / "rounds"), rounds=2, steps=2, prompt_field="text",
                  prompt_chars=80, max_new_tokens=8, samples_per_prompt=1, max_student_tokens=64, top_k=8,
                  train_args=["--batch-size 1 --workers 0 --progress false --warmup-steps 0"], device="cpu")
    return RoundsConfig(**(values | overrides))


@pytest.mark.slow
def test_two_rounds_keep_their_outputs_chain_the_students_and_resume(tmp_path, tiny_student):
    student = tiny_student
    prompts = prompt_corpus(tmp_path / "prompts.jsonl", documents=3)
    lines: list[str] = []
    last = run_rounds(_config(tmp_path, student, prompts), log=lines.append)
    out = tmp_path / "rounds"
    assert last == out / "round-2" / "train" / "export"
    students = [student.resolve(), (out / "round-1" / "train" / "export").resolve()]
    for r, expected_student in zip((1, 2), students, strict=True):
        folder = out / f"round-{r}"
        generated = read_manifest(folder / "generated", stage="generate")
        assert generated["sources"]["model"] == str(expected_student)  # round 2 samples with round 1's export
        assert generated["config"]["seed"] == r - 1
        read_manifest(folder / "aligned", stage="align")
        read_manifest(folder / "teacher", stage="teacher-logits")
        assert (folder / "train" / "export" / "config.json").is_file()
        assert (folder / "train" / "export" / "model.safetensors").is_file()
        metrics = [json.loads(x) for x in (folder / "train" / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if "step" in m]
        assert [m["step"] for m in steps] == [1, 2] and not any(m["skipped"] for m in steps)  # trained, not skipped
        for m in steps:  # GKD: the samples train the divergence alone (CE measured, weighted 0)
            assert m["loss"] == pytest.approx(m["kd"], rel=1e-6) and m["ce"] > 0 and m["kd_scale"] == 1
    assert sum(line.startswith("$ csd-train") for line in lines) == 2
    round2_train = [x for x in lines if x.startswith("$ csd-train") and "round-2" in x][0]
    assert "--student " + str(out / "round-1" / "train" / "export") in round2_train

    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    again: list[str] = []
    assert run_rounds(_config(tmp_path, student, prompts), log=again.append) == last
    assert not any(line.startswith("$ csd-train") for line in again)  # finished rounds are not trained again
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps  # nor rewritten


def test_the_round_command_line(tmp_path):
    config = _config(tmp_path, tmp_path / "s", tmp_path / "p.jsonl", train_args=["--lr 1e-4 --batch-size 2"])
    command = train_command(config, "PREV", tmp_path / "round-2", seed=1)
    assert command[:3] == [sys.executable, "-m", "trainer.main"]
    joined = " ".join(command)
    assert "--student PREV" in joined and "--divergence reverse_kl" in joined and "--seed 1" in joined
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
