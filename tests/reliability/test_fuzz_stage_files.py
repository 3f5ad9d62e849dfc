"""Every reader of a stage output fuzzed (issue 35, item 2): manifests, run records, completion records,
aligned shards and teacher top-k shards (and the payload codec). The harness and its rules:
tests/reliability/fuzz_cases.py. The regression tests of the defects found are in test_fuzz_regressions.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from csd_pipeline.align.output import AlignedOutput
from csd_pipeline.errors import CsdError
from tests.reliability import fuzz_cases as fc

DATA = Path(__file__).parents[1] / "data"
REASONS = {  # the first that matches names the refusal in the counts
    "not readable JSON": r"not a readable JSON|is unreadable \(",
    "another run recorded": r"holds the output of another|started by another version",
    "path outside the folder": r"leads outside|an absolute path|not a file name inside|sub-folder|not one of the --corpus",
    "not a manifest, another stage or version": r"not a csd-pipeline manifest|manifest version|is the output of stage|"
                                                r"schema version \S+, which",
    "malformed (wrong type or value)": r"is malformed",
    "sha256 differs from the manifest": r"sha256",
    "size or rows differ from the manifest": r"has \d+ bytes, the manifest|rows|is missing$",
    "not a teacher shard / unknown encoding": r"not a teacher top-k shard|has schema version|not an encoding",
    "damaged shard (page checksum, footer, decode)": r"is damaged|corrupt|unreadable|is missing or unreadable",
    "table mismatch": r"table",
    "teacher index out of range (csd-train's check)": r"is teacher \d+;",
}


@pytest.fixture(scope="module")
def outputs(tiny_teacher, tmp_path_factory):
    """{"aligned", "teacher"}: the devil slice aligned (llama-spm / smollm2, 3 shards), its tiny-teacher top-k (k=8)."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.trainer_cases import align

    root = tmp_path_factory.mktemp("fuzz-outputs")
    aligned = align([DATA / "devil-slice.txt"], root / "aligned")
    teacher = root / "teacher"
    run_teacher_logits(TeacherLogitsConfig(aligned=str(aligned), teacher=str(tiny_teacher), output=str(teacher),
                                           top_k=8, batch_tokens=512, device="cpu"), log=None)
    return {"aligned": aligned, "teacher": teacher}


class Mutated:
    """Puts mutated bytes in place of `path` for one example, then the original back."""

    def __init__(self, path: Path):
        self.path, self.original = path, path.read_bytes()

    def __call__(self, data: bytes):
        self.path.write_bytes(data)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.path.write_bytes(self.original)


def aligned_values(out: AlignedOutput):
    """What the later stages take from an aligned output: checked shards, their rows, the tables (checked against
    the recorded tokenizer fingerprints), the row layout. Not compared: values a manifest records for a check
    or a report only (max_student_tokens, inputs, totals), which its JSON has no checksum to protect."""
    out.verify()
    columns = AlignedOutput.training_columns([0])
    rows = [out.read(shard, columns).to_pydict() for shard in out.shards]
    teacher = out.teacher_tokenizer(0)  # its name is for reports
    return (out.shards, out.mode, out.context_token, out.num_teachers, teacher.fingerprint, teacher.size,
            out.tables(0), rows)


def teacher_values(out, aligned: AlignedOutput):
    """What csd-train takes from a teacher output: its checked shards and their rows, the config it reads (not
    top_k, top_p, min_p: recorded for a check and reports; the rows carry their own entry counts)."""
    out.verify()
    out.check_pairs_with(aligned)
    if out.teacher_index >= aligned.num_teachers:  # what csd-train checks (trainer/data.py)
        raise CsdError(f"--teacher-logits {out.directory} is teacher {out.teacher_index}; {aligned.num_teachers} aligned")
    return (out.shard_files, out.tail_samples, out.keep, out.teacher_index,
            [teacher_rows(out.shard(i)) for i in range(len(out.shard_files))])


@pytest.mark.parametrize("settings", fc.SPEEDS)
@pytest.mark.parametrize("stage", ["aligned", "teacher"])
def test_fuzz_manifest(outputs, settings, stage):
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    folder = outputs[stage]
    target = Mutated(folder / "manifest.json")
    if stage == "aligned":
        reader, values = AlignedOutput, aligned_values
    else:
        aligned = AlignedOutput.open(outputs["aligned"])
        reader, values = TeacherTopkOutput, lambda out: teacher_values(out, aligned)
    expected = values(reader.open(folder))
    outcomes = fc.Outcomes(f"stage manifest ({stage} manifest.json, {reader.__name__}.open)", REASONS)

    def example(kind, data):
        with target(data):
            outcomes.check(lambda: reader.open(folder), (str(folder),), expected, values, kind)

    fc.run(settings, outcomes, target.original, fc.json_file_mutations, example)


