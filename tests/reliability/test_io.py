"""Every I/O failure is one `error:` line, nothing is lost, and a re-run finishes with the same bytes
(issue 16, item 4): disk full in align (one and two workers, while copying the tables), read-only
outputs of align, tables build and csd-train, an --output under a regular file, and a full disk while
csd-train writes a checkpoint."""

from __future__ import annotations

import json

import pytest

from tests.reliability.cases import (
    align_args,
    assert_one_line_error,
    fill,
    pages,
    resize,
    run,
    tmpfs,
    tree,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An align run with room to spare: the bytes every re-run must end with."""
    out = tmp_path_factory.mktemp("reference") / "aligned"
    result = run(*align_args(out))
    assert result.returncode == 0, result.stderr
    return out


def _table_files(aligned):
    return sorted((aligned / "tables" / "teacher0").glob("*.safetensors"))


def test_disk_full_while_copying_the_tables(reference, tmp_path):
    with tmpfs(tmp_path / "disk", "16m") as disk:
        filler = fill(disk, 1 << 20)  # 1 MiB free: each table is larger
        out = disk / "aligned"
        tables = [str(p) for p in _table_files(reference)]
        failed = run(*align_args(out, "--tables", *tables))
        assert_one_line_error(failed, "copying table", "No space left on device", "re-run the same command")
        assert not list(out.rglob("*.tmp")), "a partial table was left behind"
        filler.unlink()
        again = run(*align_args(out, "--tables", *tables))
        assert again.returncode == 0, again.stderr
        assert tree(out) == tree(reference)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])  # fast tier: one worker
def test_disk_full_while_writing_shards(reference, tmp_path, workers):
    room = sum(pages(p.stat().st_size) for p in _table_files(reference)) + pages((reference / "run.json").stat().st_size)
    with tmpfs(tmp_path / "disk", "16m") as disk:
        filler = fill(disk, room + 2 * 4096)  # the tables and run.json fit, the shards do not
        out = disk / "aligned"
        failed = run(*align_args(out, "--workers", workers))
        assert_one_line_error(failed, "No space left on device")
        assert not (out / "manifest.json").exists()
        assert not list(out.rglob("*.tmp")), "a partial shard was left behind"
        filler.unlink()
        again = run(*align_args(out, "--workers", workers))
        assert again.returncode == 0, again.stderr
        assert tree(out) == tree(reference)


def test_align_into_a_read_only_folder(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as folder:
        assert_one_line_error(run(*align_args(folder / "aligned")), "Read-only file system", "writable")


def test_align_output_under_a_regular_file(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    assert_one_line_error(run(*align_args(tmp_path / "a-file" / "aligned")), "Not a directory", "another --output")


def test_tables_build_into_a_read_only_folder(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as folder:
        result = run("cli.main", "tables", "build", "--source-tokenizer", "llama-spm", "--destination-tokenizer",
                     "smollm2", "--output", folder / "s2t.safetensors")
        assert_one_line_error(result, "cannot write it", "Read-only file system")


def train_args(aligned, student_config, output, *extra) -> list[str]:
    return ["trainer.main", "--aligned", aligned, "--student-config", student_config, "--student-tokenizer",
            "llama-spm", "--output", output, "--loss", "ce", "--steps", "3", "--seq-len", "128", "--batch-size", "2",
            "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "1", "--save-total-limit", "1", "--workers", "0",
            "--no-progress", *map(str, extra)]


def test_train_into_a_read_only_folder(trainer_data, tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as folder:
        result = run(*train_args(trainer_data["eval"], trainer_data["student_config"], folder / "run"))
        assert_one_line_error(result, "--output", "not writable", "Read-only file system")


def _losses(output) -> list[dict]:
    with open(output / "metrics.jsonl", encoding="utf-8") as handle:
        return [{k: r[k] for k in ("step", "loss", "ce", "lr", "grad_norm", "tokens")} for r in map(json.loads, handle)]


@pytest.mark.slow
def test_disk_full_while_writing_a_checkpoint(trainer_data, tmp_path, one_thread):
    """The uninterrupted reference and the resume run in this process with one torch thread (the failing run's
    process has OMP_NUM_THREADS=1: the same reduction order, so the same losses), saving two process starts."""
    from trainer.loop import train
    from trainer.options import parse_args

    args = (trainer_data["eval"], trainer_data["student_config"])
    reference = tmp_path / "reference"
    train(parse_args([str(a) for a in train_args(*args, reference)[1:]]))
    size = sum(p.stat().st_size for p in (reference / "checkpoints" / "step-3").rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", f"{(size + size // 2) >> 10}k") as disk:  # one checkpoint fits, two do not
        out = disk / "run"
        failed = run(*train_args(*args, out))
        message = assert_one_line_error(failed, "writing checkpoint", "step-1 is intact", "--resume")
        assert "MiB free" in message
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]
        resize(disk, f"{(3 * size) >> 10}k")
        train(parse_args([str(a) for a in train_args(*args, out, "--resume")[1:]]))
        assert _losses(out) == _losses(reference)
