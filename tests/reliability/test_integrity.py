"""Training verifies what it reads, and paths stay inside their output (issue 16, items 2 and 3).

- Aligned shards: the loader hashes each shard's bytes as it reads them (sha256 against the
  manifest) and verifies Parquet page checksums, so no flipped byte trains silently.
- Teacher top-k shards: page checksums on every block read; a shard written before they existed is
  hashed when opened.
- The aligned and teacher manifests are checked against their files and each other before training:
  an edited `rows` or a swapped table names the stage to re-run.
- A manifest, run record or checkpoint index that names a file outside its folder is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_KEY, has_page_checksums, read_verified_table
from trainer.options import parse_args

FLIPS = 24


@pytest.fixture(scope="module")
def pipeline(trainer_data, tiny_teacher, tmp_path_factory):
    """{"aligned", "teacher"}: the devil slice aligned (llama-spm / smollm2) and its tiny-teacher top-k (k=8)."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits

    root = tmp_path_factory.mktemp("pipeline")
    aligned = root / "aligned"
    shutil.copytree(trainer_data["eval"], aligned)
    teacher = root / "teacher"
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(tiny_teacher), output=str(teacher),
                                           top_k=8, batch_tokens=512, device="cpu"), log=None)
    return {"aligned": aligned, "teacher": teacher}


@pytest.fixture
def copy(pipeline, tmp_path):
    """A private copy of the pipeline outputs (the teacher manifest keeps pointing at the copied aligned dir)."""
    out = {}
    for key, folder in pipeline.items():
        out[key] = tmp_path / key
        shutil.copytree(folder, out[key])
    return out


def config(trainer_data, aligned, *extra):
    return parse_args(["--aligned", str(aligned), "--student-config", str(trainer_data["student_config"]),
                       "--student-tokenizer", "llama-spm", "--output", "unused", "--seq-len", "128",
                       "--batch-size", "2", "--workers", "0", "--no-progress", *map(str, extra)])


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def edit_manifest(folder: Path, change) -> None:
    data = manifest(folder)
    change(data)
    (folder / "manifest.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def column_range(path: Path, column: str) -> tuple[int, int]:
    """[start, end) of a column chunk's pages (row group 0) in a Parquet file."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    for i in range(meta.num_columns):
        chunk = meta.column(i)
        if chunk.path_in_schema.split(".")[0] == column:
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            return start, start + chunk.total_compressed_size
    raise KeyError(column)


def flipped(data: bytes, position: int, bit: int) -> bytes:
    out = bytearray(data)
    out[position] ^= 1 << bit
    return bytes(out)


def one_epoch(data) -> None:
    """Stream every window of epoch 0 through the real loader (workers 0)."""
    loader = data.loader(0, 1, None)
    try:
        while next(loader).state["epoch"] == 0:
            pass
    finally:
        loader.close()


# ---------------------------------------------------------------------------------------------
# Aligned shards


def test_writers_mark_their_page_checksums(pipeline):
    for key in ("aligned", "teacher"):
        for shard in manifest(pipeline[key])["shards"]:
            assert has_page_checksums(pq.ParquetFile(pipeline[key] / shard["file"])), (key, shard["file"])


def test_flipped_bytes_in_an_aligned_shard_never_train(trainer_data, copy):
    from trainer.data import TrainingData

    data = TrainingData.open(config(trainer_data, copy["aligned"], "--loss", "ce"))
    one_epoch(data)  # the untouched shards train
    shard = copy["aligned"] / manifest(copy["aligned"])["shards"][1]["file"]
    original = shard.read_bytes()
    rng = random.Random(16)
    start, end = column_range(shard, "student_loss_mask")
    positions = [rng.randrange(start, end) for _ in range(FLIPS // 2)]       # the mask's pages
    positions += [rng.randrange(0, len(original)) for _ in range(FLIPS // 2)]  # anywhere in the file
    for position in positions:
        shard.write_bytes(flipped(original, position, rng.randrange(8)))
        with pytest.raises(CsdError) as err:
            one_epoch(data)
        message = str(err.value)
        assert f"aligned shard {shard} is damaged" in message and "\n" not in message, (position, message)
        assert "re-run the same `csd-pipeline align`" in message
    shard.write_bytes(original)
    one_epoch(data)


def test_page_checksums_alone_leave_no_flip_silent(pipeline):
    """Readers without a recorded hash: a flip in any column's pages fails or decodes to the same values."""
    shard = pipeline["aligned"] / manifest(pipeline["aligned"])["shards"][0]["file"]
    original = shard.read_bytes()
    reference = pq.read_table(shard)
    rng = random.Random(7)
    outcomes = {"refused": 0, "same values": 0}
    for column in ("student_ids", "student_loss_mask", "teacher0_ids", "teacher0_chunk_status", "text"):
        start, end = column_range(shard, column)
        for _ in range(12):
            damaged = flipped(original, rng.randrange(start, end), rng.randrange(8))
            try:
                table = read_verified_table_bytes(damaged)
            except CsdError:
                outcomes["refused"] += 1
                continue
            assert table.equals(reference), "a flipped byte decoded to other values"
            outcomes["same values"] += 1
    assert outcomes["refused"] >= 50, outcomes


def read_verified_table_bytes(data: bytes):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".parquet") as handle:
        handle.write(data)
        handle.flush()
        return read_verified_table(handle.name, None, None)


