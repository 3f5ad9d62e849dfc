"""The teacher-logits stage: run the teacher once over the aligned shards, keep its top-k.

For every teacher position of every aligned row it stores the top-k token ids, their
log-probabilities under the softmax over the model's whole output, and the log-probability of the
observed next token (SPEC §6), encoded by `csd_pipeline.teacher.codec` into Parquet shards that are
co-partitioned with the aligned shards (`schemas/teacher_topk.py`).

The values come from `csd_pipeline.teacher.runner.TeacherRunner` (batching, float32 logits and
log-softmax over the whole output, top-k). Here: rows are cut into blocks of about
`block_positions` positions (one Parquet row group each), each block is computed and encoded in
row order; a row with any non-finite log-probability is rejected and counted (status 1, no values)
and keeps its place, so the shard stays co-partitioned with its aligned shard.

Ranks (torchrun / SLURM / --rank) take disjoint shards through the shared executor; the rank that
completes last (or `csd-pipeline status DIR --finalize`) writes the manifest.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.runner import RowTopk, TeacherRunner

DEFAULT_BLOCK_POSITIONS = 1 << 16


@dataclass
class TeacherLogitsConfig:
    """Options of `csd-pipeline teacher-logits` (see `cli/teacher_logits.py` for their help)."""

    aligned: str
    teacher: str
    output: str
    teacher_index: int = 0
    top_k: int = 32
    batch_tokens: int = 8192
    device: str = "auto"
    dtype: str = "auto"
    temperature: float = 1.0
    trust_remote_code: bool = False
    block_positions: int = DEFAULT_BLOCK_POSITIONS
    check_tokenizer: bool = True

    def validate(self) -> None:
        """Raise CsdError naming the option that is out of range."""
        from csd_pipeline.teacher.codec import MAX_K

        if not 1 <= self.top_k <= MAX_K:
            raise CsdError(f"--top-k {self.top_k} is out of range; pass a value in [1, {MAX_K}].")
        if self.batch_tokens < 1:
            raise CsdError(f"--batch-tokens {self.batch_tokens} is not positive; pass e.g. 8192.")
        if not self.temperature > 0:
            raise CsdError(f"--temperature {self.temperature} is not positive; pass e.g. 1.0.")
        if self.teacher_index < 0:
            raise CsdError(f"--teacher-index {self.teacher_index} is negative; pass 0 for the first teacher.")
        if self.block_positions < 1:
            raise CsdError(f"--block-positions {self.block_positions} is not positive.")


# ---------------------------------------------------------------------------------------------
# One shard


def block_ranges(lengths, block_positions: int) -> list[tuple[int, int]]:
    """Consecutive row ranges [start, end) of at least `block_positions` positions each (the last may
    be shorter); every block holds at least one row."""
    ranges, start = [], 0
    while start < len(lengths):
        end, positions = start, 0
        while end < len(lengths) and (positions < block_positions or end == start):
            positions += int(lengths[end])
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def encode_rows(results: list[RowTopk], rows: list[np.ndarray], top_k: int) -> tuple[bytes, dict]:
    """Encode the kept rows (finite) of one block; returns (payload, stats of the block)."""
    from csd_pipeline.teacher.codec import encode_block

    kept = [(r, row) for r, row in zip(results, rows) if r.finite]
    if kept:
        ids = np.concatenate([r.ids for r, _ in kept])
        logprobs = np.concatenate([r.logprobs for r, _ in kept])
        observed = np.concatenate([r.observed for r, _ in kept])
        observed_ids = np.concatenate([np.append(row[1:], -1) for _, row in kept])
    else:
        ids, logprobs = np.zeros((0, top_k), np.int64), np.zeros((0, top_k), np.float32)
        observed, observed_ids = np.zeros(0, np.float32), np.zeros(0, np.int64)
    payload = encode_block(ids, logprobs, observed_ids, observed)
    has_next = observed_ids >= 0
    stats = {
        "positions": int(sum(len(row) for row in rows)),
        "rejected": {"non_finite": sum(not r.finite for r in results)},
        "observed": {"positions": int(has_next.sum()),
                     "in_top_k": int((ids[has_next] == observed_ids[has_next, None]).any(axis=1).sum())},
        "payload_bytes": len(payload),
    }
    return payload, stats


def write_teacher_shard(runner: TeacherRunner, aligned_file: Path, teacher_index: int, tmp_path: Path,
                        block_positions: int):
    """Compute and encode the teacher top-k of one aligned shard into the Parquet file `tmp_path`.

    Returns the executor's `ShardResult` (rows and stats). Raises CsdError when the aligned shard
    lacks the teacher's column or holds an empty row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from csd_pipeline.runtime.executor import ShardResult, merge_stats
    from csd_pipeline.teacher.codec import ENCODING
    from schemas.teacher_topk import RowStatus, teacher_topk_schema

    column = f"teacher{teacher_index}_ids"
    parquet = pq.ParquetFile(str(aligned_file))
    if column not in parquet.schema_arrow.names:
        raise CsdError(f"aligned shard {aligned_file} has no column {column}; pass a --teacher-index the aligned "
                       "directory has, or re-run csd-pipeline align with that teacher.")
    table = parquet.read(columns=["row_id", column])
    row_ids = table.column("row_id").to_pylist()
    lists = table.column(column).combine_chunks()
    offsets = lists.offsets.to_numpy()
    values = lists.values.to_numpy().astype(np.int64)
    rows = [values[offsets[i]:offsets[i + 1]] for i in range(len(row_ids))]
    for row_id, row in zip(row_ids, rows):
        if row.size == 0:
            raise CsdError(f"aligned row {row_id} of {aligned_file} has no teacher tokens; re-run csd-pipeline align.")
        if row.min() < 0 or row.max() >= runner.vocab_limit:
            raise CsdError(f"aligned row {row_id} of {aligned_file} has teacher ids outside the teacher vocabulary "
                           f"(size {runner.vocab_limit}); the aligned directory was made with another tokenizer.")

    schema = teacher_topk_schema(runner.top_k, ENCODING)
    stats = {"positions": 0, "rejected": {"non_finite": 0}, "observed": {"positions": 0, "in_top_k": 0},
             "payload_bytes": 0}
    compression = {"row_id": "zstd", "status": "zstd", "positions": "zstd", "block": "zstd", "payload": "none"}
    # On a GPU the CPU would otherwise idle the accelerator while it encodes: encode blocks in threads
    # (LZMA releases the GIL) while the next block runs. On CPU the forward already uses every core.
    threads = 0 if runner.device.type == "cpu" else min(4, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(threads) if threads else None
    pending: deque = deque()

    def write(block: int, start: int, end: int, results, encoded) -> None:
        payload, part = encoded.result() if pool else encoded
        merge_stats(stats, part)
        count = end - start
        writer.write_table(pa.table({
            "row_id": pa.array(row_ids[start:end], pa.string()),
            "status": pa.array([RowStatus.OK if r.finite else RowStatus.NON_FINITE for r in results], pa.uint8()),
            "positions": pa.array([len(r) for r in rows[start:end]], pa.int32()),
            "block": pa.array([block] * count, pa.int32()),
            "payload": pa.array([payload] + [None] * (count - 1), pa.binary()),
        }, schema=schema), row_group_size=count)

    try:
        with pq.ParquetWriter(str(tmp_path), schema, compression=compression, use_dictionary=False,
                              write_statistics=False, store_schema=True) as writer:
            for block, (start, end) in enumerate(block_ranges([len(r) for r in rows], block_positions)):
                results = runner.run(rows[start:end])
                job = (encode_rows, results, rows[start:end], runner.top_k)
                pending.append((block, start, end, results, pool.submit(*job) if pool else job[0](*job[1:])))
                while len(pending) > threads:  # blocks are written in order; at most `threads` in flight
                    write(*pending.popleft())
            while pending:
                write(*pending.popleft())
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return ShardResult(rows=len(rows), stats=stats)


_RUNNERS: dict[str, TeacherRunner] = {}


def _runner_key(config: dict) -> str:
    keys = ("teacher", "dtype", "device", "trust_remote_code", "top_k", "vocab_limit", "temperature", "batch_tokens")
    return repr(tuple(config[k] for k in keys))


def runner_for(config: dict) -> TeacherRunner:
    """The (per-process cached) runner for a processor config: the model is loaded once per process."""
    key = _runner_key(config)
    if key not in _RUNNERS:
        from csd_pipeline.runtime.model_loading import load_causal_lm

        loaded = load_causal_lm(config["teacher"], dtype=config["dtype"], device=config["device"],
                                trust_remote_code=config["trust_remote_code"])
        _RUNNERS[key] = TeacherRunner(loaded, top_k=config["top_k"], vocab_limit=config["vocab_limit"],
                                      temperature=config["temperature"], batch_tokens=config["batch_tokens"])
    return _RUNNERS[key]


def make_shard_processor(config: dict):
    """The executor factory: load the teacher once, return `process(task, tmp_path) -> ShardResult`."""
    _deterministic_torch(config["device"])
    runner = runner_for(config)
    aligned = Path(config["aligned"])

    def process(task, tmp_path: Path):
        from csd_pipeline.runtime.executor import file_sha256

        source = aligned / task.spec["aligned_file"]
        if not source.is_file() or file_sha256(source) != task.spec["aligned_sha256"]:
            raise CsdError(f"aligned shard {source} is missing or differs from what its manifest records; re-run "
                           "csd-pipeline align, then teacher-logits into a new --output.")
        return write_teacher_shard(runner, source, config["teacher_index"], tmp_path, config["block_positions"])

    return process


def _deterministic_torch(device: str) -> None:
    import torch

    if not device.startswith("cuda"):
        # CPU kernels are deterministic for a given thread count; this makes any exception loud.
        torch.use_deterministic_algorithms(True, warn_only=True)


# ---------------------------------------------------------------------------------------------
# The stage


def aligned_teacher(manifest: dict, aligned_dir: Path, index: int) -> dict:
    """{"fingerprint", "size", "name"} of teacher tokenizer `index` of an aligned output.

    The size comes from the manifest when recorded, else from the teacher->student table the
    aligned directory carries (whose teacher fingerprint must match). Raises CsdError.
    """
    teachers = (manifest.get("tokenizers") or {}).get("teachers") or []
    if not 0 <= index < len(teachers):
        raise CsdError(f"--teacher-index {index} is out of range: {aligned_dir} was aligned for {len(teachers)} "
                       f"teacher(s); pass an index in [0, {len(teachers)}).")
    record = dict(teachers[index])
    if "size" not in record:
        from csd_pipeline.vocab.tables import load_table

        tables = [t for t in manifest.get("tables") or [] if t.get("teacher") == index]
        if not tables:
            raise CsdError(f"{aligned_dir} records neither the size of teacher tokenizer {index} nor its tables; "
                           "re-run csd-pipeline align.")
        table = load_table(aligned_dir / tables[0]["teacher_to_student"])
        if table.source_fingerprint != record.get("fingerprint"):
            raise CsdError(f"the teacher->student table of {aligned_dir} does not match its manifest's teacher "
                           f"tokenizer {index}; re-run csd-pipeline align.")
        record["size"] = table.source.size
    return record


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise CsdError(f"--output {out} is a file; pass a directory.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe.{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise CsdError(f"--output {out} is not writable ({err.strerror or err}); pass a directory you can write to.") from None


def _check_teacher_tokenizer(loaded, record: dict, aligned_dir: Path, index: int, log) -> None:
    """Refuse a teacher folder whose own tokenizer is not the one the aligned directory used."""
    if loaded.gguf_file is not None or not (loaded.path / "tokenizer.json").is_file():
        _log(log, f"teacher {loaded.source} carries no tokenizer.json; only its output size was checked.")
        return
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    fingerprint = load_tokenizer(str(loaded.path)).vocab.fingerprint
    if fingerprint != record.get("fingerprint"):
        raise CsdError(
            f"teacher {loaded.source} has another tokenizer ({fingerprint[:12]}) than teacher {index} of {aligned_dir} "
            f"({str(record.get('fingerprint'))[:12]}, {record.get('name')}); pass the matching teacher or "
            "--teacher-index, or re-run csd-pipeline align with this teacher's tokenizer."
        )


def _log(log, message: str) -> None:
    if log is not None:
        log(message)


def run_teacher_logits(config: TeacherLogitsConfig, *, rank: int | None = None, world_size: int | None = None,
                       workers: int = 1, log=None):
    """Run (or resume) the teacher-logits stage for this rank; returns the executor's `RunReport`.

    Raises CsdError for a bad option, an aligned directory without a (known) manifest, a teacher
    that does not match the aligned teacher tokenizer, or an unwritable output directory.
    """
    from csd_pipeline.runtime.executor import ShardTask, StageRun, resolve_rank, run_stage
    from csd_pipeline.runtime.manifest import MANIFEST_NAME, read_manifest
    from csd_pipeline.runtime.model_loading import resolve_device, resolve_dtype
    from csd_pipeline.teacher.codec import ENCODING, MAX_ABS_ERROR, STEPS_PER_NAT
    from schemas.aligned import SCHEMA_VERSION as ALIGNED_VERSION
    from schemas.aligned import STAGE as ALIGN_STAGE
    from schemas.teacher_topk import SCHEMA_VERSION, STAGE

    config.validate()
    rank, world_size = resolve_rank(rank, world_size)
    if workers < 1:
        raise CsdError(f"--workers {workers} is not positive; pass --workers 1 or more.")
    aligned_dir = Path(config.aligned)
    manifest = read_manifest(aligned_dir, stage=ALIGN_STAGE, schema_versions=[ALIGNED_VERSION])
    manifest_sha = hashlib.sha256((aligned_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    record = aligned_teacher(manifest, aligned_dir, config.teacher_index)
    out = Path(config.output)
    _check_writable(out)

    device = resolve_device(config.device)
    dtype = str(resolve_dtype(config.dtype, device)).replace("torch.", "")
    processor_config = {
        "aligned": str(aligned_dir.resolve()),
        "teacher": config.teacher,
        "teacher_index": config.teacher_index,
        "dtype": dtype,
        "device": str(device),
        "trust_remote_code": config.trust_remote_code,
        "top_k": config.top_k,
        "vocab_limit": int(record["size"]),
        "temperature": float(config.temperature),
        "batch_tokens": config.batch_tokens,
        "block_positions": config.block_positions,
    }
    _deterministic_torch(str(device))
    from csd_pipeline.runtime.model_loading import load_causal_lm

    _log(log, f"loading teacher {config.teacher} ({dtype} on {device})...")
    loaded = load_causal_lm(config.teacher, dtype=dtype, device=str(device), trust_remote_code=config.trust_remote_code)
    if loaded.output_size < record["size"]:
        raise CsdError(
            f"teacher {config.teacher} has {loaded.output_size} outputs but teacher tokenizer {config.teacher_index} of "
            f"{aligned_dir} ({record.get('name')}) has {record['size']} ids; pass the teacher that goes with that "
            "tokenizer, or re-run csd-pipeline align with this teacher's tokenizer."
        )
    if config.check_tokenizer:
        _check_teacher_tokenizer(loaded, record, aligned_dir, config.teacher_index, log)
    # The executor's in-process processor picks this runner up instead of loading the model again.
    runner_key = _runner_key(processor_config)
    _RUNNERS[runner_key] = TeacherRunner(
        loaded, top_k=config.top_k, vocab_limit=int(record["size"]), temperature=float(config.temperature),
        batch_tokens=config.batch_tokens)

    tasks = [
        ShardTask(index, Path(shard["file"]).stem, {"aligned_file": shard["file"], "aligned_sha256": shard["sha256"],
                                                    "rows": shard["rows"]})
        for index, shard in enumerate(manifest["shards"])
    ]
    identity = {
        "config": {
            "top_k": config.top_k,
            "encoding": ENCODING,
            "logprob_step": 1 / STEPS_PER_NAT,
            "max_abs_error": MAX_ABS_ERROR,
            "temperature": float(config.temperature),
            "dtype": dtype,
            "logits_dtype": "float32",
            "device_type": device.type,
            "batch_tokens": config.batch_tokens,
            "block_positions": config.block_positions,
            "teacher_index": config.teacher_index,
        },
        "teacher": {
            "fingerprint": loaded.fingerprint["sha256"],
            "files": loaded.fingerprint["files"],
            "output_size": loaded.output_size,
            "tokenizer_fingerprint": record.get("fingerprint"),
            "tokenizer_size": int(record["size"]),
        },
        "aligned": {"manifest_sha256": manifest_sha, "shards": len(tasks)},
    }
    run = StageRun(
        stage=STAGE,
        schema_version=SCHEMA_VERSION,
        output_dir=out,
        identity=identity,
        tasks=tasks,
        processor="csd_pipeline.teacher.stage:make_shard_processor",
        processor_config=processor_config,
        # Extra keys are recorded in run.json too, so they must not change between re-runs: absolute paths.
        extra={"sources": {"aligned": str(aligned_dir.resolve()), "teacher": str(loaded.path.resolve() / (loaded.gguf_file or "")),
                           "teacher_tokenizer": record.get("name")}},
        work=lambda spec: spec["rows"], work_unit="row",
    )
    try:
        return run_stage(run, rank=rank, world_size=world_size, workers=workers,
                         log=log if log is not None else (lambda message: None))
    finally:
        _RUNNERS.pop(runner_key, None)  # do not keep a teacher in memory after the stage