# ---------------------------------------------------------------------------------------------
# run.json


def run_record_values(folder: Path, record: dict):
    from csd_pipeline.runtime.executor import ShardTask
    from csd_pipeline.runtime.run_record import record_run, recorded_tasks
    from csd_pipeline.runtime.safe_paths import check_recorded_tasks

    def read():
        record_run(folder, record)  # a re-run checks the recorded run is this one
        tasks = [ShardTask.from_json(task) for task in recorded_tasks(folder)]
        check_recorded_tasks(tasks, {str(DATA / "devil-slice.txt")}, folder)
        return [task.to_json() for task in tasks]
    return read


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_run_record(outputs, settings, tmp_path):
    folder = tmp_path / "aligned"
    shutil.copytree(outputs["aligned"], folder)
    target = Mutated(folder / "run.json")
    record = json.loads(target.original)
    for task in record["tasks"]:  # the copy's corpus is the same file
        for segment in task["spec"].get("segments") or []:
            assert segment["path"] == str(DATA / "devil-slice.txt")
    expected = run_record_values(folder, record)()
    outcomes = fc.Outcomes("run record (run.json: record_run, recorded_tasks)", REASONS)

    def example(kind, data):
        with target(data):
            outcomes.check(run_record_values(folder, record), (str(folder),), expected, mutation=kind)

    fc.run(settings, outcomes, target.original, fc.json_file_mutations, example)


# ---------------------------------------------------------------------------------------------
# Completion records (done/*.done)


def marker_outcome(marker, expected) -> str | None:
    """A damaged record is ignored (the shard is written again); a changed count or hash reaches the manifest
    and is refused when the shard is read (footer rows, sha256); changed stats are counts of a report only."""
    if marker is None:
        return "ignored: the shard is written again"
    differ = {key for key in {*marker, *expected} if marker.get(key) != expected.get(key)}
    if differ <= {"stats", "index"}:
        return "read: stats or index changed (not read into the manifest; not protected)"
    if differ <= {"rows", "sha256", "stats"}:
        return "read: rows or sha256 changed (refused when the shard is read)"
    return None


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_marker(outputs, settings):
    from csd_pipeline.runtime.run_record import read_marker

    folder = outputs["aligned"]
    name = json.loads((folder / "manifest.json").read_text())["shards"][0]["name"]
    target = Mutated(folder / "done" / f"{name}.done")
    expected = read_marker(folder, name, ".parquet")
    outcomes = fc.Outcomes("completion record (done/NAME.done, read_marker)", REASONS)

    def example(kind, data):
        with target(data):
            outcomes.check(lambda: read_marker(folder, name, ".parquet"), (name,), expected, mutation=kind,
                           other_ok=lambda marker: marker_outcome(marker, expected))

    fc.run(settings, outcomes, target.original, fc.json_file_mutations, example)


# ---------------------------------------------------------------------------------------------
# Aligned shards (Parquet)


def table_values(table):
    try:
        return table.to_pydict()
    except UnicodeDecodeError:
        return "strings that do not decode"


def touches_footer(original: bytes, data: bytes) -> bool:
    """Whether a byte of the Parquet footer (its length is in the last 8 bytes) differs, the size unchanged."""
    import struct

    start = len(original) - 8 - struct.unpack("<I", original[-8:-4])[0]
    return len(data) == len(original) and original[start:] != data[start:]


def footer_outcome(table) -> str:
    """Read without the manifest's sha256, a flip in the footer (schema, statistics), which page checksums do not
    cover, can give other values; every reader of aligned shards for training passes the sha256."""
    return "read without the sha256: other values (a footer byte changed; page checksums cover pages only)"


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_aligned_shard(outputs, settings):
    from csd_pipeline.runtime.integrity import read_verified_table

    out = AlignedOutput.open(outputs["aligned"])
    shard = out.shards[0]
    target = Mutated(out.shard_path(shard))
    expected = out.read(shard, AlignedOutput.training_columns([0])).to_pydict()
    outcomes = fc.Outcomes("aligned shard (Parquet: AlignedOutput.read; and page checksums alone)", REASONS)

    def example(kind, data, hashed):
        columns = AlignedOutput.training_columns([0])
        # hashed: through the manifest's sha256; else page checksums alone (a reader without a recorded hash)
        read = (lambda: out.read(shard, columns)) if hashed else (
            lambda: read_verified_table(target.path, None, columns))
        with target(data):
            outcomes.check(read, (str(target.path),), expected, table_values,
                           f"{kind} ({'sha256' if hashed else 'page checksums'})",
                           other_ok=None if hashed or not touches_footer(target.original, data) else footer_outcome)

    fc.run(settings, outcomes, target.original, fc.byte_mutations, example, hashed=st.booleans())


# ---------------------------------------------------------------------------------------------
# Teacher top-k shards (Parquet + the payload codec)


