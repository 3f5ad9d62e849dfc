"""One teacher capture, many students: `align --capture-only` and `align --against-capture` on real tokenizers and text.

Checked against independent references: each row's student tokens are those of the whole document's
tokenization (the tokenizer's own ids, byte spans from the vocabulary's token bytes) that lie wholly inside
the window; teacher ids are the capture's; every ACCEPTED chunk spells the same source bytes on both sides;
CAPTURE_EDGE chunks are counted; on windows that both cut alike the rows equal those of the normal align.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csd_pipeline.errors import CsdError
from schemas.aligned import CAPTURE_COLUMNS, ChunkStatus

DATA = Path(__file__).resolve().parent.parent / "data"
STUDENTS = ("llama-spm", "gpt-2")  # SentencePiece with byte fallback; ByteLevel BPE
TEACHER = "smollm2"


def tokenizers(tokenizer_path, student: str | None):
    from csd_pipeline.align.shard_writer import AlignTokenizers
    from tests.csd_cases import bundle

    return AlignTokenizers(bundle(tokenizer_path, student) if student else None, [bundle(tokenizer_path, TEACHER)])


def capture(tokenizer_path, corpus: list[Path], output: Path, window: int, **options) -> Path:
    from csd_pipeline.align.stage import AlignConfig, run_align

    run_align(AlignConfig(corpus=[str(c) for c in corpus], teacher_tokenizers=[str(tokenizer_path(TEACHER))],
                          output=str(output), capture_only=True, max_teacher_tokens=[window], **options),
              tokenizers=tokenizers(tokenizer_path, None))
    return output


def against(tokenizer_path, tables_for, captured: Path, student: str, output: Path, max_student: int = 4096) -> Path:
    from csd_pipeline.align.stage import AlignConfig, run_align

    run_align(AlignConfig(against_capture=str(captured), student_tokenizer=str(tokenizer_path(student)),
                          output=str(output), max_student_tokens=max_student, tables=[tables_for(student, TEACHER)]),
              tokenizers=tokenizers(tokenizer_path, student))
    return output


def rows(directory: Path) -> list[dict]:
    manifest = json.loads((directory / "manifest.json").read_text())
    return [row for shard in manifest["shards"] for row in pq.read_table(directory / shard["file"]).to_pylist()]


def spelled(vocab, ids) -> bytes:
    return b"".join(vocab.token_bytes[i] for i in ids)


def reference_student_ids(bundle, text: str, lo: int, hi: int) -> list[int] | None:
    """The student's tokens of the whole document that lie wholly inside bytes [lo, hi), from its own ids and
    token bytes; None when its token bytes do not spell the document (a normalizer changed it)."""
    ids = bundle.tokenizer.encode(text, add_special_tokens=False).ids
    lengths = [len(bundle.vocab.token_bytes[i]) for i in ids]
    source = text.encode("utf-8")
    if bundle.vocab.dummy_prefix and ids and sum(lengths) == len(source) + 1 and bundle.vocab.token_bytes[ids[0]][:1] == b" ":
        lengths[0] -= 1
    if sum(lengths) != len(source):
        return None
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    # a zero-width token (SentencePiece's lone dummy-prefix piece) goes with the token after it
    return [i for i, s, e in zip(ids, starts, ends) if (lo <= s and e <= hi and e > s) or (e == s and lo <= s < hi)]


def check_against(capture_dir: Path, aligned_dir: Path, student_bundle, teacher_bundle, documents: dict | None):
    """The invariants of an output aligned against a capture; returns the number of CAPTURE_EDGE chunks seen."""
    captured, aligned = rows(capture_dir), rows(aligned_dir)
    cap_manifest = json.loads((capture_dir / "manifest.json").read_text())
    manifest = json.loads((aligned_dir / "manifest.json").read_text())
    assert [(s["name"], s["rows"]) for s in manifest["shards"]] == [(s["name"], s["rows"]) for s in cap_manifest["shards"]]
    assert [r["row_id"] for r in aligned] == [r["row_id"] for r in captured]
    edges = outside = 0
    for cap, row in zip(captured, aligned):
        assert row["teacher0_ids"] == cap["teacher0_ids"] and row["text"] == cap["text"]
        m, n, status = (np.asarray(row[k]) for k in ("teacher0_chunk_student_len", "teacher0_chunk_teacher_len",
                                                       "teacher0_chunk_status"))
        assert m.sum() == len(row["student_ids"]) and n.sum() == len(row["teacher0_ids"])
        context = cap_manifest["config"]["context_token"]
        assert (m >= 0).all() and (n >= 0).all()
        if context:  # the pair of context tokens, then content
            assert status[0] == ChunkStatus.SPECIAL and m[0] == n[0] == 1
        else:  # the first content chunk has no predictor on either side
            assert status[0] != ChunkStatus.ACCEPTED
        s_at, t_at = np.concatenate([[0], np.cumsum(m)]), np.concatenate([[0], np.cumsum(n)])
        text = row["text"].encode("utf-8")
        head = int(context)  # the context token of each side, when the rows start with one
        teacher_spells_text = spelled(teacher_bundle.vocab, row["teacher0_ids"][head:]) == text
        for c in np.flatnonzero(status == ChunkStatus.ACCEPTED):
            s_bytes = spelled(student_bundle.vocab, row["student_ids"][s_at[c]:s_at[c + 1]])
            t_bytes = spelled(teacher_bundle.vocab, row["teacher0_ids"][t_at[c]:t_at[c + 1]])
            assert s_bytes == t_bytes and m[c] > 0 and n[c] > 0
            if teacher_spells_text:
                offset = len(spelled(teacher_bundle.vocab, row["teacher0_ids"][head:t_at[c]]))
                assert text[offset:offset + len(t_bytes)] == t_bytes
        edges += int((status == ChunkStatus.CAPTURE_EDGE).sum())
        outside += len(text) - len(spelled(student_bundle.vocab, row["student_ids"][head:]))
        if documents is not None:
            key = (row["source"], row["record_index"])
            lo = row["byte_start"]
            expected = reference_student_ids(student_bundle, documents[key], lo, lo + len(text))
            if expected is not None:
                assert row["student_ids"][head:] == expected, row["row_id"]
    stats = manifest["totals"]["stats"]
    assert stats["teacher0"]["chunk_status"]["CAPTURE_EDGE"] == edges
    assert sum(stats["capture_edges"][k] for k in ("window_start", "window_end", "window_start_and_end")) == edges
    if not student_bundle.vocab.dummy_prefix and student_bundle.vocab.family == "byte_level":  # tokens spell the text
        assert stats["capture_edges"]["student_bytes_outside_rows"] == outside
    return edges


@pytest.fixture(scope="module")
def devil_capture(tokenizer_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    return capture(tokenizer_path, [DATA / "devil-slice.txt"], root / "capture", 40, split_on_blank_lines=True,
                   shard_bytes=3000)


@pytest.mark.parametrize("student", STUDENTS)
def test_rows_against_a_capture_hold_its_teacher_ids_and_the_students_own_tokens(
        student, devil_capture, tokenizer_path, tables_for, tmp_path):
    from tests.csd_cases import bundle

    out = against(tokenizer_path, tables_for, devil_capture, student, tmp_path / "student")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["against_capture"]["manifest_sha256"] == _sha256(devil_capture / "manifest.json")
    shards = json.loads((devil_capture / "manifest.json").read_text())["shards"]
    assert len(shards) > 1 and [s["file"] for s in manifest["shards"]] == [s["file"] for s in shards]
    texts = _devil_documents(devil_capture)
    edges = check_against(devil_capture, out, bundle(tokenizer_path, student), bundle(tokenizer_path, TEACHER), texts)
    assert edges > 0  # windows of 40 teacher tokens: some edges fall inside a student token


def test_a_capture_covers_every_document_byte_once_with_teacher_windows(devil_capture, tokenizer_path):
    from tests.csd_cases import bundle

    teacher = bundle(tokenizer_path, TEACHER)
    manifest = json.loads((devil_capture / "manifest.json").read_text())
    assert manifest["kind"] == "capture" and manifest["tables"] == [] and "student" not in manifest["tokenizers"]
    table = pq.read_table(devil_capture / manifest["shards"][0]["file"])
    assert table.schema.names == list(CAPTURE_COLUMNS) and table.schema.metadata[b"csd.schema"] == b"aligned-capture"
    texts = _devil_documents(devil_capture)
    covered: dict = {}
    for row in rows(devil_capture):
        assert len(row["teacher0_ids"]) <= 40 and row["teacher0_ids"][0] == teacher.vocab.context_token()
        key = (row["source"], row["record_index"])
        covered.setdefault(key, []).append((row["byte_start"], row["text"]))
    assert set(covered) == set(texts)
    from csd_pipeline.report.stats import inspect_summary

    summary = inspect_summary(devil_capture)  # `csd-pipeline inspect` reads a capture from its manifest
    assert summary["kind"] == "capture" and summary["windows"] == len(rows(devil_capture))
    for key, windows in covered.items():
        assert b"".join(t.encode("utf-8") for _, t in windows) == texts[key].encode("utf-8")  # once, in order
        starts = [s for s, _ in windows]
        assert starts == sorted(starts) and starts[0] == 0


def test_on_windows_both_cut_alike_the_rows_equal_the_normal_aligns(tokenizer_path, tables_for, tmp_path):
    """Documents that fit one window whatever the tokenizer: the capture's windows are the normal align's, so the
    student's rows (ids, chunks, statuses, loss mask) must be the same, column for column."""
    from csd_pipeline.align.stage import AlignConfig, run_align

    captured = capture(tokenizer_path, [DATA / "kjv-genesis-slice.txt"], tmp_path / "capture", 4096,
                       split_on_blank_lines=True, shard_bytes=2000)
    for student in STUDENTS:
        out = against(tokenizer_path, tables_for, captured, student, tmp_path / f"against-{student}")
        normal = tmp_path / f"normal-{student}"
        run_align(AlignConfig(corpus=[str(DATA / "kjv-genesis-slice.txt")], student_tokenizer=str(tokenizer_path(student)),
                              teacher_tokenizers=[str(tokenizer_path(TEACHER))], output=str(normal),
                              max_student_tokens=4096, max_teacher_tokens=[4096], split_on_blank_lines=True,
                              shard_bytes=2000, tables=[tables_for(student, TEACHER)]),
                  tokenizers=tokenizers(tokenizer_path, student))
        assert rows(out) == rows(normal)
        assert json.loads((out / "manifest.json").read_text())["totals"]["stats"]["capture_edges"]["window_start"] == 0


