"""Corpus readers: stable identities, every bad record counted by reason, shard plans that cover
every record once, and the blank-line splitter against a line-by-line reference."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import csd_pipeline.align.corpus.files as files
from csd_pipeline.align.corpus import ReadOptions, discover, plan_shards, read_segment
from csd_pipeline.errors import CsdError

ALL = {"first": 0, "count": 1 << 60, "offset": 0}


def read_all(path, **options):
    [file] = discover([str(path)])
    return list(read_segment(file, ALL, ReadOptions(**options)))


def reference_blocks(data: bytes) -> list[tuple[int, bytes]]:
    """Blank-line blocks, line by line: maximal runs of lines holding more than ASCII whitespace."""
    out, current, offset = [], None, 0
    for line in data.split(b"\n"):
        if line.strip(b" \t\r\n\f\v"):
            current = [offset, offset + len(line)] if current is None else [current[0], offset + len(line)]
        elif current is not None:
            out.append((current[0], data[current[0]:current[1]]))
            current = None
        offset += len(line) + 1
    if current is not None:
        out.append((current[0], data[current[0]:current[1]]))
    return out


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=60).map(lambda b: bytes(b"ab \n\r\t"[x % 6] for x in b)), st.sampled_from([1, 2, 3, 7, 64]))
def test_blank_line_blocks_match_a_line_reference(data, block):
    saved = files.READ_BLOCK
    files.READ_BLOCK = block  # small reads exercise blank runs that straddle two reads
    try:
        want = reference_blocks(data)
        assert list(files.txt_blocks(io.BytesIO(data), 0)) == want
        for k, (offset, _) in enumerate(want):  # reading from any block start gives the same blocks
            handle = io.BytesIO(data)
            handle.seek(offset)
            assert list(files.txt_blocks(handle, offset)) == want[k:]
    finally:
        files.READ_BLOCK = saved


def test_txt_documents_bom_and_invalid_utf8(tmp_path):
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfHello\r\nworld\rlone \xef\xbb\xbf inside")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "nul.txt").write_bytes(b"a\x00b")
    docs = read_all(tmp_path / "bom.txt")
    assert [(d.source, d.record_index, d.text) for d in docs] == [
        (f"{tmp_path.as_posix()}/bom.txt", 0, "Hello\r\nworld\rlone \ufeff inside")]
    assert read_all(tmp_path / "bad.txt")[0].reason == "invalid_utf8"
    assert read_all(tmp_path / "nul.txt")[0].text == "a\x00b"
    split = tmp_path / "split.txt"
    split.write_bytes(b"\n\n first\r\nline\r\n\r\n  \n\xff bad block\n\nlast\n  \n")
    docs = read_all(split, split_on_blank_lines=True)
    assert [(d.record_index, d.text, d.reason) for d in docs] == [
        (0, " first\r\nline\r", None), (1, None, "invalid_utf8"), (2, "last", None)]


def test_jsonl_bad_records_are_counted_and_the_rest_kept(tmp_path):
    big = "x" * (2 << 20)
    lines = [
        json.dumps({"text": "first"}),
        '{"text": "broken',
        json.dumps({"title": "no text"}),
        json.dumps({"text": 42}),
        '{"text": "lone \\ud800 surrogate"}',
        "   ",
        json.dumps(["not", "an", "object"]),
        json.dumps({"text": big}),
        json.dumps({"text": None}),
        '{"text": "nul \\u0000 and <|endoftext|> <s>"}',
    ]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n" + b'{"text": "bad \xff byte"}')
    docs = read_all(path)
    assert [d.record_index for d in docs] == list(range(11))
    assert [d.reason for d in docs] == [None, "broken_json", "missing_text_field", "text_not_string", "lone_surrogate",
                                        "blank_line", "record_not_object", None, "missing_text_field", None, "invalid_utf8"]
    assert docs[0].text == "first" and docs[7].text == big and docs[9].text == "nul \x00 and <|endoftext|> <s>"
    assert read_all(path, text_field="title")[2].text == "no text"


def test_json_arrays_columns_and_json_lines(tmp_path):
    (tmp_path / "array.json").write_text(json.dumps([{"text": "a"}, {"other": 1}, {"text": "b"}]))
    (tmp_path / "columns.json").write_text(json.dumps({"text": ["x", "y"], "id": [1, 2]}))
    (tmp_path / "lines.json").write_text('{"text": "p"}\n{"text": broken}\n')
    assert [(d.text, d.reason) for d in read_all(tmp_path / "array.json")] == [("a", None), (None, "missing_text_field"), ("b", None)]
    assert [d.text for d in read_all(tmp_path / "columns.json")] == ["x", "y"]
    assert [(d.text, d.reason) for d in read_all(tmp_path / "lines.json")] == [("p", None), (None, "broken_json")]


def test_parquet_rows_nulls_and_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": ["one", None, "three", "four"], "n": [1, 2, 3, 4]})
    pq.write_table(table, tmp_path / "data.parquet", row_group_size=3)
    docs = read_all(tmp_path / "data.parquet")
    assert [(d.record_index, d.text, d.reason) for d in docs] == [
        (0, "one", None), (1, None, "missing_text_field"), (2, "three", None), (3, "four", None)]
    assert {d.reason for d in read_all(tmp_path / "data.parquet", text_field="body")} == {"missing_text_field"}
    assert {d.reason for d in read_all(tmp_path / "data.parquet", text_field="n")} == {"text_not_string"}
    [file] = discover([str(tmp_path / "data.parquet")])
    assert [d.text for d in read_segment(file, {"first": 2, "count": 2, "offset": -1}, ReadOptions())] == ["three", "four"]


def test_discover_walks_sorted_and_refuses_bad_paths(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("z")
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / ".hidden.txt").write_text("h")
    (tmp_path / "notes.md").write_text("skip")
    files = discover([str(tmp_path), str(tmp_path / "a.jsonl")])
    assert [f.source.rsplit("/", 2)[-2:] for f in files] == [[tmp_path.name, "a.jsonl"], ["b", "z.txt"]]
    with pytest.raises(CsdError, match="does not exist"):
        discover([str(tmp_path / "missing.txt")])
    with pytest.raises(CsdError, match="unsupported type"):
        discover([str(tmp_path / "notes.md")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CsdError, match="holds no"):
        discover([str(tmp_path / "empty")])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab \n", max_size=30), min_size=1, max_size=25), st.integers(1, 80))
def test_shard_plans_cover_every_record_once_in_order(tmp_path_factory, records, target):
    tmp = tmp_path_factory.mktemp("plan")
    (tmp / "a.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    (tmp / "b.txt").write_text("\n\n".join(records))
    files = discover([str(tmp)])
    for split in (False, True):
        options = ReadOptions(split_on_blank_lines=split)
        whole = [(d.source, d.record_index, d.text, d.reason) for f in files for d in read_segment(f, ALL, options)]
        shards = plan_shards(files, options, target)
        planned = [(d.source, d.record_index, d.text, d.reason)
                   for shard in shards for seg in shard for d in read_segment(files[seg["file"]], seg, options)]
        assert planned == whole
        assert all(shard for shard in shards)
