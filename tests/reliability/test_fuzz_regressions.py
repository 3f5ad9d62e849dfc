"""The defects the reader fuzz tests found (tests/reliability/test_fuzz_*.py), each as its minimal example.

Before the fix each of these raised another exception type (a traceback for the user) or read a damaged
file as other values; now each is one `CsdError` line naming the file, or (a damaged completion record)
the shard is written again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csd_pipeline.errors import CsdError

SHARD = {"name": "part-00000-00000", "file": "part-00000-00000.parquet", "rows": 1, "bytes": 10, "sha256": "0" * 64}
DEEP = "[" * 5000 + "]" * 5000


def aligned_manifest(**changes) -> dict:
    manifest = {"manifest_version": 1, "stage": "align", "schema_version": 1, "shards": [dict(SHARD)],
                "config": {"mode": "text"}, "tokenizers": {"student": {}, "teachers": []}, "tables": [], "totals": {}}
    manifest.update(changes)
    return manifest


def open_aligned(folder: Path, text: str):
    from csd_pipeline.align.output import AlignedOutput

    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(text, encoding="utf-8")
    return AlignedOutput.open(folder)


@pytest.mark.parametrize("text", [
    json.dumps(aligned_manifest(config=True)),  # was AttributeError ('bool' object has no attribute 'get')
    json.dumps(aligned_manifest(shards=[{k: v for k, v in SHARD.items() if k != "bytes"}])),  # was KeyError
    json.dumps(aligned_manifest(shards=5)),  # was TypeError
    json.dumps(aligned_manifest(shards=[dict(SHARD, rows=-1)])),  # was read as a count
    json.dumps(aligned_manifest(shards=[dict(SHARD, name="")])),  # was read: a shard whose name is not its file's
    json.dumps(aligned_manifest(tokenizers={"teachers": [{"size": "x"}]})),  # was ValueError, later
    json.dumps(aligned_manifest())[:-1] + ', "config": {"mode": "chat"}}',  # duplicate key: was the last one wins
    json.dumps(aligned_manifest(totals=DEEP)).replace(json.dumps(DEEP), DEEP),  # was RecursionError
    json.dumps(aligned_manifest()).replace('"rows": 1', '"rows": ' + "9" * 5000),  # was ValueError (digit limit)
    json.dumps(aligned_manifest(tables=10**400)),  # was TypeError ('int' object is not iterable)
    json.dumps(aligned_manifest(config={"mode": ""})),  # was read as an output of mode ""
    json.dumps(aligned_manifest(schema_version=[1])),  # was TypeError (unhashable type: 'list')
    json.dumps(aligned_manifest(stage=["align"], manifest_version=2)),  # was TypeError in the error message's hint
    json.dumps(aligned_manifest(tokenizers={"teachers": [{"size": 10**400}]})),  # was read as a vocabulary size
])
def test_damaged_manifest_is_one_error_naming_it(tmp_path, text):
    with pytest.raises(CsdError, match=str(tmp_path / "aligned")) as err:
        open_aligned(tmp_path / "aligned", text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["null", DEEP, '{"tasks": [{"index": "0", "name": "a", "spec": {}}]}'])
def test_damaged_run_record_is_one_error_naming_it(tmp_path, text):
    from csd_pipeline.runtime.run_record import read_run_record

    (tmp_path / "run.json").write_text(text)  # was AttributeError, RecursionError, a task with a string index
    with pytest.raises(CsdError, match=str(tmp_path / "run.json")):
        read_run_record(tmp_path)


@pytest.mark.parametrize("change", [{"file": None}, {"stats": {"documents": "many"}}, {"rows": True}])
def test_damaged_completion_record_is_ignored_and_the_shard_written_again(tmp_path, change):
    from csd_pipeline.runtime.run_record import read_marker

    (tmp_path / "done").mkdir()
    (tmp_path / "part-00000-00000.parquet").write_bytes(b"x" * 10)
    marker = {**SHARD, "index": 0, "stats": {"documents": 1}}
    (tmp_path / "done" / "part-00000-00000.done").write_text(json.dumps(marker))
    assert read_marker(tmp_path, "part-00000-00000", ".parquet") == marker
    # was accepted as complete, then a TypeError when the manifest was built (merge_stats) or a manifest with file null
    (tmp_path / "done" / "part-00000-00000.done").write_text(json.dumps({**marker, **change}))
    assert read_marker(tmp_path, "part-00000-00000", ".parquet") is None


def table_file(tables_for, tmp_path) -> tuple[Path, bytes]:
    from csd_pipeline.vocab.tables import load_table

    path = tmp_path / "table.safetensors"
    load_table(tables_for("llama-spm", "smollm2")[0]).save(path)
    return path, path.read_bytes()


def test_flipped_table_metadata_is_refused(tables_for, tmp_path):
    from csd_pipeline.vocab.tables import load_table

    path, data = table_file(tables_for, tmp_path)
    for old, new in ((b'\\"bos\\": 1', b'\\"bos\\": 0'), (b'\\"adds_bos\\"', b'\\"adds_bot\\"')):
        assert data.count(old) >= 1, old
        path.write_bytes(data.replace(old, new, 1))  # same size: was a table with BOS id 0, or a KeyError
        with pytest.raises(CsdError, match=f"table {path}: its metadata does not match its checksum"):
            load_table(path)


def test_table_metadata_that_is_not_json_is_refused(tables_for, tmp_path):
    from csd_pipeline.vocab.tables import load_table

    path, data = table_file(tables_for, tmp_path)
    at = data.index(b'"csd_table":"{') + len(b'"csd_table":"')
    path.write_bytes(data[:at] + b"[" + data[at + 1:])  # the safetensors header stays valid: was json.JSONDecodeError
    with pytest.raises(CsdError, match=f"table {path}"):
        load_table(path)


@pytest.mark.parametrize("text", ["null", DEEP, "[1]"])
def test_damaged_tokenizer_config_is_one_error_naming_it(tokenizer_path, tmp_path, text):
    import shutil

    from csd_pipeline.vocab.tokenizer_files import open_tokenizer

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_path("llama-spm"), folder)
    (folder / "tokenizer_config.json").write_text(text)  # was AttributeError or RecursionError
    with pytest.raises(CsdError, match="tokenizer_config.json"):
        open_tokenizer(str(folder))


@pytest.mark.parametrize("text", [DEEP, "[]", '{"version": 1, "version": 2}'])
def test_damaged_checkpoint_complete_json_is_one_error_naming_it(tmp_path, text):
    from trainer import checkpoint

    (tmp_path / checkpoint.COMPLETE_FILE).write_text(text)  # was RecursionError (a list or a repeated key: now refused)
    with pytest.raises(CsdError, match=f"checkpoint {tmp_path} is unreadable"):
        checkpoint.read_complete(tmp_path)


@pytest.mark.parametrize("text", [json.dumps({"chat_template": "x"}).replace('"x"', DEEP),
                                  json.dumps({"chat_template": [{"name": ["default"], "template": "x"}]})])
def test_damaged_template_config_is_one_error_naming_it(tmp_path, text):
    from csd_pipeline.align.templates import load_chat_template

    path = tmp_path / "tokenizer_config.json"
    path.write_text(text)  # was RecursionError; TypeError (a list as a template name)
    with pytest.raises(CsdError, match=str(path)):
        load_chat_template(None, str(path), "student")


@pytest.mark.parametrize("config", [{"top_k": [8]}, {"keep": 5}, {"teacher_index": -1}, [], {"top_p": 10**400},
                                    {"top_p": 2}])
def test_damaged_teacher_manifest_config_is_one_error_naming_it(tmp_path, config):
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    manifest = {"manifest_version": 1, "stage": "teacher-logits", "schema_version": 2, "shards": [dict(SHARD)],
                "config": config, "totals": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    # was opened, then a TypeError (or a negative teacher index) when csd-train read the value
    with pytest.raises(CsdError, match=str(tmp_path / "manifest.json")):
        TeacherTopkOutput.open(tmp_path)


def test_teacher_manifest_whose_aligned_record_is_not_an_object_is_refused(tmp_path):
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    manifest = {"manifest_version": 1, "stage": "teacher-logits", "schema_version": 2, "shards": [dict(SHARD)],
                "config": {}, "aligned": True, "totals": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))  # was AttributeError in check_pairs_with
    with pytest.raises(CsdError, match=str(tmp_path / "manifest.json")):
        TeacherTopkOutput.open(tmp_path)


def test_tokenizer_json_with_an_added_token_without_content_is_refused(tokenizer_path, tmp_path, monkeypatch):
    import shutil

    from csd_pipeline.vocab.vocabulary import load_tokenizer

    monkeypatch.setenv("CSD_VOCAB_CACHE", "off")
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_path("llama-spm"), folder)
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    (folder / "tokenizer.json").write_text(text.replace('"content"', '"contenu"', 1), encoding="utf-8")
    with pytest.raises(CsdError, match="tokenizer.json is malformed"):  # was KeyError: 'content'
        load_tokenizer(str(folder))


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_corpus_nested_too_deeply_is_a_broken_record(tmp_path, suffix):
    from csd_pipeline.align.corpus import ReadOptions, discover, plan_shards, read_segment

    path = tmp_path / f"corpus{suffix}"
    path.write_text('{"text": "a"}\n' + DEEP + "\n")  # was RecursionError
    files, options = discover([str(path)]), ReadOptions()
    segments = [segment for shard in plan_shards(files, options, 1000) for segment in shard]
    reasons = [d.reason for segment in segments for d in read_segment(files[segment["file"]], segment, options)]
    assert reasons == [None, "broken_json"]


@pytest.fixture(scope="module")
def teacher_shard(tiny_teacher, tmp_path_factory):
    """(folder, shard file) of the tiny teacher's top-k (k=8) of the devil slice."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.trainer_cases import DATA, align

    root = tmp_path_factory.mktemp("regression-teacher")
    aligned = align([DATA / "devil-slice.txt"], root / "aligned")
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(tiny_teacher), output=str(root / "t"),
                                           top_k=8, batch_tokens=512, device="cpu"), log=None)
    return root / "t", json.loads((root / "t" / "manifest.json").read_text())["shards"][0]["file"]