def rewrite_without_page_checksums(folder: Path, index: int) -> Path:
    """Turn shard `index` into one written before page checksums (same values), fixing the manifest."""
    entry = manifest(folder)["shards"][index]
    path = folder / entry["file"]
    table = pq.read_table(path)
    metadata = {k: v for k, v in table.schema.metadata.items() if k != PAGE_CHECKSUM_KEY}
    pq.write_table(table.replace_schema_metadata(metadata), path, compression="zstd", write_statistics=False,
                   store_schema=True, row_group_size=1024)
    from csd_pipeline.runtime.files import file_sha256

    def change(data):
        data["shards"][index].update(bytes=path.stat().st_size, sha256=file_sha256(path))
    edit_manifest(folder, change)
    return path


def test_old_aligned_shard_without_page_checksums_loads_and_is_protected_by_its_sha256(trainer_data, tmp_path):
    from trainer.data import TrainingData

    aligned = tmp_path / "aligned"
    shutil.copytree(trainer_data["eval"], aligned)
    shard = rewrite_without_page_checksums(aligned, 0)
    assert not has_page_checksums(pq.ParquetFile(shard))
    data = TrainingData.open(config(trainer_data, aligned, "--loss", "ce"))
    one_epoch(data)  # it loads
    original, reference = shard.read_bytes(), pq.read_table(shard)
    start, end = column_range(shard, "student_loss_mask")
    rng = random.Random(3)
    silent = 0
    for _ in range(FLIPS):
        shard.write_bytes(flipped(original, rng.randrange(start, end), rng.randrange(8)))
        try:  # what the loader read before: plain Parquet, no checksum, no hash
            silent += not pq.read_table(shard).equals(reference)
        except (OSError, pa.ArrowInvalid):
            pass
        with pytest.raises(CsdError, match="its sha256 is not the one its manifest records"):
            one_epoch(data)
    assert silent > 0, "no flip decoded to other values: this test would not show the hash is needed"


# ---------------------------------------------------------------------------------------------
# Teacher top-k shards


def test_flipped_bytes_in_a_teacher_payload_are_refused(pipeline, tmp_path):
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    entry = manifest(pipeline["teacher"])["shards"][0]
    source = pipeline["teacher"] / entry["file"]
    original = source.read_bytes()
    reference = [(r.ids.copy(), r.logprobs.copy()) for r in read_teacher_shard(pipeline["teacher"], entry["file"])]
    start, end = column_range(source, "payload")
    folder = tmp_path / "teacher"
    folder.mkdir()
    rng = random.Random(5)
    refused = 0
    for _ in range(FLIPS):
        (folder / entry["file"]).write_bytes(flipped(original, rng.randrange(start, end), rng.randrange(8)))
        try:
            rows = [(r.ids, r.logprobs) for r in read_teacher_shard(folder, entry["file"], sha256=entry["sha256"])]
        except CsdError as err:
            assert "teacher top-k shard" in str(err) and "damaged" in str(err), str(err)
            refused += 1
            continue
        assert all(np.array_equal(a, c) and np.array_equal(b, d) for (a, b), (c, d) in zip(rows, reference)), \
            "a flipped byte decoded to other teacher values"
    assert refused >= FLIPS - 2


