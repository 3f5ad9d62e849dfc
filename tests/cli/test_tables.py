"""`csd-pipeline tables ...` as a user runs it: real commands, one-sentence errors, no tracebacks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from csd_pipeline.fixtures.names import tokenizer_path


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    err = result.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture(scope="module")
def built_tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("tables")
    s2t, t2s = out / "s2t.safetensors", out / "t2s.safetensors"
    for src, dst, path in (("gpt-2", "llama-spm", s2t), ("llama-spm", "gpt-2", t2s)):
        r = run_cli("tables", "build", "--source-tokenizer", src, "--destination-tokenizer", dst, "--output", path)
        assert r.returncode == 0, r.stderr
    return s2t, t2s


def test_build_validate_inspect_round_trip(built_tables):
    s2t, t2s = built_tables
    r = run_cli("tables", "validate", "--student-tokenizer", "gpt-2", "--teacher-tokenizer", "llama-spm",
                "--student-to-teacher", s2t, "--teacher-to-student", t2s)
    assert r.returncode == 0, r.stderr
    r = run_cli("tables", "inspect", s2t, "--json")
    counts = json.loads(r.stdout)
    for key in ("source_vocab_size", "destination_vocab_size", "common_spellings", "prefix_entries",
                "multi_id_spellings_source", "multi_id_spellings_destination", "special_tokens"):
        assert key in counts
    assert counts["source_vocab_size"] == 50257 and counts["destination_vocab_size"] == 32000
    assert counts["multi_id_spellings_destination"] > 0  # SentencePiece byte pieces


def test_build_both_writes_the_same_bytes_and_validates(built_tables, tmp_path):
    """`tables build-both` (what `make tables` runs): the files of the two `tables build` calls, byte
    for byte, and a passing validation of them."""
    s2t, t2s = built_tables
    r = run_cli("tables", "build-both", "--student-tokenizer", "gpt-2", "--teacher-tokenizer", "llama-spm",
                "--output-dir", tmp_path / "pair")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "pair" / "student_to_teacher.safetensors").read_bytes() == Path(s2t).read_bytes()
    assert (tmp_path / "pair" / "teacher_to_student.safetensors").read_bytes() == Path(t2s).read_bytes()
    assert r.stdout.strip().splitlines()[-1] == "ok: both tables match gpt-2 and llama-spm"


def test_build_both_bad_tokenizer_is_one_line(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ this is not json", encoding="utf-8")
    r = run_cli("tables", "build-both", "--student-tokenizer", bad, "--teacher-tokenizer", "gpt-2",
                "--output-dir", tmp_path / "pair")
    assert_one_line_error(r, "not valid JSON")
    r = run_cli("tables", "build-both", "--student-tokenizer", "gpt-2", "--teacher-tokenizer", tmp_path / "nope.json",
                "--output-dir", tmp_path / "pair")
    assert_one_line_error(r, "no such file")
    assert not (tmp_path / "pair").exists()


def test_missing_tokenizer_file(tmp_path):
    r = run_cli("tables", "build", "--source-tokenizer", tmp_path / "nope" / "tokenizer.json",
                "--destination-tokenizer", "gpt-2", "--output", tmp_path / "t.safetensors")
    assert_one_line_error(r, "no such file")


def test_unreadable_tokenizer_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ this is not json", encoding="utf-8")
    r = run_cli("tables", "build", "--source-tokenizer", bad, "--destination-tokenizer", "gpt-2",
                "--output", tmp_path / "t.safetensors")
    assert_one_line_error(r, "not valid JSON")


def test_slow_only_tokenizer_folder(tmp_path):
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    r = run_cli("tables", "build", "--source-tokenizer", tmp_path / "slow", "--destination-tokenizer", "gpt-2",
                "--output", tmp_path / "t.safetensors")
    assert_one_line_error(r, "slow (non-fast) tokenizer")


@pytest.mark.parametrize("family", ["wordpiece", "unigram", pytest.param("lowercase", marks=pytest.mark.slow)])
def test_unsupported_family_is_refused(tmp_path, family):
    from tokenizers import Tokenizer, models, pre_tokenizers

    if family == "wordpiece":
        tok = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "##lo": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    elif family == "unigram":
        tok = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁hello", -1.0), ("h", -2.0)], unk_id=0))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
    else:
        spec = json.loads((tokenizer_path("gpt-2") / "tokenizer.json").read_text(encoding="utf-8"))
        spec["normalizer"] = {"type": "Lowercase"}
        tok = Tokenizer.from_str(json.dumps(spec))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    r = run_cli("tables", "build", "--source-tokenizer", path, "--destination-tokenizer", "gpt-2",
                "--output", tmp_path / "t.safetensors")
    assert_one_line_error(r, "supported:")
    assert not (tmp_path / "t.safetensors").exists()


def test_table_for_the_wrong_pair(built_tables):
    s2t, t2s = built_tables
    r = run_cli("tables", "validate", "--student-tokenizer", "qwen2", "--teacher-tokenizer", "llama-spm",
                "--student-to-teacher", s2t, "--teacher-to-student", t2s)
    assert_one_line_error(r, "fingerprint mismatch", "rebuild")


def test_truncated_and_corrupted_tables(built_tables, tmp_path):
    s2t, t2s = built_tables
    data = Path(s2t).read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    r = run_cli("tables", "validate", "--student-tokenizer", "gpt-2", "--teacher-tokenizer", "llama-spm",
                "--student-to-teacher", truncated, "--teacher-to-student", t2s)
    assert_one_line_error(r, "truncated")
    flipped = tmp_path / "flipped.safetensors"
    corrupt = bytearray(data)
    corrupt[-100] ^= 0xFF
    flipped.write_bytes(bytes(corrupt))
    r = run_cli("tables", "inspect", flipped)
    assert_one_line_error(r, "corrupted")
    r = run_cli("tables", "inspect", tmp_path / "missing.safetensors")
    assert_one_line_error(r, "no such file")


def test_table_from_another_format_version(built_tables, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    s2t, _ = built_tables
    with safe_open(str(s2t), framework="numpy") as f:
        meta = json.loads(f.metadata()["csd_table"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["format_version"] = 99
    old = tmp_path / "v99.safetensors"
    save_file(tensors, str(old), metadata={"csd_table": json.dumps(meta)})
    r = run_cli("tables", "inspect", old)
    assert_one_line_error(r, "format version 99")


def test_help_is_instant_and_imports_nothing_heavy():
    code = (
        "import sys; from cli.main import cli; from click.testing import CliRunner;"
        "r = CliRunner().invoke(cli, ['tables', '--help']); assert r.exit_code == 0, r.output;"
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'tokenizers', 'pyarrow', 'polars') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


def test_package_imports_from_outside_the_repository(tmp_path):
    code = "import csd_pipeline, cli, trainer, schemas, sys; print(csd_pipeline.__file__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert shutil.which("csd-pipeline") or Path(sys.executable).with_name("csd-pipeline").exists()