def rewritten(teacher_shard, tmp_path, change) -> tuple[Path, str]:
    """A copy of the teacher shard rewritten (one row group, as a one-block shard is) after `change(table)`."""
    import shutil

    import pyarrow.parquet as pq

    folder, file = teacher_shard
    shutil.copytree(folder, tmp_path / "t")
    table = change(pq.read_table(tmp_path / "t" / file))
    pq.write_table(table, tmp_path / "t" / file, row_group_size=len(table), store_schema=True)
    return tmp_path / "t", file


def test_undecodable_block_of_an_unchecked_teacher_shard_names_the_shard(teacher_shard, tmp_path):
    import pyarrow as pa

    from csd_pipeline.teacher.store.reader import read_teacher_shard

    def cut(table):
        payload = table.column("payload").to_pylist()
        payload[0] = payload[0][:-1]  # a payload cut short, in a file whose page checksums agree with it
        return table.set_column(table.schema.get_field_index("payload"), "payload", pa.array(payload, pa.binary()))

    folder, file = rewritten(teacher_shard, tmp_path, cut)
    with pytest.raises(CsdError, match=f"teacher shard {folder / file}, block 0"):  # was: no file named
        list(read_teacher_shard(folder, file))


@pytest.mark.parametrize("key, value", [(b"csd.schema_version", b"\xff"), (b"csd.k", b"x"), (b"csd.top_p", b"?")])
def test_damaged_teacher_shard_schema_metadata_names_the_shard(teacher_shard, tmp_path, key, value):
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    def damage(table):
        return table.replace_schema_metadata({**table.schema.metadata, key: value})

    folder, file = rewritten(teacher_shard, tmp_path, damage)
    with pytest.raises(CsdError, match=f"teacher shard {folder / file}"):  # was UnicodeDecodeError, ValueError
        read_teacher_shard(folder, file)


