"""An aligned output (the align stage's DIR), read in one place: `AlignedOutput.open(DIR)`.

`AlignedOutput` owns what a reader needs to know of the format: the manifest keys (config,
tokenizers, tables), the shard list (from the manifest, never a glob of the folder), the column
names of the student and of each teacher (`schemas/aligned.py` names them) and the reading of
shard columns. Every later stage (teacher-logits, the trainer, bits-per-byte, `inspect`, `report`)
reads aligned outputs through it. Errors are `CsdError`s naming the directory and what to re-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import location
from schemas.aligned import CAPTURE_KIND, SCHEMA_VERSION, STAGE, teacher_columns

ALIGN_RERUN = "csd-pipeline align"
STUDENT_COLUMNS = ("student_ids", "student_loss_mask")


@dataclass(frozen=True)
class AlignedShard:
    """One shard as the manifest lists it."""

    name: str
    file: str
    rows: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SideColumns:
    """The columns one side (the student or teacher i) is scored from: its token ids, the chunk
    lengths on its side and the chunk statuses (the student reads teacher 0's chunks)."""

    ids: str
    chunk_len: str
    chunk_status: str


@dataclass(frozen=True)
class ChunkColumns:
    """The chunk columns against teacher i: each chunk's length on the student side and on the
    teacher side, and its status (`schemas.aligned.ChunkStatus`)."""

    student_len: str
    teacher_len: str
    status: str


@dataclass(frozen=True)
class TeacherTokenizer:
    """What an aligned output records of teacher tokenizer `index`."""

    index: int
    fingerprint: str | None
    size: int
    name: str | None


class AlignedOutput:
    """A complete aligned output: `directory` and its checked `manifest` (a plain dict)."""

    def __init__(self, directory, manifest: dict):
        self.directory = location(directory)
        self.manifest = manifest
        self._check_keys()
        self.shards = [AlignedShard(s["name"], s["file"], int(s["rows"]), int(s["bytes"]), s["sha256"])
                       for s in manifest["shards"]]

    @classmethod
    def open(cls, directory) -> AlignedOutput:
        """Read and check `DIR/manifest.json` (stage, schema version). Raises `ManifestError`."""
        from csd_pipeline.runtime.manifest import read_manifest

        return cls(directory, read_manifest(directory, stage=STAGE, schema_versions=[SCHEMA_VERSION]))

    def _check_keys(self) -> None:
        """Raise `ManifestError` unless the config and tokenizer keys this class reads have their types."""
        from csd_pipeline.errors import ManifestError

        config, tokenizers = self.manifest.get("config", {}), self.manifest.get("tokenizers", {})
        teachers = tokenizers.get("teachers", []) if isinstance(tokenizers, dict) else None
        checks = {
            "config": isinstance(config, dict) and config.get("mode", "text") in ("text", "chat")
            and isinstance(config.get("context_token", True), bool)
            and type(config.get("max_student_tokens", 1)) in (int, type(None)),
            "tokenizers": isinstance(teachers, list) and isinstance(tokenizers.get("student", {}), dict)
            and all(isinstance(t, dict) and type(t.get("size")) in (int, type(None))
                    and all(type(t.get(k)) in (str, type(None)) for k in ("fingerprint", "name"))
                    and (t.get("size") is None or 0 < t["size"] < 2**31) for t in teachers),
            "tables": isinstance(self.manifest.get("tables", []), list),
            "kind": self.manifest.get("kind", "aligned") in ("aligned", CAPTURE_KIND)
            and isinstance(self.manifest.get("against_capture", {}), dict)
            and type((self.manifest.get("against_capture") or {}).get("manifest_sha256")) in (str, type(None)),
        }
        for key, good in checks.items():
            if not good:
                raise ManifestError(f"{self.directory / 'manifest.json'} is malformed (its {key} do not have the "
                                    f"types align writes); re-run {ALIGN_RERUN} into a new --output.")

    # -- shards ---------------------------------------------------------------------------

    @property
    def total_rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def shard_path(self, shard: AlignedShard) -> Path:
        return self.directory / shard.file

    def verify(self) -> None:
        """Raise `CsdError` unless every shard exists with the size and row count its manifest records."""
        from csd_pipeline.runtime.integrity import check_shards

        check_shards(self.manifest, self.directory, "aligned directory", ALIGN_RERUN)

    def manifest_sha256(self) -> str:
        """sha256 of `DIR/manifest.json` (what a teacher-logits output records of the aligned data)."""
        from csd_pipeline.runtime.files import file_sha256
        from csd_pipeline.runtime.manifest import MANIFEST_NAME

        return file_sha256(self.directory / MANIFEST_NAME)

    # -- config and tokenizers ------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._config.get("mode", "text")

    @property
    def context_token(self) -> bool:
        return bool(self._config.get("context_token", True))

    @property
    def max_student_tokens(self) -> int | None:
        value = self._config.get("max_student_tokens")
        return None if value is None else int(value)

    @property
    def kind(self) -> str:
        """"capture" for a teacher capture (`align --capture-only`: no student), else "aligned"."""
        return str(self.manifest.get("kind") or "aligned")

    @property
    def capture_manifest_sha256(self) -> str | None:
        """The sha256 of the capture's manifest this output was aligned against (`--against-capture`), or None."""
        return (self.manifest.get("against_capture") or {}).get("manifest_sha256")

    def require_student(self, option: str) -> None:
        """Raise `CsdError` (naming `option`) when this output is a capture, which has no student to train."""
        if self.kind == CAPTURE_KIND:
            raise CsdError(f"{option} {self.directory} is a teacher capture (no student); align the student against it "
                           f"with `{ALIGN_RERUN} --against-capture {self.directory} --student-tokenizer S --output DIR` "
                           f"and pass DIR.")

    @property
    def _config(self) -> dict:
        return self.manifest.get("config") or {}

    @property
    def _tokenizers(self) -> dict:
        return self.manifest.get("tokenizers") or {}

    @property
    def num_teachers(self) -> int:
        return len(self._tokenizers.get("teachers") or [])

    def check_teacher_index(self, index: int, option: str = "--teacher-index") -> None:
        """Raise `CsdError` (naming `option`) unless the output aligns a teacher `index`."""
        if not 0 <= index < self.num_teachers:
            raise CsdError(f"{option} {index} is out of range: {self.directory} was aligned for {self.num_teachers} "
                           f"teacher(s); pass an index in [0, {self.num_teachers}).")

    def require_tokenizer(self, side, fingerprint: str) -> None:
        """Raise `ManifestError` unless `side` ("student" or a teacher index) was aligned with the
        tokenizer of `fingerprint`."""
        from csd_pipeline.runtime.manifest import require_fingerprint

        if side == "student":
            what, recorded = "student tokenizer", (self._tokenizers.get("student") or {}).get("fingerprint")
        else:
            self.check_teacher_index(int(side), "teacher")
            what, recorded = f"teacher tokenizer {side}", self._tokenizers["teachers"][int(side)].get("fingerprint")
        require_fingerprint(self.manifest, self.directory, what, recorded, fingerprint)

    def teacher_tokenizer(self, index: int) -> TeacherTokenizer:
        """Teacher tokenizer `index`: fingerprint, vocabulary size and name.

        The size is in the manifest since the align stage records it; for an older output it comes
        from the teacher->student table the directory carries. Raises `CsdError`.
        """
        self.check_teacher_index(index)
        record = self._tokenizers["teachers"][index]
        size = record.get("size")
        if size is None:
            from csd_pipeline.vocab.tables import load_table

            table = load_table(self.tables(index)[1])
            if table.source_fingerprint != record.get("fingerprint"):
                raise CsdError(f"the teacher->student table of {self.directory} does not match its manifest's teacher "
                               f"tokenizer {index}; re-run {ALIGN_RERUN}.")
            size = table.source.size
        return TeacherTokenizer(index, record.get("fingerprint"), int(size), record.get("name"))

    def tables(self, index: int) -> tuple[Path, Path]:
        """(student->teacher, teacher->student) table paths of teacher `index`, checked to lie inside the
        directory, to exist and to be made for the tokenizers the manifest records (a swapped table
        names the align stage)."""
        from csd_pipeline.runtime.integrity import check_table_fingerprints

        if self.kind == CAPTURE_KIND:
            raise CsdError(f"{self.directory} is a teacher capture: it has no student, so no tables (--keep csd-events "
                           f"and training read them); align a student against it with `{ALIGN_RERUN} "
                           f"--against-capture {self.directory}` and use that output.")
        return check_table_fingerprints(self.manifest, self.directory, index)

    # -- columns --------------------------------------------------------------------------

    def side_columns(self, side) -> SideColumns:
        """The columns of `side`: "student" or a teacher index."""
        if side == "student":
            _, student_len, _, status = teacher_columns(0)
            return SideColumns(STUDENT_COLUMNS[0], student_len, status)
        ids, _, teacher_len, status = teacher_columns(int(side))
        return SideColumns(ids, teacher_len, status)

    @staticmethod
    def chunk_columns(index: int) -> ChunkColumns:
        """The chunk columns against teacher `index`."""
        _, student_len, teacher_len, status = teacher_columns(index)
        return ChunkColumns(student_len, teacher_len, status)

    @staticmethod
    def training_columns(teacher_indices) -> list[str]:
        """The columns a training row needs: row_id, the student's, and those of each teacher given."""
        columns = ["row_id", *STUDENT_COLUMNS]
        for index in teacher_indices:
            columns += list(teacher_columns(index))
        return columns

    def read(self, shard: AlignedShard, columns: list[str]):
        """The `columns` of one shard as a pyarrow Table, its bytes read once and checked against the
        manifest's sha256, its page checksums verified (csd_pipeline/runtime/integrity.py). Raises
        `CsdError` for a missing column or an unreadable or damaged file."""
        import pyarrow as pa

        from csd_pipeline.runtime.integrity import damaged_read, open_verified

        path = self.shard_path(shard)
        parquet = open_verified(path, shard.sha256, STAGE)
        missing = [name for name in columns if name not in parquet.schema_arrow.names]
        if not missing:
            try:
                return parquet.read(columns=columns)
            except (OSError, KeyError, pa.ArrowException) as err:
                raise damaged_read(path, STAGE, err) from None
        raise CsdError(f"aligned shard {path} has no column {missing[0]}: {self.directory} aligns {self.num_teachers} "
                       f"teacher(s); pass a teacher index it has, or re-run `{ALIGN_RERUN}` with that teacher.")

    def teacher_rows(self, shard: AlignedShard, index: int):
        """(row ids, teacher `index`'s ids of each row as int64 arrays) of one shard, in row order."""
        import numpy as np

        ids = teacher_columns(index)[0]
        table = self.read(shard, ["row_id", ids])
        lists = table.column(ids).combine_chunks()
        offsets = lists.offsets.to_numpy()
        values = lists.values.to_numpy().astype(np.int64)
        return table.column("row_id").to_pylist(), [values[offsets[i]:offsets[i + 1]] for i in range(len(table))]
