"""`csd-pipeline inspect` tables (csd_pipeline/report/stats.py, polars scans) against a brute-force count."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from csd_pipeline.align.output import AlignedOutput
from csd_pipeline.errors import CsdError
from csd_pipeline.report.stats import aligned_tables, inspect_summary
from schemas.aligned import SHAPES, ChunkStatus

DATA = Path(__file__).resolve().parents[1] / "data"


def brute_force(directory: Path) -> dict:
    """Every table of `aligned_tables`, counted row by row in Python from the token-id columns (the
    column names spelled out here, independently of the reader)."""
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
    tables = aligned_tables(AlignedOutput.open(directory))
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
def test_inspect_tables_of_a_chat_output(tmp_path, tables_for, tokenizer_path):
    # chat mode counts every token of a rendering (no context-token head) and the supervised ones
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align

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
    before = dataclasses.asdict(aligned_tables(AlignedOutput.open(copy)))
    manifest = json.loads((copy / "manifest.json").read_text())
    shutil.copy(copy / manifest["shards"][0]["file"], copy / "part-00099-00099.parquet")
    assert dataclasses.asdict(aligned_tables(AlignedOutput.open(copy))) == before
    (copy / manifest["shards"][-1]["file"]).unlink()
    with pytest.raises(CsdError, match="is missing"):
        aligned_tables(AlignedOutput.open(copy))