def teacher_rows(shard) -> list:
    return [(row.row_id, row.status, row.ids.tolist(), row.logprobs.tolist(),
             np.nan_to_num(row.observed_logprob, nan=99.0).tolist(),
             None if row.lengths is None else row.lengths.tolist()) for row in shard]


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_teacher_shard(outputs, settings):
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    out = TeacherTopkOutput.open(outputs["teacher"])
    path = out.directory / out.manifest["shards"][0]["file"]
    target = Mutated(path)
    expected = teacher_rows(out.shard(0))
    outcomes = fc.Outcomes("teacher top-k shard (Parquet: TeacherTopkOutput.shard, every row decoded)", REASONS)

    def example(kind, data):
        with target(data):
            outcomes.check(lambda: out.shard(0), (str(path),), expected, teacher_rows, kind)

    fc.run(settings, outcomes, target.original, fc.byte_mutations, example)


def test_teacher_shard_with_a_row_group_of_no_rows_is_one_line(outputs, tmp_path):
    """Found by test_fuzz_teacher_shard after the merges of 2026-12-03: bit 0 of byte 281 flipped gave a row group
    whose payload column read empty, and the reader raised IndexError instead of naming the shard."""
    import shutil

    from csd_pipeline.errors import CsdError
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    folder = tmp_path / "teacher"
    shutil.copytree(outputs["teacher"], folder)
    out = TeacherTopkOutput.open(folder)
    path = out.directory / out.manifest["shards"][0]["file"]
    expected = teacher_rows(out.shard(0))
    data = bytearray(path.read_bytes())
    data[281] ^= 1
    path.write_bytes(bytes(data))
    try:
        rows = teacher_rows(out.shard(0))
    except CsdError as err:
        assert "\n" not in str(err) and str(path) in str(err), str(err)
    else:
        assert rows == expected


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_codec(outputs, settings):
    """The payload codec alone, on payloads that passed no checksum: refused, or decoded in bounded time and
    memory (raw LZMA streams carry no checksum of their own; page checksums guard the payload in a shard)."""
    import pyarrow.parquet as pq

    from csd_pipeline.teacher.store.codec import decode_block
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput

    out = TeacherTopkOutput.open(outputs["teacher"])
    shard = out.shard(0)
    payload = pq.ParquetFile(shard.path).read_row_group(0, columns=["payload"]).column("payload")[0].as_py()
    first, last = shard._block_rows[0]
    ok = shard.status[first:last] == 0
    lengths = shard.positions[first:last][ok]
    mask = np.ones(int(lengths.sum()), dtype=bool)
    mask[np.cumsum(lengths) - 1] = False
    values = lambda decoded: [np.nan_to_num(part, nan=99.0).tolist() for part in decoded]  # noqa: E731
    expected = values(decode_block(payload, mask))
    outcomes = fc.Outcomes("teacher payload codec (decode_block, no checksum in front)", REASONS)

    def example(kind, data):
        outcomes.check(lambda: decode_block(data, mask), ("block", "payload", "teacher"), expected, values, kind,
                       other_ok=lambda decoded: "decoded to other values (unprotected without page checksums)")

    fc.run(settings, outcomes, payload, fc.byte_mutations, example)


@pytest.mark.parametrize("settings", fc.SPEEDS)
def test_fuzz_old_teacher_shard(outputs, settings, tmp_path):
    """A shard written before page checksums, read without its manifest's hash (`read_teacher_shard(DIR, FILE)`):
    nothing can tell a flipped payload byte from the teacher's values, but every read ends in a refusal naming
    the shard or in rows, never in another exception."""
    import pyarrow.parquet as pq

    from csd_pipeline.runtime.integrity import PAGE_CHECKSUM_KEY
    from csd_pipeline.teacher.store.reader import read_teacher_shard

    folder = tmp_path / "teacher"
    shutil.copytree(outputs["teacher"], folder)
    file = json.loads((folder / "manifest.json").read_text())["shards"][0]["file"]
    table = pq.read_table(folder / file)
    metadata = {k: v for k, v in table.schema.metadata.items() if k != PAGE_CHECKSUM_KEY}
    pq.write_table(table.replace_schema_metadata(metadata), folder / file, compression="zstd", store_schema=True,
                   write_statistics=False, row_group_size=1024)
    target = Mutated(folder / file)
    expected = teacher_rows(read_teacher_shard(folder, file))
    outcomes = fc.Outcomes("teacher top-k shard without page checksums, read without a hash", REASONS)

    def example(kind, data):
        with target(data):
            outcomes.check(lambda: read_teacher_shard(folder, file), (str(target.path),), expected, teacher_rows, kind,
                           other_ok=lambda shard: "read: other values (no checksum to tell)")

    fc.run(settings, outcomes, target.original, fc.byte_mutations, example)
