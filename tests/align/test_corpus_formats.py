"""Corpus formats beyond plain files: .zst / .gz files, datasets save_to_disk folders and hf:NAME from
the local datasets cache. Each is built in tmp_path from real text (tests/data slices) with zstandard,
gzip and datasets, and must read (whole, and shard by shard from any restart point) exactly as the
plain file of the same records reads. Nothing touches the network (conftest sets HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from csd_pipeline.align.corpus import MAX_SHARDS_PER_REGION, ReadOptions, discover, plan_shards, read_segment
from csd_pipeline.errors import CsdError

DATA = Path(__file__).parents[1] / "data"
WHOLE = {"first": 0, "count": 1 << 60, "offset": 0, "skip": 0}


def blocks(name: str, limit: int | None = None) -> list[str]:
    """The blank-line-separated blocks of a tests/data slice (independent of the corpus readers)."""
    text = (DATA / name).read_text(encoding="utf-8")
    return [b for b in text.split("\n\n") if b.strip()][:limit]


def awkward_jsonl(texts: list[str]) -> bytes:
    """JSON lines of `texts` with a BOM and every kind of bad record a reader must count, not lose."""
    lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts]
    bad = [b"", b'{"text": "broken', json.dumps({"title": "no text"}).encode(), b'{"text": "bad \xff byte"}',
           b"[1, 2]", json.dumps({"text": None}).encode(), b'{"text": "lone \\ud800"}']
    mixed = [lines[0]] + [x for pair in zip(bad, lines[1:]) for x in pair] + lines[1 + len(bad):]
    return b"\xef\xbb\xbf" + b"\n".join(mixed) + b"\n"


def zst(data: bytes, frame: int | None = None) -> bytes:
    """zstd of `data`, one frame (with checksum, as the zstd tool writes) or frames of `frame` bytes
    cut anywhere (mid-record), concatenated as `cat a.zst b.zst` would."""
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=True)
    if frame is None:
        return compressor.compress(data)
    return b"".join(compressor.compress(data[i:i + frame]) for i in range(0, len(data), frame))


def gz(data: bytes, member: int | None = None) -> bytes:
    if member is None:
        return gzip.compress(data, mtime=0)
    return b"".join(gzip.compress(data[i:i + member], mtime=0) for i in range(0, len(data), member))


COMPRESSIONS = {
    "zst": lambda d: ("zst", zst(d)),
    "zst-frames": lambda d: ("zst", zst(d, 700)),
    "gz": lambda d: ("gz", gz(d)),
    "gz-members": lambda d: ("gz", gz(d, 900)),
}


def documents(path, options: ReadOptions, split=None) -> list[tuple]:
    """(record_index, text, reason) of every document, read as one shard and read in small shards."""
    inputs = discover([str(path)], split)
    whole = [(d.record_index, d.text, d.reason) for shard in plan_shards(inputs, options, 1 << 40) for segment in shard
             for d in read_segment(inputs[segment["file"]], segment, options)]
    planned = [(d.record_index, d.text, d.reason) for shard in plan_shards(inputs, options, 200) for segment in shard
               for d in read_segment(inputs[segment["file"]], segment, options)]
    assert planned == whole
    return whole


@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
@pytest.mark.parametrize("kind", ["jsonl", "json-array", "json-lines", "txt-blocks", "txt-whole"])
def test_compressed_files_read_like_the_plain_file(tmp_path, kind, compression):
    texts = blocks("devil-slice.txt") + blocks("python-docs-slice.txt", 12)
    if kind == "jsonl":
        suffix, plain = ".jsonl", awkward_jsonl(texts)
    elif kind == "json-array":
        records = [{"text": t} for t in texts[:10]] + [{"title": "none"}, 7, {"text": 3}] + [{"text": t} for t in texts[10:]]
        suffix, plain = ".json", b"\xef\xbb\xbf" + json.dumps(records, indent=1, ensure_ascii=False).encode()
    elif kind == "json-lines":
        suffix, plain = ".json", awkward_jsonl(texts).replace(b"\n", b"\n\n", 3)
    elif kind == "txt-blocks":
        suffix, plain = ".txt", b"\xef\xbb\xbf" + "\n\n \n".join(texts).encode() + b"\n\n\xff\xfe bad bytes\n"
    else:
        suffix, plain = ".txt", b"\xef\xbb\xbf" + "\n\n".join(texts).encode()
    (tmp_path / f"plain{suffix}").write_bytes(plain)
    ext, packed = COMPRESSIONS[compression](plain)
    (tmp_path / f"packed{suffix}.{ext}").write_bytes(packed)
    options = ReadOptions(split_on_blank_lines=kind == "txt-blocks")
    want = documents(tmp_path / f"plain{suffix}", options)
    assert documents(tmp_path / f"packed{suffix}.{ext}", options) == want
    # The plain reading is the reference's: every text of the slices, in order, the bad records counted.
    texts_read = [text for _, text, _ in want if text is not None]
    if kind == "txt-whole":
        assert want == [(0, plain[3:].decode("utf-8"), None)]
    elif kind == "txt-blocks":
        assert len(texts_read) >= len(texts) and want[-1][2] == "invalid_utf8"
    else:
        assert texts_read == texts
        assert {r for _, _, r in want} - {None} and len(want) > len(texts)
    inputs = discover([str(tmp_path / f"packed{suffix}.{ext}")])
    if compression.endswith(("frames", "members")) and kind != "txt-whole":
        # Later shards restart at a later frame, not at the file's start.
        assert max(s["offset"] for shard in plan_shards(inputs, options, 200) for s in shard) > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.text(alphabet="ab é\n{}\"", max_size=40), min_size=1, max_size=30), st.integers(1, 200),
       st.integers(1, 120), st.sampled_from(["zst", "gz"]), st.booleans(), st.booleans())
def test_any_frame_cut_and_shard_size_reads_like_the_plain_file(tmp_path_factory, texts, frame, target, ext, split, bom):
    tmp = tmp_path_factory.mktemp("cuts")
    empty = zst(b"") if ext == "zst" else gz(b"")  # empty frames (members) are valid and hold no restart point
    for name, data in (("a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()),
                       ("b.txt", "\n\n".join(texts).encode())):
        data = b"\xef\xbb\xbf" + data if bom else data
        (tmp / name).write_bytes(data)
        frames = [zst(data[i:i + frame]) if ext == "zst" else gz(data[i:i + frame]) for i in range(0, len(data), frame)]
        frames[len(frames) // 2:len(frames) // 2] = [empty]
        (tmp / f"{name}.{ext}").write_bytes(empty + b"".join(frames))
        options = ReadOptions(split_on_blank_lines=split)
        [plain], [packed] = discover([str(tmp / name)]), discover([str(tmp / f"{name}.{ext}")])
        want = [(d.record_index, d.text, d.reason) for d in read_segment(plain, WHOLE, options)]
        got = [(d.record_index, d.text, d.reason) for shard in plan_shards([packed], options, target)
               for s in shard for d in read_segment(packed, s, options)]
        assert got == want


def test_one_frame_is_cut_into_a_bounded_number_of_shards(tmp_path):
    data = "".join(json.dumps({"text": t}) + "\n" for t in blocks("python-docs-slice.txt")).encode()
    (tmp_path / "one.jsonl.zst").write_bytes(zst(data))
    (tmp_path / "many.jsonl.zst").write_bytes(zst(data, 4096))
    (tmp_path / "plain.jsonl").write_bytes(data)
    records = data.count(b"\n")
    shards = {p.name: plan_shards(discover([str(p)]), ReadOptions(), 1) for p in tmp_path.iterdir()}
    assert len(shards["plain.jsonl"]) == records  # seekable: one record per shard at 1 byte
    assert len(shards["one.jsonl.zst"]) <= MAX_SHARDS_PER_REGION + 1 < records
    assert len(shards["many.jsonl.zst"]) > len(shards["one.jsonl.zst"])  # more frames, more restart points
    for plan in shards.values():
        assert sum(s["count"] for shard in plan for s in shard) == records


@pytest.mark.parametrize("ext", ["zst", "gz"])
def test_a_truncated_file_is_one_error_that_counts_the_records_before_the_cut(tmp_path, ext):
    data = "".join(json.dumps({"text": t}) + "\n" for t in blocks("python-docs-slice.txt")).encode()
    packed = zst(data) if ext == "zst" else gz(data)
    cut = packed[:len(packed) * 3 // 5]
    (tmp_path / f"cut.jsonl.{ext}").write_bytes(cut)
    # Reference: what the library alone decompresses from the cut file, and its complete lines.
    decoder = zstandard.ZstdDecompressor().decompressobj() if ext == "zst" else zlib.decompressobj(wbits=31)
    complete = decoder.decompress(cut).count(b"\n")
    assert complete > 0
    with pytest.raises(CsdError) as raised:
        plan_shards(discover([str(tmp_path)]), ReadOptions(), 1 << 20)
    message = str(raised.value)
    assert "\n" not in message and f"cut.jsonl.{ext} is truncated" in message
    assert f"{complete} complete records" in message and ("zstd -t" if ext == "zst" else "gzip -t") in message
    # A file cut after planning is the same error when a shard reads it.
    (tmp_path / f"cut.jsonl.{ext}").write_bytes(packed)
    [file] = discover([str(tmp_path)])
    [shard] = plan_shards([file], ReadOptions(), 1 << 40)
    (tmp_path / f"cut.jsonl.{ext}").write_bytes(cut)
    with pytest.raises(CsdError, match=f"truncated: .* {complete} complete records"):
        list(read_segment(file, shard[0], ReadOptions()))


def test_a_damaged_file_is_one_error(tmp_path):
    data = "".join(json.dumps({"text": t}) + "\n" for t in blocks("devil-slice.txt")).encode()
    packed = bytearray(zst(data))
    packed[len(packed) // 2] ^= 0xFF
    (tmp_path / "bad.jsonl.zst").write_bytes(bytes(packed))
    with pytest.raises(CsdError, match=r"bad.jsonl.zst is damaged: .*re-create or re-download it"):
        plan_shards(discover([str(tmp_path / "bad.jsonl.zst")]), ReadOptions(), 1 << 20)


def test_discover_names_compressed_files_and_refuses_others(tmp_path):
    for name in ("a.jsonl.zst", "b.JSON.gz", "c.txt.zst", "d.jsonl.gz", "e.parquet.zst", "f.zst", "g.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    found = [(Path(f.source).name, f.format, f.compression) for f in discover([str(tmp_path)])]
    assert found == [("a.jsonl.zst", "jsonl", "zst"), ("b.JSON.gz", "json", "gz"), ("c.txt.zst", "txt", "zst"),
                     ("d.jsonl.gz", "jsonl", "gz")]
    assert documents(tmp_path / "a.jsonl.zst", ReadOptions()) == []  # an empty file holds no records
    with pytest.raises(CsdError, match="unsupported type"):
        discover([str(tmp_path / "e.parquet.zst")])


# ---------------------------------------------------------------------------------------------
# datasets


def devil_records() -> list[dict]:
    texts = blocks("devil-slice.txt")
    return [{"text": t, "n": i} for i, t in enumerate(texts[:5])] + [{"text": None, "n": 5}] + \
        [{"text": t, "n": i + 6} for i, t in enumerate(texts[5:])]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def test_saved_datasets_read_like_the_plain_file(tmp_path):
    import datasets

    records = devil_records()
    want = documents(write_jsonl(tmp_path / "plain.jsonl", records), ReadOptions())
    one = datasets.Dataset.from_list(records)
    one.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": one, "test": one.select(range(2))}).save_to_disk(str(tmp_path / "dict"))
    datasets.DatasetDict({"only": one}).save_to_disk(str(tmp_path / "single"))
    assert documents(tmp_path / "one", ReadOptions()) == want
    assert documents(tmp_path / "dict", ReadOptions(), split="train") == want
    assert documents(tmp_path / "single", ReadOptions()) == want  # the only split needs no --split
    assert [f.source for f in discover([str(tmp_path / "dict")], "test")] == [f"{tmp_path.as_posix()}/dict/test"]
    assert {r for _, _, r in documents(tmp_path / "one", ReadOptions(text_field="n"))} == {"text_not_string"}
    with pytest.raises(CsdError, match=r"dict holds the splits train, test; pick one with --split"):
        discover([str(tmp_path / "dict")])
    with pytest.raises(CsdError, match=r"has no split 'validation' \(it holds train, test\)"):
        discover([str(tmp_path / "dict")], "validation")
    # Inside a folder of files a saved folder is one input (its Arrow files are not walked).
    (tmp_path / "mixed").mkdir()
    one.save_to_disk(str(tmp_path / "mixed" / "saved"))
    (tmp_path / "mixed" / "z.jsonl.zst").write_bytes(zst((tmp_path / "plain.jsonl").read_bytes()))
    inputs = discover([str(tmp_path / "mixed")])
    assert [(Path(f.source).name, f.format) for f in inputs] == [("saved", "dataset"), ("z.jsonl.zst", "jsonl")]


def build_hub_cache(cache: Path, repo: str, files: dict[str, Path], chunk_bytes: int = 1000) -> None:
    """Prepare `repo` in a datasets cache as `datasets.load_dataset(repo)` does after a download
    (CACHE/namespace___name/default/0.0.0/HASH/name-SPLIT-*.arrow), here from local jsonl files and
    in Arrow shards of a few records, so that reading restarts at later shards."""
    from datasets.packaged_modules.json.json import Json

    namespace, name = repo.split("/")
    builder = Json(cache_dir=str(cache), dataset_name=name, config_name="default", config_id="default",
                   hash="0123abcd", data_files={k: str(v) for k, v in files.items()}, chunksize=chunk_bytes)
    builder.download_and_prepare(output_dir=str(cache / f"{namespace}___{name}" / "default" / "0.0.0" / "0123abcd"),
                                 max_shard_size=chunk_bytes)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A datasets cache holding `user/devil` (splits train, test), and the plain jsonl of train."""
    import datasets

    plain = write_jsonl(tmp_path / "devil.jsonl", devil_records())
    test = write_jsonl(tmp_path / "devil-test.jsonl", devil_records()[:3])
    cache = tmp_path / "hf-cache"
    build_hub_cache(cache, "user/devil", {"train": plain, "test": test})
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache, plain


def test_a_named_dataset_reads_from_the_local_cache_offline(hub_cache, tmp_path):
    cache, plain = hub_cache
    want = documents(plain, ReadOptions())
    [named] = discover(["hf:user/devil"], "train")
    assert named.source == "hf:user/devil[train]" and named.revision == "default@0123abcd"
    assert documents("hf:user/devil", ReadOptions(), split="train") == want
    assert documents("hf:user/devil:default", ReadOptions(), split="train") == want
    assert [s["offset"] for shard in plan_shards([named], ReadOptions(), 1) for s in shard][-1] > 0  # later Arrow shards
    # A local folder of data files is streamed from its files (nothing converted).
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "folder" / "train.jsonl", devil_records())
    assert documents(f"hf:{tmp_path / 'folder'}", ReadOptions(), split="train") == want
    with pytest.raises(CsdError, match=r"hf:user/devil holds the splits train, test; pick one with --split"):
        discover(["hf:user/devil"])
    with pytest.raises(CsdError, match=r"hf:user/absent: datasets could not load it .*HF_HUB_OFFLINE=1"):
        discover(["hf:user/absent"], "train")
