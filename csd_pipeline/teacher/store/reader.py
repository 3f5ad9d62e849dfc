"""Read teacher top-k outputs (SPEC §8): `TeacherTopkOutput.open(DIR)`, `read_teacher_topk(DIR)` and
`read_teacher_shard(DIR, FILE)`.

Rows come in the aligned order (the shards are co-partitioned with the aligned shards). Each row
(`TeacherTopkRow`) gives `row_id`, `ids` int32 [T, k], `logprobs` float32 [T, k] (descending; every
value within 0.0098 nat of the teacher's float32 log-probability), `lengths` int64 [T], the number
of real entries of each position, `observed_logprob` float32 [T] (the log-probability of token t+1
given tokens up to t; NaN at the last position) and `status` (`csd_pipeline.teacher.store.schema.RowStatus`; a
rejected row has empty [0, k] arrays).

Variable-length rows: an output written with `teacher-logits --top-p` stores a different number of
entries per position (1 to k). The arrays stay [T, k]; at position t the first `lengths[t]`
entries are real and the rest are padding with id -1 (`codec.PAD_ID`) and log-prob -inf, so a
consumer either uses `lengths` (or `row.entries(t)`) or skips non-finite log-probs, and must never
use a padding id as an index. With a fixed top-k every length is k. Shards of schema version 1
(written before `--top-p` existed) are read the same way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import storage
from csd_pipeline.runtime.storage import location
from csd_pipeline.teacher.row import (
    TeacherTopkRow,  # the one type of a teacher row; readers import it from here too
)

TEACHER_RERUN = "csd-pipeline teacher-logits"


class TeacherShard(Sequence):
    """One teacher top-k shard: `len()`, indexing and iteration in row order.

    Indexing decodes the row's whole block (one LZMA stream). Decoded blocks are kept, least
    recently used first out, while they fit in `cache_bytes` (the last one is always kept), so that
    reading the rows of a shard in a shuffled order decodes each block about once instead of once
    per row. Raises CsdError when the file is not a teacher top-k shard of a known encoding.

    Page checksums are verified on every read; a shard written before they existed is checked
    against `sha256` (its manifest's) once, here, when given (csd_pipeline/runtime/integrity.py)."""

    def __init__(self, path, cache_bytes: int = 0, sha256: str | None = None):
        import pyarrow as pa
        import pyarrow.parquet as pq

        from csd_pipeline.runtime.integrity import verify_unmarked
        from csd_pipeline.teacher.store.codec import ENCODINGS

        self.path = location(path)
        try:
            self._file = pq.ParquetFile(storage.parquet_source(storage.readable(self.path, sha256)), page_checksum_verification=True)
        except (OSError, ValueError, pa.ArrowException) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CsdError(f"teacher shard {self.path} is missing or unreadable ({reason}); re-run teacher-logits.") from None
        verify_unmarked(self._file, self.path, sha256, "teacher-logits")
        try:  # the footer has no page checksum: its key-value metadata may be damaged too
            metadata = self._file.schema_arrow.metadata or {}
            if metadata.get(b"csd.schema") != b"teacher_topk":
                raise CsdError(f"{self.path} is not a teacher top-k shard; pass the output directory of teacher-logits.")
            version = metadata.get(b"csd.schema_version", b"?").decode()
            encoding = metadata.get(b"csd.encoding", b"?").decode()
            readable = {str(v): e for v, e in ENCODINGS.items()}
            if readable.get(version) != encoding:
                known = ", ".join(f"{v} / {e}" for v, e in readable.items())
                raise CsdError(f"teacher shard {self.path} has schema version {version} and encoding {encoding}, but this "
                               f"csd-pipeline reads {known}; re-run teacher-logits.")
            self.version = int(version)
            self.k = int(metadata[b"csd.k"])
            top_p = metadata.get(b"csd.top_p", b"").decode()
            self.top_p = float(top_p) if top_p else None  # None: a fixed top-k (always so in version 1)
            from csd_pipeline.teacher.store.schema import selector_metadata_of

            # what the selectors recorded (`SelectorChain.metadata()`), for `TeacherTopkOutput.shard` to check
            self.selector_metadata = selector_metadata_of(metadata)
        except (UnicodeDecodeError, ValueError, KeyError, OSError, pa.ArrowException) as err:
            raise CsdError(f"teacher shard {self.path}: its schema metadata is damaged ({type(err).__name__}); the "
                           "file is corrupt, re-run teacher-logits.") from None
        table = self._read(lambda: self._file.read(columns=["row_id", "status", "positions", "block"]))
        self.row_ids = self._read(table.column("row_id").to_pylist)
        self.status = table.column("status").to_numpy()
        self.positions = table.column("positions").to_numpy().astype(np.int64)
        self.block = table.column("block").to_numpy()
        blocks = int(self.block.max()) + 1 if len(self.block) else 0
        if blocks != self._file.metadata.num_row_groups:
            raise CsdError(f"teacher shard {self.path} has {self._file.metadata.num_row_groups} row groups for {blocks} "
                           "blocks; the file is corrupt, re-run teacher-logits.")
        starts = np.searchsorted(self.block, np.arange(blocks + 1))
        self._block_rows = [(int(starts[b]), int(starts[b + 1])) for b in range(blocks)]
        if any(self._file.metadata.row_group(b).num_rows != last - first for b, (first, last) in enumerate(self._block_rows)):
            raise CsdError(f"teacher shard {self.path}: its row groups are not its blocks; the file is corrupt, re-run "
                           "teacher-logits.")
        self.cache_bytes = int(cache_bytes)
        self._cached: OrderedDict[int, list[TeacherTopkRow]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.row_ids)

    def _decode(self, block: int) -> list[TeacherTopkRow]:
        from csd_pipeline.teacher.store.codec import block_header, decode_block

        if block in self._cached:
            self._cached.move_to_end(block)
            return self._cached[block]
        first, last = self._block_rows[block]
        column = self._read(lambda: self._file.read_row_group(block, columns=["payload"])).column("payload")
        payload = column[0].as_py() if len(column) else None  # a corrupt footer can give a row group no rows
        if payload is None:
            raise CsdError(f"teacher shard {self.path}: block {block} has no payload; the file is corrupt, re-run "
                           "teacher-logits.")
        ok = self.status[first:last] == 0
        lengths = self.positions[first:last][ok]
        try:
            if (lengths < 0).any() or int(lengths.sum()) != block_header(payload)["positions"]:  # before allocating
                raise CsdError(f"teacher top-k block: its rows hold {int(lengths.sum())} positions, not the block's; "
                               "the shard is corrupt, re-run teacher-logits.")
            mask = np.ones(int(lengths.sum()), dtype=bool)
            mask[np.cumsum(lengths) - 1] = False  # the last position of a row has no observed token
            ids, logprobs, observed, entry_counts = decode_block(payload, mask)
        except CsdError as err:  # the codec knows the block, not the file
            raise CsdError(f"teacher shard {self.path}, block {block}: {str(err).removeprefix('teacher top-k block: ')}"
                           ) from None
        if ids.shape[1] != self.k:
            raise CsdError(f"teacher shard {self.path}: block {block} holds {ids.shape[1]} entries per position, the "
                           f"shard says {self.k}; the file is corrupt, re-run teacher-logits.")
        rows, offset = [], 0
        for index in range(first, last):
            if self.status[index] != 0:
                empty = np.zeros((0, self.k), np.int32)
                rows.append(TeacherTopkRow(self.row_ids[index], empty, empty.astype(np.float32),
                                           np.zeros(0, np.float32), int(self.status[index])))
                continue
            part = slice(offset, offset + int(self.positions[index]))
            rows.append(TeacherTopkRow(self.row_ids[index], ids[part], logprobs[part], observed[part], 0,
                                       entry_counts[part]))
            offset = part.stop
        self._cached[block] = rows
        while len(self._cached) > 1 and sum(map(self._block_bytes, self._cached)) > self.cache_bytes:
            self._cached.popitem(last=False)
        return rows

    def _read(self, read):
        """`read()`, with a failed page checksum or decode turned into a one-line `CsdError`."""
        import pyarrow as pa

        from csd_pipeline.runtime.integrity import damaged_read

        try:
            return read()
        except (OSError, pa.ArrowException, UnicodeDecodeError) as err:  # a string that is not UTF-8: a damaged page
            raise damaged_read(self.path, "teacher-logits", err) from None

    def _block_bytes(self, block: int) -> int:
        """Decoded size of a block: int32 ids and float32 log-probs per entry (padding included), a float32
        observed log-prob and an int64 length per position."""
        first, last = self._block_rows[block]
        return int(self.positions[first:last].sum()) * (8 * self.k + 12)

    def __getitem__(self, index: int) -> TeacherTopkRow:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of a teacher shard with {len(self)} rows")
        index %= len(self)
        block = int(self.block[index])
        return self._decode(block)[index - self._block_rows[block][0]]

    def __iter__(self) -> Iterator[TeacherTopkRow]:
        for block in range(len(self._block_rows)):
            yield from self._decode(block)


class TeacherTopkOutput:
    """A complete teacher-logits output, read in one place: `TeacherTopkOutput.open(DIR)`.

    It owns the manifest keys (the teacher index, the aligned manifest it was computed from) and the
    shard list (from the manifest, never a glob of the folder). `directory`, `manifest` (a plain
    dict) and `shard_files` are public; everything crosses process boundaries (no open files).
    """

    def __init__(self, directory, manifest: dict):
        self.directory = location(directory)
        self.manifest = manifest
        self._check_config()
        self.shard_files = [shard["file"] for shard in manifest["shards"]]

    def _check_config(self) -> None:
        """Raise `ManifestError` unless the config values this class reads have the types teacher-logits writes."""
        from csd_pipeline.errors import ManifestError

        config = self.manifest.get("config", {})
        counts, fractions = ("top_k", "tail_samples", "teacher_index"), ("top_p", "min_p")

        def wrong(key: str) -> bool:
            value = config.get(key)
            if value is None:
                return key == "top_k"  # every store is a top-k first; the others may be absent
            if key in counts:
                return type(value) is not int or value < 0
            if key in fractions:
                return type(value) not in (int, float) or not 0 <= value <= 1
            return not isinstance(value, str)  # keep

        bad = next((key for key in ("config", "aligned", "teacher") if not isinstance(self.manifest.get(key, {}), dict)),
                   None) or next((key for key in (*counts, *fractions, "keep") if wrong(key)), None)
        if bad:
            raise ManifestError(f"{self.directory / 'manifest.json'} is malformed (its {bad} does not have the type "
                                f"teacher-logits writes); re-run {TEACHER_RERUN} into a new --output.")

    @classmethod
    def open(cls, directory) -> TeacherTopkOutput:
        """Read and check `DIR/manifest.json` (stage, schema version 1 or 2). Raises `ManifestError`."""
        from csd_pipeline.runtime.manifest import read_manifest
        from csd_pipeline.teacher.store.schema import READABLE_VERSIONS, STAGE

        return cls(directory, read_manifest(directory, stage=STAGE, schema_versions=list(READABLE_VERSIONS)))

    @property
    def top_k(self) -> int | None:
        """The most entries a position holds (`--top-k`), as the manifest records it."""
        value = (self.manifest.get("config") or {}).get("top_k")
        return None if value is None else int(value)

    @property
    def top_p(self) -> float | None:
        """The `--top-p` mass bound of a variable-length output; None for a fixed top-k."""
        value = (self.manifest.get("config") or {}).get("top_p")
        return None if value is None else float(value)

    @property
    def min_p(self) -> float | None:
        """The `--min-p` ratio of a variable-length output; None without it."""
        value = (self.manifest.get("config") or {}).get("min_p")
        return None if value is None else float(value)

    @property
    def tail_samples(self) -> int:
        """The `--tail-samples` draws per position (0 without them): their stored values are estimates."""
        return int((self.manifest.get("config") or {}).get("tail_samples") or 0)

    @property
    def keep(self) -> str:
        """Which entries the positions hold: "top-k" (the whole top-k) or "csd-events" (`--keep csd-events`:
        only those the CSD loss turns into events; the baseline losses cannot read it)."""
        return str((self.manifest.get("config") or {}).get("keep") or "top-k")

    @property
    def teacher_index(self) -> int:
        """Which teacher of the aligned output this is (its `teacher{i}_*` columns)."""
        return int((self.manifest.get("config") or {}).get("teacher_index") or 0)

    def verify(self) -> None:
        """Raise `CsdError` unless every shard exists with the size its manifest records."""
        from csd_pipeline.runtime.integrity import check_shards

        check_shards(self.manifest, self.directory, "teacher top-k directory", TEACHER_RERUN)

    def check_pairs_with(self, aligned) -> None:
        """Raise `CsdError` unless this output was computed from the `AlignedOutput` `aligned`: the
        sha256 of its manifest (or of the capture `aligned` was aligned against, `align --against-capture`,
        whose rows carry the capture's teacher ids) is the one recorded here, and the shards have the same
        names and rows."""
        recorded = (self.manifest.get("aligned") or {}).get("manifest_sha256")
        actual = aligned.manifest_sha256()
        if recorded != actual and aligned.capture_manifest_sha256 is not None:
            if recorded != aligned.capture_manifest_sha256:  # aligned against a capture: its store serves it
                raise CsdError(
                    f"teacher top-k in {self.directory} was not computed from the capture {aligned.directory} was aligned "
                    f"against (capture manifest sha256 {aligned.capture_manifest_sha256[:12]}, store made from "
                    f"{str(recorded)[:12]}); pass the teacher-logits output of that capture, or re-run "
                    f"`{TEACHER_RERUN} --aligned {aligned.directory}`")
        elif recorded != actual:
            raise CsdError(
                f"teacher top-k in {self.directory} was computed from another aligned directory than "
                f"{aligned.directory} (aligned manifest sha256 {str(recorded)[:12]} recorded, {actual[:12]} found); "
                f"re-run `{TEACHER_RERUN} --aligned {aligned.directory}`"
            )
        ours = [(s["name"], s["rows"]) for s in self.manifest["shards"]]
        if ours != [(s.name, s.rows) for s in aligned.shards]:
            raise CsdError(f"teacher top-k shards in {self.directory} are not co-partitioned with {aligned.directory}; "
                           f"re-run `{TEACHER_RERUN} --aligned {aligned.directory}`")

    def shard(self, index: int, cache_bytes: int = 0) -> TeacherShard:
        """Shard `index` (manifest order), keeping up to `cache_bytes` of decoded blocks; a shard without
        page checksums is checked against its manifest sha256 when opened, and its selectors' metadata
        (`csd.top_p`, `csd.min_p`, `csd.tail_samples`, `csd.keep`) against the manifest's (CsdError)."""
        shard = TeacherShard(self.directory / self.shard_files[index], cache_bytes,
                             self.manifest["shards"][index].get("sha256"))
        self._check_selector_metadata(shard)
        return shard

    def selectors(self):
        """The `SelectorChain` this output was written with, from what its manifest records (`config`)."""
        from csd_pipeline.teacher.store.selectors import chain_from_config

        return chain_from_config(self.manifest.get("config") or {})

    def require_exact(self, needs: str, fix: str) -> None:
        """Raise `CsdError` unless every entry stored is one of the teacher's most likely at its exact log-probability
        (no selector of the manifest says otherwise). `needs`: who reads it so; `fix`: what to do instead."""
        self.selectors().require_exact(self.directory, needs, fix)

    def _check_selector_metadata(self, shard: TeacherShard) -> None:
        if shard.version < 2:
            return  # version 1 had no selectors but --top-k (and recorded none)
        expected = {b"csd.top_p": b"", **self.selectors().metadata()}
        if shard.selector_metadata != expected:
            def shown(values):
                return ", ".join(f"{k.decode()}={v.decode()!r}" for k, v in sorted(values.items()))

            raise CsdError(f"teacher shard {shard.path} records the selectors {shown(shard.selector_metadata)} but "
                           f"{self.directory / 'manifest.json'} records {shown(expected)}; the shard belongs to "
                           f"another run, re-run `{TEACHER_RERUN}` into a new --output.")

    def rows(self) -> Iterator[TeacherTopkRow]:
        """Every row, shard by shard in manifest order, rows in aligned order."""
        for index in range(len(self.shard_files)):
            yield from self.shard(index)


def read_teacher_shard(directory, shard_file, cache_bytes: int = 0, sha256: str | None = None) -> TeacherShard:
    """One shard of a teacher-logits output (`shard_file` as listed in its manifest), as a `TeacherShard`
    keeping up to `cache_bytes` of decoded blocks (`sha256`: its manifest's, checked if it has no page checksums)."""
    return TeacherShard(location(directory) / shard_file, cache_bytes, sha256)


def read_teacher_topk(directory) -> Iterator[TeacherTopkRow]:
    """Yield every row of a teacher-logits output, shard by shard in manifest order, rows in aligned order.

    Raises CsdError (before yielding) when the directory has no manifest, is another stage's output,
    has an unknown schema version or misses a shard.
    """
    output = TeacherTopkOutput.open(directory)
    output.verify()
    return output.rows()
