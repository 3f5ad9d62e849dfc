"""The align stage end to end: CLI as a new user runs it, workers/ranks determinism, kill and resume,
several teachers, long documents cut into windows, bad input counted by reason, user errors."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from csd_pipeline.align.config import AlignConfig
from csd_pipeline.align.corpus import Document
from csd_pipeline.align.stage import run_align
from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.manifest import read_manifest, shard_paths
from csd_pipeline.vocab.vocabulary import load_tokenizer
from schemas.aligned import ChunkStatus, aligned_schema
from tests.align.test_chunks import check_rows

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
SLICE = DATA / "python-docs-slice.txt"
load_bundle = functools.cache(load_tokenizer)  # each tokenizer loaded once per test session


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """The first ~48 KB of the python-docs slice, one document per blank-line block."""
    folder = tmp_path_factory.mktemp("corpus")
    data = SLICE.read_bytes()
    cut = data.find(b"\n\n", 48_000)
    (folder / "docs.txt").write_bytes(data[:cut])
    return folder / "docs.txt"


def config(corpus, out, tables, **overrides) -> AlignConfig:
    options = dict(corpus=[str(c) for c in (corpus if isinstance(corpus, list) else [corpus])],
                   student_tokenizer="llama-bpe", teacher_tokenizers=["qwen2"], output=str(out),
                   split_on_blank_lines=True, shard_bytes=12_000, tables=tables)
    options.update(overrides)
    return AlignConfig(**options)


def tree(directory: Path) -> dict[str, str]:
    """sha256 of every file of a stage output except per-rank stats (which say who ran)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.parent.name != "stats"}


def rows_of(out: Path) -> list[dict]:
    manifest = read_manifest(out, stage="align", schema_versions=[1])
    return [row for path in shard_paths(manifest, out) for row in pq.read_table(path).to_pylist()]


@pytest.fixture(scope="session")
def one_worker_run(tmp_path_factory, small_corpus, tables_for):
    out = tmp_path_factory.mktemp("one") / "out"
    run_align(config(small_corpus, out, [tables_for("llama-bpe", "qwen2")]), workers=1)
    return out


