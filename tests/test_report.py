"""`csd-pipeline inspect` tables (polars scans) against a brute-force count, and `csd-pipeline report`
on each kind of folder: aligned, teacher top-k (a tiny random teacher), a csd-train run."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.report.stats import aligned_tables, inspect_summary
from csd_pipeline.teacher.codec import MAX_ABS_ERROR
from schemas.aligned import SHAPES, ChunkStatus
from tests.test_align_stage import tables_for  # noqa: F401 (a fixture: tables cached next to the fixtures)

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"


def brute_force(directory: Path) -> dict:
    """Every table of `aligned_tables`, counted row by row in Python from the token-id columns."""
    manifest = json.loads((directory / "manifest.json").read_text())
    teachers = len(manifest["tokenizers"]["teachers"])
    chat = manifest["config"]["mode"] == "chat"
    context = {"student": manifest["tokenizers"]["student"]["context_token"] is not None,
               **{f"teacher{i}": t["context_token"] is not None for i, t in enumerate(manifest["tokenizers"]["teachers"])}}
    sides = ["student", *(f"teacher{i}" for i in range(teachers))]
    out = {"rows": 0, "documents": set(), "text_bytes": 0, "supervised": 0, "tokens": Counter(),
           "status": {f"teacher{i}": Counter() for i in range(teachers)},
           "shapes": {f"teacher{i}": Counter() for i in range(teachers)},
           "windows": {side: Counter() for side in sides}, "per_source": {}}
    for shard in manifest["shards"]:  # the manifest's list, as a reader must
        for row in pq.read_table(directory / shard["file"]).to_pylist():
            source = out["per_source"].setdefault(row["source"], {"rows": 0, "documents": set(), "text_bytes": 0,
                                                                  "tokens": Counter(), "accepted": Counter(),
                                                                  "content": Counter()})
            out["rows"] += 1
            source["rows"] += 1
            out["documents"].add((row["source"], row["record_index"]))
            source["documents"].add(row["record_index"])
            size = len(row["text"].encode("utf-8"))
            out["text_bytes"] += size
            source["text_bytes"] += size
            out["supervised"] += sum(row["student_loss_mask"]) if chat else 0
            for side in sides:
                ids = row["student_ids"] if side == "student" else row[f"{side}_ids"]
                out["windows"][side][len(ids)] += 1
                content = len(ids) - (0 if chat or not manifest["config"]["context_token"] else int(context[side]))
                out["tokens"][side] += content
                source["tokens"][side] += content
            for i in range(teachers):
                lengths = zip(row[f"teacher{i}_chunk_student_len"], row[f"teacher{i}_chunk_teacher_len"],
                              row[f"teacher{i}_chunk_status"], strict=True)
                for m, n, status in lengths:
                    name = ChunkStatus(status).name
                    out["status"][f"teacher{i}"][name] += 1
                    source["content"][f"teacher{i}"] += status != ChunkStatus.SPECIAL
                    if status == ChunkStatus.ACCEPTED:
                        shape = ("1" if m == 1 else "M") + ":" + ("1" if n == 1 else "N")
                        out["shapes"][f"teacher{i}"][shape] += 1
                        source["accepted"][f"teacher{i}"] += 1
    return out


def check_against_brute_force(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    tables = aligned_tables(directory, manifest)
    want = brute_force(directory)
    assert tables.rows == want["rows"] and tables.documents == len(want["documents"])
    assert tables.text_bytes == want["text_bytes"] and tables.supervised_student_tokens == want["supervised"]
    assert tables.tokens == dict(want["tokens"])
    for teacher, counts in want["status"].items():
        assert tables.chunk_status[teacher] == {s.name: counts[s.name] for s in ChunkStatus}
        assert tables.chunk_shapes[teacher] == {s: want["shapes"][teacher][s] for s in SHAPES}
    assert tables.window_tokens == {side: dict(sorted(c.items())) for side, c in want["windows"].items()}
    assert {e["source"] for e in tables.sources} == set(want["per_source"])
    for entry in tables.sources:
        expected = want["per_source"][entry["source"]]
        assert (entry["rows"], entry["documents"], entry["text_bytes"]) == (
            expected["rows"], len(expected["documents"]), expected["text_bytes"])
        assert entry["tokens"] == dict(expected["tokens"])
        assert entry["chunks"] == {t: {"content": expected["content"][t], "accepted": expected["accepted"][t]}
                                   for t in want["status"]}
    # The `inspect` summary keeps today's keys and agrees with what the align stage counted as it wrote.
    summary, stats = inspect_summary(directory), manifest["totals"]["stats"]
    assert summary["tokens"] == stats["tokens"] and summary["windows"] == stats["windows"] == tables.rows
    assert summary["text_bytes"] == stats["bytes"]["windows"]
    for teacher in want["status"]:
        assert summary["chunk_status"][teacher] == stats[teacher]["chunk_status"]
        assert summary["chunk_shapes"][teacher] == stats[teacher]["accepted_shapes"]
    assert summary["documents"] == stats["documents"]


def test_inspect_tables_equal_a_brute_force_count(trainer_data):
    # several shards and documents (eval), long documents cut into windows (train), two teachers (train_short)
    assert len(json.loads((trainer_data["eval"] / "manifest.json").read_text())["shards"]) > 1
    for name in ("eval", "train", "train_short"):
        check_against_brute_force(trainer_data[name])


@pytest.mark.slow
def test_inspect_tables_of_a_chat_output(tmp_path, tables_for, tokenizer_path):  # noqa: F811
    # chat mode counts every token of a rendering (no context-token head) and the supervised ones
    from csd_pipeline.align.stage import AlignConfig, run_align

    out = tmp_path / "chat"
    run_align(AlignConfig(corpus=[str(DATA / "python-faq-chat-slice.jsonl")], student_tokenizer=str(tokenizer_path("qwen2")),
                          teacher_tokenizers=[str(tokenizer_path("smollm2"))], output=str(out), mode="chat",
                          tables=[tables_for("qwen2", "smollm2")]))
    check_against_brute_force(out)
    assert inspect_summary(out)["chat"]["supervised_student_tokens"] > 0


def test_inspect_reads_the_manifest_shard_list_not_the_folder(trainer_data, tmp_path):
    # a stray shard in the folder changes nothing; a listed shard that is missing is one clear error
    import shutil

    copy = tmp_path / "aligned"
    shutil.copytree(trainer_data["eval"], copy)
    before = dataclasses.asdict(aligned_tables(copy, json.loads((copy / "manifest.json").read_text())))
    manifest = json.loads((copy / "manifest.json").read_text())
    shutil.copy(copy / manifest["shards"][0]["file"], copy / "part-00099-00099.parquet")
    assert dataclasses.asdict(aligned_tables(copy, manifest)) == before
    (copy / manifest["shards"][-1]["file"]).unlink()
    with pytest.raises(CsdError, match="is missing"):
        aligned_tables(copy, manifest)


# ---------------------------------------------------------------------------------------------
# `csd-pipeline report`


@pytest.fixture(scope="module")
def teacher_output(trainer_data, tmp_path_factory, tokenizer_path):
    """Top-8 of a tiny random Llama with SmolLM2's vocabulary on `train_short` (teacher 0)."""
    import torch

    from tests.test_teacher_logits import make_tiny_teacher, run_stage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_tiny_teacher(tmp_path_factory.mktemp("tiny-teacher"), tokenizer_path("smollm2"))
    out = tmp_path_factory.mktemp("teacher") / "topk"
    run_stage(trainer_data["train_short"], model, out)
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def training_run(trainer_data, teacher_output, tmp_path_factory):
    """Four CSD steps of the tiny student on `train_short` with the tiny teacher, evaluated twice."""
    import torch

    from trainer.config import parse_args
    from trainer.loop import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run") / "student-csd"
    train(parse_args(["--aligned", str(trainer_data["train_short"]), "--teacher-logits", str(teacher_output),
                      "--student-config", str(trainer_data["student_config"]), "--student-tokenizer", "llama-spm",
                      "--output", str(out), "--steps", "4", "--seq-len", "128", "--batch-size", "2",
                      "--warmup-steps", "1", "--save-every", "0", "--workers", "0", "--no-progress",
                      "--eval-aligned", str(trainer_data["eval"]), "--eval-every", "2"]))
    torch.set_num_threads(threads)
    return out


