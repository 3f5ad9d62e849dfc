"""The align stage on the new corpus formats, run as a user runs it (`python -m cli.main align`): a
.jsonl.zst in frames, a .txt.gz in members, a DatasetDict folder and hf:NAME from a local datasets
cache, offline. Row ids and output bytes do not depend on --workers, every document's windows
reassemble the plain file's text, and a truncated file is one line on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.align.test_corpus import reference_blocks
from tests.align.test_corpus_formats import blocks, build_hub_cache, devil_records, gz, write_jsonl, zst
from tests.align.test_stage import rows_of, tree

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(corpus folder, datasets cache, {source: {record_index: plain text}})."""
    import datasets

    root = tmp_path_factory.mktemp("formats")
    folder = root / "corpus"
    folder.mkdir()
    records = devil_records()
    plain_jsonl = write_jsonl(root / "devil.jsonl", records)
    (folder / "devil.jsonl.zst").write_bytes(zst(plain_jsonl.read_bytes(), 700))
    docs_txt = "\n\n".join(blocks("python-docs-slice.txt", 40)).encode()
    (folder / "docs.txt.gz").write_bytes(gz(docs_txt, 4096))
    docs = [block.decode() for _, block in reference_blocks(docs_txt)]
    dataset = datasets.Dataset.from_list(records)
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(str(folder / "saved"))
    cache = root / "hf-cache"
    build_hub_cache(cache, "user/devil", {"train": plain_jsonl})
    devil = {i: r["text"] for i, r in enumerate(records) if r["text"]}
    texts = {f"{folder.as_posix()}/devil.jsonl.zst": devil, f"{folder.as_posix()}/saved/train": devil,
             "hf:user/devil[train]": devil, f"{folder.as_posix()}/docs.txt.gz": dict(enumerate(docs))}
    return folder, cache, texts


def align(corpus_args: list[str], out: Path, tables, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    s2t, t2s = tables
    command = [sys.executable, "-m", "cli.main", "align", *sum((["--corpus", c] for c in corpus_args), []),
               "--split", "train", "--split-on-blank-lines", "--student-tokenizer", "llama-bpe",
               "--teacher-tokenizer", "qwen2", "--output", str(out), "--tables", s2t, t2s,
               "--shard-mb", str(3000 / (1 << 20)), "--quiet", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(cache))
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)


@pytest.mark.slow
def test_row_ids_and_bytes_do_not_depend_on_workers(tmp_path, corpus, tables_for):
    folder, cache, texts = corpus
    tables = tables_for("llama-bpe", "qwen2")
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        done = align([str(folder), "hf:user/devil"], out, tables, cache, "--workers", str(workers))
        assert done.returncode == 0, done.stderr
        runs[workers] = out
    assert tree(runs[1]) == tree(runs[2])
    rows = rows_of(runs[1])
    assert [r["row_id"] for r in rows] == [r["row_id"] for r in rows_of(runs[2])]
    assert len({r["row_id"] for r in rows}) == len(rows)
    manifest = json.loads((runs[1] / "manifest.json").read_text())
    assert manifest["totals"]["shards"] >= 8
    assert manifest["totals"]["stats"]["rejected_documents"] == {"missing_text_field": 3}  # the None text, 3 inputs
    # Each document's windows, in order, are the plain record's text: nothing lost, nothing moved.
    windows: dict[tuple[str, int], list[str]] = {}
    for row in rows:
        windows.setdefault((row["source"], row["record_index"]), []).append(row["text"])
    assert {(s, i) for s, by_index in texts.items() for i in by_index} == set(windows)
    for (source, index), parts in windows.items():
        assert "".join(parts) == texts[source][index]


def test_a_truncated_file_is_one_line_on_stderr(tmp_path, corpus, tables_for):
    folder, cache, _ = corpus
    data = (folder / "devil.jsonl.zst").read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(data[:len(data) - 50])
    done = align([str(tmp_path / "cut.jsonl.zst")], tmp_path / "out", tables_for("llama-bpe", "qwen2"), cache)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: corpus file") and "cut.jsonl.zst is truncated" in done.stderr
    assert not (tmp_path / "out" / "manifest.json").exists() and not list((tmp_path / "out").glob("part-*"))
    missing = align(["hf:user/absent"], tmp_path / "out2", tables_for("llama-bpe", "qwen2"), cache)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "hf:user/absent" in missing.stderr
