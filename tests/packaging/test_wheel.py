"""The wheel works outside the checkout: built from the tracked files, installed into a fresh venv in a temporary
folder, run from another temporary folder. Every command's --help, `csd-pipeline recipes`, and a tiny pipeline
(tables, align, teacher-logits on a random 2-layer teacher, csd-train with the recommended pretrained recipe
by name) on the fixture tokenizers. The venv reaches the third-party packages of the running interpreter
through one `.pth` line (a copy of torch would take minutes); the checkout itself is not on its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def tracked_copy(target: Path) -> Path:
    """The checkout's files as git sees them (tracked, and new ones not ignored), copied to `target`: the
    build writes build/ and *.egg-info next to its sources, which must not be the checkout."""
    import shutil

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """{"venv", "bin", "env", "cwd"}: the wheel installed into a fresh venv; commands run with `env` in `cwd`."""
    work = tmp_path_factory.mktemp("wheel")
    source = tracked_copy(work / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(work / "dist"), str(source)], check=True)
    (wheel,) = (work / "dist").glob("csd_pipeline-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "third_party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env |= {"PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "OMP_NUM_THREADS": "1", "PYTHONNOUSERSITE": "1"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=env)
    cwd = work / "elsewhere"
    cwd.mkdir()
    return {"venv": venv, "bin": venv / "bin", "env": env, "cwd": cwd, "site": Path(site)}


def run(installed, *argv, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=installed["cwd"], env=installed["env"], capture_output=True,
                          text=True)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


def test_the_package_comes_from_the_venv_not_the_checkout(installed):
    probe = ("import json, importlib.util, csd_pipeline, cli, trainer, schemas; "
             "print(json.dumps({'files': [m.__file__ for m in (csd_pipeline, cli, trainer, schemas)], "
             "'bench': importlib.util.find_spec('bench') is not None}))")
    found = json.loads(run(installed, installed["bin"] / "python", "-c", probe).stdout)
    assert all(Path(f).is_relative_to(installed["site"]) for f in found["files"]), found
    assert not found["bench"]  # the checkout's own folders (bench/, demo/, tests/) are not importable


def test_every_command_has_help(installed):
    walk = ("import click, json; from cli.main import cli; ctx = click.Context(cli); paths = []\n"
            "for name in cli.list_commands(ctx):\n"
            "    command = cli.get_command(ctx, name); paths.append([name])\n"
            "    if isinstance(command, click.Group):\n"
            "        paths += [[name, sub] for sub in command.list_commands(ctx)]\n"
            "print(json.dumps(paths))")
    paths = json.loads(run(installed, installed["bin"] / "python", "-c", walk).stdout)
    assert ["recipes"] in paths and ["tables", "build-both"] in paths and len(paths) > 12
    for path in [[], *paths]:
        shown = run(installed, installed["bin"] / "csd-pipeline", *path, "--help").stdout
        assert "Usage: csd-pipeline" in shown, path
    assert "usage: csd-train" in run(installed, installed["bin"] / "csd-train", "--help").stdout


def test_recipes_are_listed_and_printed(installed):
    from csd_pipeline.recipes import shipped_recipes

    listed = run(installed, installed["bin"] / "csd-pipeline", "recipes").stdout.splitlines()
    assert [line.split()[0] for line in listed] == shipped_recipes()
    assert "pretrained/csd_kl_b1_t1.5_fixed0.5" in shipped_recipes()
    shown = run(installed, installed["bin"] / "csd-pipeline", "recipes", "pretrained/csd_kl_b1_t1.5_fixed0.5").stdout
    assert "kd_weight: 0.5" in shown and "teacher_temperature: 1.5" in shown
    missing = run(installed, installed["bin"] / "csd-pipeline", "recipes", "no/such", check=False)
    assert missing.returncode != 0 and "csd-pipeline recipes" in missing.stderr


def test_a_tiny_pipeline_runs_from_the_installed_commands(installed, tokenizer_path):
    from tests.teacher.test_stage import make_tiny_teacher
    from tests.trainer_cases import STUDENT_CONFIG

    work, pipeline = installed["cwd"], installed["bin"] / "csd-pipeline"
    text = (ROOT / "tests" / "data" / "botchan-slice.txt").read_text(encoding="utf-8")[:3000]
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in text.split("\n\n") if p.strip()),
                      encoding="utf-8")
    teacher = make_tiny_teacher(work / "teacher-model", tokenizer_path("smollm2"))
    student = work / "student.json"
    student.write_text(json.dumps(STUDENT_CONFIG), encoding="utf-8")
    run(installed, pipeline, "tables", "build-both", "--student-tokenizer", "llama-spm", "--teacher-tokenizer",
        "smollm2", "--output-dir", "tables")
    run(installed, pipeline, "align", "--corpus", corpus, "--student-tokenizer", "llama-spm", "--teacher-tokenizer",
        "smollm2", "--tables", "tables/student_to_teacher.safetensors", "tables/teacher_to_student.safetensors",
        "--output", "aligned", "--max-student-tokens", "128", "--max-teacher-tokens", "128", "--quiet")
    run(installed, pipeline, "teacher-logits", "--aligned", "aligned", "--teacher", teacher, "--top-k", "8",
        "--output", "teacher", "--device", "cpu", "--quiet")
    run(installed, installed["bin"] / "csd-train", "--config", "pretrained/train", "--config",
        "pretrained/csd_kl_b1_t1.5_fixed0.5", "--aligned", "aligned", "--teacher-logits", "teacher",
        "--student-config", student, "--student-tokenizer", "llama-spm", "--output", "run", "--steps", "2",
        "--seq-len", "128", "--batch-size", "1", "--warmup-steps", "1", "--workers", "0")
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["kd"] > 0 for r in rows), rows
    import yaml

    resolved = yaml.safe_load((work / "run" / "config.yaml").read_text(encoding="utf-8"))
    assert (resolved["kd_scale"], resolved["kd_weight"], resolved["teacher_temperature"], resolved["lr"]) == (
        "fixed", 0.5, 1.5, 5e-5)  # pretrained/train, then the recommended recipe, by name