AWKWARD = st.sampled_from([
    "naïve café", "e\u0301\u0301", "日本語のテキスト", "中文，标点。", "🙂🙃🧑‍🤝‍🧑", "  \t  ", "\r\n", "\n\n\n",
    "<|endoftext|>", "<s>", "[INST]", "word", " the", "1234567", "ä", "ß", "x" * 30, "🏳️‍🌈", "\u200b", "don't",
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(docs=st.lists(st.lists(AWKWARD, min_size=1, max_size=25).map("".join).filter(str.strip), min_size=1, max_size=4),
       window=st.integers(3, 24), student=st.sampled_from(STUDENTS), context=st.booleans())
def test_awkward_text_against_a_capture_keeps_every_invariant(docs, window, student, context, tokenizer_path, tables_for,
                                                               tmp_path_factory):
    from tests.csd_cases import bundle

    root = tmp_path_factory.mktemp("awkward")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    captured = capture(tokenizer_path, [corpus], root / "capture", window, context_token=context)
    out = against(tokenizer_path, tables_for, captured, student, root / "student")
    texts = {(str(corpus), i): d for i, d in enumerate(docs)}
    check_against(captured, out, bundle(tokenizer_path, student), bundle(tokenizer_path, TEACHER), texts)


# ---------------------------------------------------------------------------------------------
# refusals: one line each, naming the folder and the fix


def test_refusals_are_one_line(devil_capture, tokenizer_path, tables_for, tmp_path):
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.align.stage import run_align

    cases = [
        (lambda: AlignConfig(corpus=["x.txt"], student_tokenizer="gpt-2", teacher_tokenizers=[TEACHER], output="o",
                             capture_only=True).validate(), "--capture-only writes no student"),
        (lambda: AlignConfig(corpus=["x.txt"], teacher_tokenizers=[TEACHER, TEACHER], output="o",
                             capture_only=True).validate(), "exactly one --teacher-tokenizer"),
        (lambda: AlignConfig(against_capture="c", output="o").validate(), "pass --student-tokenizer"),
        (lambda: AlignConfig(against_capture="c", corpus=["x.txt"], student_tokenizer="gpt-2", output="o").validate(),
         "drop --corpus"),
        (lambda: AlignedOutput.open(devil_capture).tables(0), "is a teacher capture"),
        (lambda: AlignedOutput.open(devil_capture).require_student("--aligned"), "--against-capture"),
    ]
    student_out = against(tokenizer_path, tables_for, devil_capture, "gpt-2", tmp_path / "student")
    cases.append((lambda: run_align(AlignConfig(against_capture=str(student_out), student_tokenizer="gpt-2",
                                                output=str(tmp_path / "again"))), "not a capture"))
    cases.append((lambda: run_align(AlignConfig(against_capture=str(devil_capture), student_tokenizer="gpt-2",
                                                teacher_tokenizers=[str(tokenizer_path("gpt-2"))],
                                                output=str(tmp_path / "other-teacher"))), "teacher tokenizer 0"))
    for action, words in cases:
        with pytest.raises(CsdError) as err:
            action()
        assert words in str(err.value) and "\n" not in str(err.value)


def test_a_changed_corpus_is_refused(tokenizer_path, tables_for, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": "Hello there, general text."}) + "\n", encoding="utf-8")
    captured = capture(tokenizer_path, [corpus], tmp_path / "capture", 8)
    corpus.write_text(json.dumps({"text": "Hello there, general test."}) + "\n", encoding="utf-8")  # same size
    with pytest.raises(CsdError, match="differs from the capture's") as err:
        against(tokenizer_path, tables_for, captured, "gpt-2", tmp_path / "student")
    assert "\n" not in str(err.value)
    corpus.write_text(json.dumps({"text": "Hello."}) + "\n", encoding="utf-8")
    with pytest.raises(CsdError, match="capture again"):
        against(tokenizer_path, tables_for, captured, "gpt-2", tmp_path / "student2")


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _devil_documents(capture_dir: Path) -> dict:
    """{(source, record_index): text} of the documents the capture read (the blank-line blocks of devil-slice.txt)."""
    from csd_pipeline.align.corpus import CorpusFile, ReadOptions, read_segment

    record = json.loads((capture_dir / "run.json").read_text())
    out = {}
    for task in record["tasks"]:
        for segment in task["spec"]["segments"]:
            for document in read_segment(CorpusFile.from_spec(segment), segment, ReadOptions("text", True)):
                if document.text:
                    out[(document.source, document.record_index)] = document.text
    return out


@pytest.mark.slow  # a kill -9 and three stage processes
def test_killed_and_two_worker_runs_write_the_same_bytes(devil_capture, tokenizer_path, tables_for, tmp_path):
    """`kill -9` mid-run (the CLI, a shard written but not recorded) resumes to the bytes of one uninterrupted
    run, and so do two worker processes (each loads the tokenizers the stage recorded)."""
    import os
    import subprocess
    import sys

    from csd_pipeline.align.stage import AlignConfig, run_align

    def written(folder: Path) -> dict:
        names = [s["file"] for s in json.loads((folder / "manifest.json").read_text())["shards"]]
        return {name: (folder / name).read_bytes() for name in [*names, "manifest.json"]}

    reference = written(against(tokenizer_path, tables_for, devil_capture, "gpt-2", tmp_path / "one"))
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "cli.main", "align", "--against-capture", str(devil_capture), "--student-tokenizer",
               str(tokenizer_path("gpt-2")), "--max-student-tokens", "4096", "--tables", *tables_for("gpt-2", TEACHER),
               "--output", str(out), "--quiet"]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), CSD_TEST_CRASH="before_marker:2")
    assert subprocess.run(command, capture_output=True, text=True, env=env, cwd=repo).returncode == -9
    assert not (out / "manifest.json").exists()
    env.pop("CSD_TEST_CRASH")
    second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=repo)
    assert second.returncode == 0, second.stderr
    assert written(out) == reference
    run_align(AlignConfig(against_capture=str(devil_capture), student_tokenizer=str(tokenizer_path("gpt-2")),
                          output=str(tmp_path / "two"), max_student_tokens=4096, tables=[tables_for("gpt-2", TEACHER)]),
              workers=2)
    assert written(tmp_path / "two") == reference