def test_teacher_mass_of_one_to_one_chunks_equals_the_stored_top_k(trainer_data, teacher_output):
    # 1:1 chunk: explicit events = stored top-k ids (and the observed id) whose spelling the student has
    from csd_pipeline.report.coverage import teacher_coverage
    from csd_pipeline.teacher.reader import read_teacher_topk
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    coverage = teacher_coverage(teacher_output, trainer_data["train_short"], max_rows=10_000)
    student = set(load_tokenizer("llama-spm").vocab.spellings())
    spelling = {i: s for s, ids in load_tokenizer("smollm2").vocab.spellings().items() for i in ids}
    expected = []
    manifest = json.loads((trainer_data["train_short"] / "manifest.json").read_text())
    rows = [r for s in manifest["shards"] for r in pq.read_table(trainer_data["train_short"] / s["file"]).to_pylist()]
    for row, topk in zip(rows, read_teacher_topk(teacher_output), strict=True):
        t0 = 0
        for m, n, status in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"],
                                row["teacher0_chunk_status"]):
            if status == ChunkStatus.ACCEPTED and m == n == 1 and t0 > 0:
                observed = row["teacher0_ids"][t0]
                ids = set(topk.ids[t0 - 1].tolist()) | {observed}
                logp = {int(i): float(lp) for i, lp in zip(topk.ids[t0 - 1], topk.logprobs[t0 - 1])}
                logp.setdefault(observed, float(topk.observed_logprob[t0 - 1]))
                expected.append(sum(math.exp(logp[i]) for i in ids if spelling.get(i) in student))
            t0 += n
    got = coverage.mass[coverage.shape == 0]
    assert coverage.rows_read == sum(s["rows"] for s in manifest["shards"]) and got.size == len(expected) > 20
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    # stored log-probs are within MAX_ABS_ERROR nat of the teacher's, so a sum may pass 1 by that factor
    assert 0 < coverage.mass.min() and coverage.mass.max() <= math.exp(MAX_ABS_ERROR)
    assert coverage.topk_mass.size == sum(len(r["teacher0_ids"]) for r in rows)


