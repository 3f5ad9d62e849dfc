"""csd-train options: YAML + key=value + flags, validation that names the option."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from csd_pipeline.errors import CsdError
from trainer.config import TrainConfig, check_resume_compatible
from trainer.options import parse_args

BASE = ["--aligned", "A", "--output", "O", "--student", "S", "--loss", "ce"]


def test_sources_apply_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"aligned": "from-yaml", "seq_len": 128, "lr": 0.01, "output": "O",
                                    "student": "S", "teacher_logits": ["T0"]}))
    config = parse_args(["--config", str(path), "seq_len=256", "--lr", "0.002", "--teacher-logits", "T1",
                         "--teacher-logits", "T2", "grad-accum=3", "--no-progress"])
    assert config.data.aligned == "from-yaml"
    assert config.data.seq_len == 256 and config.optimizer.lr == 0.002 and config.optimizer.grad_accum == 3
    assert config.data.teacher_logits == ["T1", "T2"]  # a flag replaces the YAML list, repeats append
    assert config.progress is False
    assert parse_args([*BASE, "--resume"]).checkpoints.resume is True
    assert parse_args([*BASE, "resume=true", "--kd-teachers=0:1.0"]).teacher_weights() == {0: 1.0}


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--seq-len", "0"], "--seq-len"),
        (["--seq-len", "many"], "seq_len"),
        (["--divergence", "tv"], "--divergence"),
        (["--kd-scale", "auto"], "--kd-scale"),
        (["--kd-weight", "-1"], "--kd-weight"),
        (["--teacher-temperature", "0"], "--teacher-temperature"),
        (["teacher_temperature=-2"], "--teacher-temperature"),
        (["--bogus", "1"], "bogus"),
        (["lr=-1"], "--lr"),
        (["--loss", "csd"], "--teacher-logits"),
        (["--student-config", "c.json"], "--student-config"),
        (["--loss", "csd", "--teacher-logits", "T", "--kd-teachers", "0:x"], "--kd-teachers"),
        (["stray"], "stray"),
        (["--kd-combine", "best"], "--kd-combine"),
        (["--loss-reuse-dtype", "float8"], "--loss-reuse-dtype"),
        (["--loss", "uld", "--teacher-logits", "T", "--kd-combine", "select"], "--kd-combine select.*--loss uld"),
        (["--loss", "csd", "--teacher-logits", "T", "--teacher-control", "shuffled", "--kd-combine", "select"],
         "--kd-combine select.*--teacher-control shuffled"),
        (["--loss", "csd", "--teacher-logits", "T", "--kd-teachers", "0:1,1:0.5", "--kd-combine", "select"],
         "--kd-combine select.*--kd-teachers"),
    ],
)
def test_errors_name_the_option(argv, names):
    with pytest.raises(CsdError, match=names.replace("-", "[-_]") if names.startswith("--") else names):
        parse_args([*BASE, *argv])


def test_missing_required_and_bad_yaml(tmp_path):
    with pytest.raises(CsdError, match="--aligned"):
        parse_args(["--output", "O", "--student", "S"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not a mapping\n")
    with pytest.raises(CsdError, match="mapping"):
        parse_args(["--config", str(bad)])
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("sequence_length: 3\n")
    with pytest.raises(CsdError, match="sequence_length"):
        parse_args(["--config", str(unknown)])


def test_resume_refuses_changed_trajectory():
    config = parse_args(BASE)
    saved = config.to_dict()
    check_resume_compatible(config, saved, "O")
    saved["seq_len"] = 17
    with pytest.raises(CsdError, match="seq_len"):
        check_resume_compatible(config, saved, "O")


def test_help_is_instant_and_lists_every_option():
    out = subprocess.run([sys.executable, "-c", "import sys; from trainer.main import main; main(['--help']);"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    for f in ("--aligned", "--teacher-logits", "--student-config", "--grad-accum", "--eval-every"):
        assert f in out.stdout
    assert out.stdout.strip().endswith("False")  # --help never imports torch
    assert TrainConfig().loss.beta == 5.0


def test_cli_error_is_one_line():
    out = subprocess.run([sys.executable, "-m", "trainer.main", "--aligned", "A", "--output", "O"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: no student")


@pytest.mark.parametrize("old, new", [("--loss-keep-mb", "loss_reuse_mb"), ("--keep-last", "save_total_limit"),
                                      ("loss_keep_dtype=float32", "loss_reuse_dtype")])
def test_a_renamed_option_names_its_new_name(old, new):
    """Options renamed so that "keep" means only what a teacher store keeps: the old name is one line with the new."""
    argv = [*BASE, *old.split("=")[:1], "1"] if old.startswith("--") else [*BASE, old]
    with pytest.raises(CsdError, match=f"is now '{new}'"):
        parse_args(argv)