@pytest.mark.slow
def test_cli_as_a_new_user_runs_it(tmp_path, small_corpus, tables_for):
    out = tmp_path / "x"
    s2t, t2s = tables_for("llama-bpe", "qwen2")
    cli = [sys.executable, "-m", "cli.main"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(cli + ["align", "--corpus", str(SLICE), "--student-tokenizer", "llama-bpe",
                                 "--teacher-tokenizer", "qwen2", "--output", str(out), "--tables", s2t, t2s],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "complete" in done.stdout
    status = subprocess.run(cli + ["status", str(out)], capture_output=True, text=True, env=env, cwd=REPO)
    assert status.returncode == 0 and "1 of 1 complete" in status.stdout
    inspect = subprocess.run(cli + ["inspect", str(out), "--json"], capture_output=True, text=True, env=env, cwd=REPO)
    report = json.loads(inspect.stdout)
    assert report["rows"] == report["windows"] > 0
    assert report["tokens"]["student"] > 50_000 and 3 < report["bytes_per_token"]["student"] < 6
    assert report["chunk_shapes"]["teacher0"]["1:1"] > 0.9 * report["tokens"]["student"]
    assert report["rejections"]["documents"] == {}
    # The text of the slice is one document: reassemble it from the windows (nothing truncated).
    rows = rows_of(out)
    assert "".join(r["text"] for r in rows) == SLICE.read_text(encoding="utf-8")
    assert [r["window_index"] for r in rows] == list(range(len(rows)))
    assert all(len(r["student_ids"]) <= 2048 and len(r["teacher0_ids"]) <= 2048 for r in rows)
    # The tables travel with the output, recorded with their fingerprints.
    manifest = read_manifest(out)
    assert (out / manifest["tables"][0]["student_to_teacher"]).is_file()
    assert manifest["tables"][0]["teacher_fingerprint"] == manifest["tokenizers"]["teachers"][0]["fingerprint"]
    # A user mistake is one line on stderr and exit code 2.
    bad = subprocess.run(cli + ["align", "--corpus", str(tmp_path / "nope.txt"), "--student-tokenizer", "llama-bpe",
                                "--teacher-tokenizer", "qwen2", "--output", str(tmp_path / "y")],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr


def test_rows_match_the_reference(one_worker_run):
    from tests.align.test_chunks import aligner

    rows = rows_of(one_worker_run)
    aligner_ = aligner("llama-bpe", "qwen2", 2048)
    documents = [Document(r["source"], r["record_index"], r["text"]) for r in rows]
    table = pq.read_table(shard_paths(read_manifest(one_worker_run), one_worker_run)[0])
    assert table.schema.equals(aligned_schema(1), check_metadata=True)
    check_rows(aligner_, documents[:table.num_rows], table)
    assert [r["record_index"] for r in rows] == sorted(r["record_index"] for r in rows)
    assert len({r["row_id"] for r in rows}) == len(rows)


@pytest.mark.slow
def test_two_workers_write_the_same_bytes(tmp_path, small_corpus, tables_for, one_worker_run):
    out = tmp_path / "two"
    run_align(config(small_corpus, out, [tables_for("llama-bpe", "qwen2")]), workers=2)
    assert read_manifest(out)["totals"]["shards"] >= 3
    assert tree(out) == tree(one_worker_run)


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_bytes(tmp_path, small_corpus, tables_for, one_worker_run):
    out = tmp_path / "killed"
    s2t, t2s = tables_for("llama-bpe", "qwen2")
    command = [sys.executable, "-m", "cli.main", "align", "--corpus", str(small_corpus), "--split-on-blank-lines",
               "--student-tokenizer", "llama-bpe", "--teacher-tokenizer", "qwen2", "--output", str(out),
               "--tables", s2t, t2s, "--shard-mb", str(12_000 / (1 << 20)), "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO), CSD_TEST_CRASH="before_marker:2")
    first = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    assert first.returncode == -9
    assert not (out / "manifest.json").exists() and list(out.glob("part-*.parquet"))
    env.pop("CSD_TEST_CRASH")
    second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    assert second.returncode == 0, second.stderr
    assert tree(out) == tree(one_worker_run)


def test_ranks_split_the_work_and_any_rank_can_finalize(tmp_path, small_corpus, tables_for, one_worker_run,
                                                         run_cli):
    from csd_pipeline.runtime.run_record import finalize, stage_status

    out = tmp_path / "ranks"
    cfg = config(small_corpus, out, [tables_for("llama-bpe", "qwen2")])
    report = run_align(cfg, rank=1, world_size=2)
    assert not report.complete and stage_status(out)["missing"]
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "2"
    try:
        assert run_align(cfg).complete  # rank and world size from torchrun's variables
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    (out / "manifest.json").unlink()
    # in this process (test_cli_as_a_new_user_runs_it runs `status` as a subprocess)
    _, missing, _ = run_cli(["status", str(out), "--json"])
    assert json.loads(missing)["complete"] is False and json.loads(missing)["missing"] == []
    code, done, _ = run_cli(["status", str(out), "--finalize"])
    assert code == 0 and "complete (manifest written)" in done
    (out / "manifest.json").unlink()
    assert finalize(out, log=lambda m: None) is not None
    single = read_manifest(one_worker_run)["shards"]
    split = read_manifest(out)["shards"]
    assert [s["sha256"] for s in split] == [s["sha256"] for s in single]  # same shards, named by rank
    assert [s["name"] for s in split][:2] == ["part-00000-00000", "part-00001-00001"]


def test_several_teachers_and_the_identity_teacher(tmp_path, small_corpus, tables_for):
    out = tmp_path / "multi"
    cfg = config(small_corpus, out, [tables_for("llama-bpe", "qwen2"), tables_for("llama-bpe", "llama-bpe")],
                 teacher_tokenizers=["qwen2", "llama-bpe"], max_student_tokens=64, max_teacher_tokens=[48, 64])
    run_align(cfg)
    manifest = read_manifest(out)
    assert [t["teacher"] for t in manifest["tables"]] == [0, 1]
    for record in manifest["tables"]:
        assert (out / record["teacher_to_student"]).is_file()
    rows = rows_of(out)
    assert any(r["window_index"] > 0 for r in rows)
    for row in rows:
        assert len(row["student_ids"]) <= 64 and len(row["teacher0_ids"]) <= 48 and len(row["teacher1_ids"]) <= 64
        assert row["teacher1_ids"] == row["student_ids"]
        assert set(row["teacher1_chunk_student_len"]) == {1} == set(row["teacher1_chunk_teacher_len"])
        assert sum(row["teacher0_chunk_student_len"]) == len(row["student_ids"])
        assert sum(row["teacher0_chunk_teacher_len"]) == len(row["teacher0_ids"])
    stats = manifest["totals"]["stats"]
    # Windows cover each document without loss unless a region is rejected (counted).
    assert stats["bytes"]["windows"] + stats["rejected_region_bytes"] == stats["bytes"]["documents"]
    by_doc: dict[int, list] = {}
    for row in rows:
        by_doc.setdefault(row["record_index"], []).append(row)
    text = {i: d.text for i, d in enumerate(_blocks(small_corpus))}
    for record, windows in by_doc.items():
        starts = [w["byte_start"] for w in windows]
        assert starts == sorted(starts) and [w["window_index"] for w in windows] == list(range(len(windows)))
        source = text[record].encode()
        for w in windows:
            assert source[w["byte_start"]:w["byte_start"] + len(w["text"].encode())] == w["text"].encode()
        if not stats["rejected_region_bytes"]:
            assert "".join(w["text"] for w in windows) == text[record]


def _blocks(path):
    from csd_pipeline.align.corpus import ReadOptions, discover, read_segment

    [file] = discover([str(path)])
    return list(read_segment(file, {"first": 0, "count": 1 << 60, "offset": 0}, ReadOptions(split_on_blank_lines=True)))


def test_overlong_chunks_are_rejected_regions_never_truncated(tmp_path, tables_for):
    corpus = tmp_path / "emoji.jsonl"
    corpus.write_text(json.dumps({"text": "plain words then 👨‍👩‍👧‍👦👨‍👩‍👧‍👦 family and more plain words"}) + "\n")
    out = tmp_path / "out"
    run_align(config(corpus, out, [tables_for("llama-bpe", "qwen2")], split_on_blank_lines=False,
                     max_student_tokens=3, max_teacher_tokens=[3]))
    stats = read_manifest(out)["totals"]["stats"]
    assert stats["rejected_regions"]["chunk_longer_than_window"] >= 1
    assert stats["bytes"]["windows"] + stats["rejected_region_bytes"] == stats["bytes"]["documents"]
    assert all(len(r["student_ids"]) <= 3 and len(r["teacher0_ids"]) <= 3 for r in rows_of(out))


@pytest.mark.slow
def test_bad_input_is_aligned_or_counted(tmp_path, tables_for):
    corpus = tmp_path / "bad"
    corpus.mkdir()
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "spaces.txt").write_bytes(b"   \n\t  ")
    (corpus / "latin1.txt").write_bytes(b"caf\xe9")
    (corpus / "bom-crlf.txt").write_bytes("\ufeffline one\r\nline two\rlone CR".encode())
    (corpus / "specials.txt").write_text("<|endoftext|> <s> </s> <|im_start|>user\n<|begin_of_text|>")
    (corpus / "runs.txt").write_text(" " * 300 + "x" + "\n" * 50 + "a\u200db e\u0301 \x00 end")
    lines = [json.dumps({"text": "fine"}), "{broken", json.dumps({"body": "no text"}), '{"text": "\\udc80"}',
             json.dumps({"text": "y" * (2 << 20)}), json.dumps({"text": ""})]
    (corpus / "records.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    run_align(config(corpus, out, [tables_for("llama-bpe", "qwen2")], split_on_blank_lines=False))
    stats = read_manifest(out)["totals"]["stats"]
    assert stats["rejected_documents"] == {"invalid_utf8": 1, "broken_json": 1, "missing_text_field": 1,
                                           "lone_surrogate": 1, "empty": 2}
    assert stats["documents"] == {"read": 12, "aligned": 6, "with_rejected_regions": 0}
    rows = rows_of(out)
    texts = {(Path(r["source"]).name, r["record_index"]) for r in rows}
    assert ("specials.txt", 0) in texts and ("records.jsonl", 4) in texts and ("spaces.txt", 0) in texts
    specials = next(r for r in rows if r["source"].endswith("specials.txt"))
    teacher = load_bundle(str(__import__("csd_pipeline.fixtures.names", fromlist=["x"]).tokenizer_path("qwen2")))
    # Text that spells special tokens is text: no special id appears after the context token.
    assert not teacher.vocab.is_special[np.asarray(specials["teacher0_ids"][1:])].any()
    bom = next(r for r in rows if r["source"].endswith("bom-crlf.txt"))
    assert bom["text"] == "line one\r\nline two\rlone CR"
    for row in rows:
        statuses = set(row["teacher0_chunk_status"])
        assert statuses <= {ChunkStatus.ACCEPTED, ChunkStatus.SPECIAL, ChunkStatus.MISMATCH}
    runs = next(r for r in rows if r["source"].endswith("runs.txt"))
    assert ChunkStatus.MISMATCH in runs["teacher0_chunk_status"]  # Qwen2's NFC composes e + U+0301


def test_user_errors_are_one_sentence(tmp_path, small_corpus, tables_for, one_worker_run):
    tables = [tables_for("llama-bpe", "qwen2")]
    with pytest.raises(CsdError, match="does not exist"):
        run_align(config(tmp_path / "missing", tmp_path / "o1", tables))
    before = tree(one_worker_run)
    with pytest.raises(CsdError, match=r"another align run \(its config.max_student_tokens, config.max_teacher_tokens differ"):
        run_align(config(small_corpus, one_worker_run, tables, max_student_tokens=512))
    with pytest.raises(CsdError, match=r"another align run \(its tokenizers.teachers differ"):
        run_align(config(small_corpus, one_worker_run, [tables_for("llama-bpe", "llama-bpe")], teacher_tokenizers=["llama-bpe"]))
    assert tree(one_worker_run) == before  # nothing of the other run was touched
    swapped = [tuple(reversed(tables[0]))]
    with pytest.raises(CsdError, match="does not match the tokenizers of teacher 0"):
        run_align(config(small_corpus, tmp_path / "o2", swapped))
    with pytest.raises(CsdError, match="--max-teacher-tokens was given 2 times for 1"):
        run_align(config(small_corpus, tmp_path / "o3", tables, max_teacher_tokens=[10, 20]))
    with pytest.raises(CsdError, match="chat"):
        run_align(config(small_corpus, tmp_path / "o4", tables, mode="chat"))