def test_teacher_shard_with_a_row_id_that_is_not_utf8_names_the_shard(teacher_shard, tmp_path):
    import pyarrow as pa

    from csd_pipeline.teacher.store.reader import read_teacher_shard

    def damage(table):  # what a flipped byte in an unchecked page of row ids reads as
        ids = pa.array([b"\xff" + r.encode() for r in table.column("row_id").to_pylist()], pa.binary())
        return table.set_column(table.schema.get_field_index("row_id"), pa.field("row_id", pa.string()),
                                ids.cast(pa.string(), safe=False))

    folder, file = rewritten(teacher_shard, tmp_path, damage)
    with pytest.raises(CsdError, match=f"teacher top-k shard {folder / file} is damaged"):  # was UnicodeDecodeError
        read_teacher_shard(folder, file)


def test_teacher_shard_with_negative_positions_names_the_shard(teacher_shard, tmp_path):
    import pyarrow as pa
    import pyarrow.compute as pc

    from csd_pipeline.teacher.store.reader import read_teacher_shard

    def damage(table):  # what a flipped sign bit in an unchecked page of positions reads as
        index = table.schema.get_field_index("positions")
        return table.set_column(index, "positions", pc.negate(table.column("positions")).cast(pa.int32()))

    folder, file = rewritten(teacher_shard, tmp_path, damage)
    with pytest.raises(CsdError, match=f"teacher shard {folder / file}, block 0"):  # was ValueError (np.ones)
        list(read_teacher_shard(folder, file))


def test_flips_found_by_the_random_hunt_are_one_line(teacher_shard, tmp_path):
    """Two flips CSD_FUZZ_RANDOM=1 found (the outputs are the same bytes on every run): an aligned shard read with
    page checksums alone raised ArrowNotImplementedError; a teacher shard's footer error was several lines."""
    import shutil

    from csd_pipeline.runtime.integrity import read_verified_table
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    folder, file = teacher_shard
    aligned = folder.parent / "aligned"
    aligned_file = json.loads((aligned / "manifest.json").read_text())["shards"][0]["file"]
    cases = [(aligned / aligned_file, 8441, lambda path: read_verified_table(path, None, None)),
             (folder / file, 12552, lambda path: read_teacher_shard(path.parent, path.name))]
    for source, position, read in cases:
        path = tmp_path / source.parent.name / source.name
        path.parent.mkdir(exist_ok=True)
        shutil.copy(source, path)
        data = bytearray(path.read_bytes())
        data[position % len(data)] ^= 1
        path.write_bytes(bytes(data))
        try:
            read(path)
        except CsdError as err:
            assert "\n" not in str(err) and str(path) in str(err), str(err)