def test_report_writes_a_file_for_each_kind_of_folder(trainer_data, teacher_output, training_run, tmp_path):
    from csd_pipeline.report.render import write_report

    out = tmp_path / "report"
    folders = [trainer_data["train"], trainer_data["train_short"], teacher_output, training_run]
    report = write_report(folders, out, teacher_rows=5)
    text = report.read_text()
    for heading in ("## Aligned output `train`", "## Aligned output `train-short`", "## Teacher top-k `topk`",
                    "## Training runs"):
        assert heading in text
    assert "from 5 of" in text  # --teacher-rows bounds the rows read
    images = [line[line.index("(") + 1:-1] for line in text.splitlines() if line.startswith("![")]
    assert sorted(images) == sorted(p.name for p in out.glob("*.png"))  # every plot is linked, nothing else left
    assert {"aligned-1-chunks.png", "aligned-1-windows.png", "teacher-3-mass.png", "training-curves.png",
            "training-heldout.png", "training-event-coverage.png"} <= set(images)
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("*.tmp*"))


def test_report_cli_refuses_an_unknown_folder_with_one_line(trainer_data, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not an output")
    result = subprocess.run([sys.executable, "-m", "cli.main", "report", str(trainer_data["train"]),
                             str(tmp_path / "notes"), "--output", str(tmp_path / "report")],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "notes" in lines[0], result.stderr
    assert not (tmp_path / "report").exists()  # nothing written before every folder is recognised


def test_report_of_a_stage_output_that_is_not_complete(trainer_data, tmp_path):
    import shutil

    from csd_pipeline.report.folders import recognise

    copy = tmp_path / "aligned"
    shutil.copytree(trainer_data["train"], copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(CsdError, match="status"):
        recognise(copy)