def test_old_teacher_shard_without_page_checksums_is_hashed_when_opened(copy):
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    path = rewrite_without_page_checksums(copy["teacher"], 0)
    entry = manifest(copy["teacher"])["shards"][0]
    assert len(read_teacher_shard(copy["teacher"], entry["file"], sha256=entry["sha256"])) == entry["rows"]
    data = path.read_bytes()
    start, end = column_range(path, "payload")
    path.write_bytes(flipped(data, (start + end) // 2, 0))
    with pytest.raises(CsdError, match="its sha256 is not the one its manifest records"):
        read_teacher_shard(copy["teacher"], entry["file"], sha256=entry["sha256"])


# ---------------------------------------------------------------------------------------------
# Manifests checked against their files and each other, before training


def open_csd(trainer_data, copy, *extra):
    from trainer.data import TrainingData

    return TrainingData.open(config(trainer_data, copy["aligned"], "--teacher-logits", copy["teacher"], *extra))


def test_consistent_outputs_open(trainer_data, copy):
    data = open_csd(trainer_data, copy)
    assert [t.index for t in data.teachers] == [0]


def test_swapped_tables_name_align_before_training(trainer_data, copy):
    folder = copy["aligned"] / "tables" / "teacher0"
    s2t, t2s = folder / "student_to_teacher.safetensors", folder / "teacher_to_student.safetensors"
    s2t.rename(folder / "swap")
    t2s.rename(s2t)
    (folder / "swap").rename(t2s)
    with pytest.raises(CsdError, match=r"is not the student->teacher table .*re-run `csd-pipeline align`"):
        open_csd(trainer_data, copy)


def test_edited_aligned_rows_name_align(trainer_data, copy):
    edit_manifest(copy["aligned"], lambda m: m["shards"][1].update(rows=m["shards"][1]["rows"] - 1))
    with pytest.raises(CsdError) as err:
        open_csd(trainer_data, copy)
    message = str(err.value)
    assert "aligned directory" in message and "the file has" in message, message
    assert f"csd-pipeline status {copy['aligned']} --finalize" in message and "csd-pipeline align" in message
    # the documented fix restores the manifest byte for byte
    from csd_pipeline.runtime.run_record import finalize

    finalize(copy["aligned"], log=lambda message: None)
    open_csd(trainer_data, copy)


def test_edited_teacher_rows_name_teacher_logits(trainer_data, copy):
    edit_manifest(copy["teacher"], lambda m: m["shards"][0].update(rows=m["shards"][0]["rows"] + 1))
    with pytest.raises(CsdError, match=r"teacher top-k directory .*the file has .*csd-pipeline teacher-logits"):
        open_csd(trainer_data, copy)


def test_teacher_top_k_above_the_stored_entries_is_refused(trainer_data, copy):
    with pytest.raises(CsdError, match=r"--teacher-top-k 1000 is more than the 8 entries per position stored"):
        open_csd(trainer_data, copy, "--teacher-top-k", "1000")
    open_csd(trainer_data, copy, "--teacher-top-k", "8")


# ---------------------------------------------------------------------------------------------
# Paths stay inside their output (item 3)


@pytest.mark.parametrize("name", ["../../elsewhere.parquet", "/etc/hostname", "link.parquet"])
def test_shard_file_outside_the_output_is_refused(trainer_data, copy, tmp_path, name):
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from trainer.data import TrainingData

    outside = tmp_path / "elsewhere.parquet"
    first = manifest(copy["aligned"])["shards"][0]["file"]
    shutil.copy(copy["aligned"] / first, outside)
    if name == "link.parquet":
        os.symlink(outside, copy["aligned"] / name)
    edit_manifest(copy["aligned"], lambda m: m["shards"][0].update(file=name))
    expected = "an absolute path" if name.startswith("/") else "which leads outside"
    with pytest.raises(CsdError, match=f"names a shard file '{name}', {expected}") as err:
        run_teacher_logits(TeacherLogitsConfig(aligned=str(copy["aligned"]), teacher="unused",
                                               output=str(tmp_path / "topk"), device="cpu"), log=None)
    assert "\n" not in str(err.value)
    with pytest.raises(CsdError, match="refused"):
        TrainingData.open(config(trainer_data, copy["aligned"], "--loss", "ce"))
    assert not (tmp_path / "topk").exists()


def test_table_outside_the_output_is_refused(trainer_data, copy):
    from trainer.data import TrainingData

    edit_manifest(copy["aligned"], lambda m: m["tables"][0].update(student_to_teacher="../../s2t.safetensors"))
    with pytest.raises(CsdError, match="names a table '../../s2t.safetensors', which leads outside"):
        TrainingData.open(config(trainer_data, copy["aligned"], "--loss", "ce"))


@pytest.mark.parametrize("edit", ["corpus path", "shard name"])
def test_align_run_record_naming_another_file_is_refused(tmp_path, edit, tables_for):
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.stage import run_align
    from tests.reliability.cases import CORPUS

    out = tmp_path / "aligned"
    options = dict(corpus=[str(CORPUS)], student_tokenizer="llama-spm", teacher_tokenizers=["smollm2"],
                   output=str(out), max_student_tokens=128, split_on_blank_lines=True, shard_bytes=2000,
                   tables=[tables_for("llama-spm", "smollm2")])
    run_align(AlignConfig(**options))
    record = json.loads((out / "run.json").read_text())
    os.unlink(out / "done" / f"{record['tasks'][0]['name']}.done")
    if edit == "corpus path":
        record["tasks"][0]["spec"]["segments"][0]["path"] = "/etc/hostname"
        expected = r"read '/etc/hostname', which is not one of the --corpus files"
    else:
        record["tasks"][0]["name"] = "../../written-outside"
        expected = r"names a shard '../../written-outside.parquet', which leads outside"
    (out / "run.json").write_text(json.dumps(record))
    with pytest.raises(CsdError, match=expected):
        run_align(AlignConfig(**options))
    assert not (tmp_path.parent / "written-outside.parquet").exists()
