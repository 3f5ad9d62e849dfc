"""The teacher-logits stage: run the teacher once over the aligned shards, keep its top-k.

For every teacher position of every aligned row it stores the top-k token ids, their
log-probabilities under the softmax over the model's whole output, and the log-probability of the
observed next token (SPEC §6), encoded by `csd_pipeline.topk_codec` into Parquet shards that are
co-partitioned with the aligned shards (`schemas/teacher_topk.py`).

How the values are computed (`TeacherRunner`):
- the rows of a block are sorted by length and batched under a token budget (`batch_tokens`),
  right-padded, with the padding masked; the batches are a pure function of the block's rows;
- the decoder's last hidden states of the real positions go through the output layer in float32,
  a chunk of positions at a time (so a bf16 GPU teacher still gets float32 logits and log-softmax,
  and memory stays bounded); models whose head is not a plain linear layer (or whose logits the
  fast path does not reproduce, checked once on a probe) fall back to the model's own forward;
- log-softmax over the whole output; ids at or beyond the tokenizer size (padded rows) are excluded
  from the top-k after the normalisation;
- a row with any non-finite log-probability is rejected and counted, and keeps its place.

Ranks (torchrun / SLURM / --rank) take disjoint shards through the shared executor; the rank that
completes last (or `csd-pipeline status DIR --finalize`) writes the manifest.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError

DEFAULT_BLOCK_POSITIONS = 1 << 16
LOGIT_CHUNK_ELEMENTS = 1 << 25  # float32 logits held at once: 128 MiB
PROBE_TOKENS = 16


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
        from csd_pipeline.topk_codec import MAX_K

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
# The teacher forward and top-k


@dataclass
class RowTopk:
    """The teacher's values for one row: ids int32 [T, k], logprobs float32 [T, k] (descending),
    observed float32 [T] (NaN at the last position); `finite` is False when the row is rejected."""

    ids: np.ndarray
    logprobs: np.ndarray
    observed: np.ndarray
    finite: bool


def plan_batches(lengths, batch_tokens: int) -> list[list[int]]:
    """Group row indices into batches: longest first, each batch's rows x longest row <= batch_tokens
    (a row longer than the budget goes alone). A pure function of (lengths, batch_tokens)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * int(lengths[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


class TeacherRunner:
    """Computes `RowTopk`s for rows of teacher token ids with a loaded model (`LoadedModel`).

    vocab_limit: the teacher tokenizer's size; ids >= vocab_limit never enter the top-k.
    """

    def __init__(self, loaded, *, top_k: int, vocab_limit: int, temperature: float = 1.0,
                 batch_tokens: int = 8192, logit_chunk_elements: int = LOGIT_CHUNK_ELEMENTS):
        import torch

        self.loaded = loaded
        self.model = loaded.model.eval()
        self.device = loaded.device
        self.top_k = top_k
        self.vocab_limit = vocab_limit
        self.output_size = loaded.output_size
        if vocab_limit > self.output_size:
            raise ValueError("vocab_limit exceeds the model's output size")
        if top_k > vocab_limit:
            raise CsdError(f"--top-k {top_k} is larger than the teacher vocabulary ({vocab_limit}); pass a smaller --top-k.")
        self.temperature = temperature
        self.batch_tokens = batch_tokens
        self.chunk = max(1, logit_chunk_elements // self.output_size)
        self._head = None
        self.path = "forward"
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        base = getattr(self.model, getattr(self.model, "base_model_prefix", ""), None)
        if isinstance(head, torch.nn.Linear) and base is not None and base is not self.model:
            self._base = base
            weight = head.weight.detach()
            bias = None if head.bias is None else head.bias.detach()
            # float32 output layer: a bf16 teacher still gets float32 logits (one copy of the head).
            self._head = (weight.float(), None if bias is None else bias.float())
            config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
            self._softcap = getattr(config, "final_logit_softcapping", None)
            self._scale = getattr(config, "logit_scale", None)
            self._scaling = getattr(config, "logits_scaling", None)
            self.path = "hidden+head" if self._probe_matches() else "forward"
            if self.path == "forward":
                self._head = None

    # -- logits ----------------------------------------------------------------------------

    def _head_logits(self, hidden):
        import torch

        weight, bias = self._head
        logits = torch.nn.functional.linear(hidden.float(), weight, bias)
        if self._scale not in (None, 1, 1.0):
            logits = logits * float(self._scale)
        if self._scaling not in (None, 1, 1.0):
            logits = logits / float(self._scaling)
        if self._softcap:
            logits = torch.tanh(logits / float(self._softcap)) * float(self._softcap)
        return logits

    def _probe_matches(self) -> bool:
        """Check once that hidden states + head reproduce the model's own logits on a short probe."""
        import torch

        ids = torch.arange(min(PROBE_TOKENS, self.vocab_limit), device=self.device)[None, :]
        with torch.inference_mode():
            reference = self.model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = self._base(input_ids=ids, use_cache=False).last_hidden_state[0]
            mine = self._head_logits(hidden)
        if mine.shape != reference.shape:
            return False
        low_precision = self.loaded.dtype in (torch.bfloat16, torch.float16)
        tolerance = (2e-2 if low_precision else 1e-3) * (1.0 + reference.abs())
        return bool(((mine - reference).abs() <= tolerance).all())

    def _batch_tensors(self, rows: list[np.ndarray]):
        import torch

        width = max(len(r) for r in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : len(row)] = torch.from_numpy(np.asarray(row, dtype=np.int64))
            mask[b, : len(row)] = 1
        return input_ids.to(self.device), mask.to(self.device)

    def forward_only(self, rows: list[np.ndarray]):
        """The model's plain forward on a padded batch (benchmarks compare the stage against it)."""
        import torch

        input_ids, mask = self._batch_tensors(rows)
        with torch.inference_mode():
            return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits

    def _batch_topk(self, rows: list[np.ndarray]) -> list[RowTopk]:
        import torch

        input_ids, mask = self._batch_tensors(rows)
        lengths = [len(r) for r in rows]
        width = input_ids.shape[1]
        flat = torch.cat([torch.arange(n, device=self.device) + b * width for b, n in enumerate(lengths)])
        next_ids = torch.from_numpy(np.concatenate(
            [np.append(np.asarray(r[1:], dtype=np.int64), -1) for r in rows])).to(self.device)
        with torch.inference_mode():
            if self._head is not None:
                states = self._base(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
                states = states.reshape(-1, states.shape[-1])[flat]
            else:
                logits_all = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
                states = logits_all.reshape(-1, logits_all.shape[-1])[flat]
            ids_out, lp_out, obs_out, ok_out = [], [], [], []
            for start in range(0, states.shape[0], self.chunk):
                part = states[start:start + self.chunk]
                logits = self._head_logits(part) if self._head is not None else part.float()
                if self.temperature != 1.0:
                    logits = logits / self.temperature
                lse = torch.logsumexp(logits, dim=-1)
                # Normalised over the whole output; padded rows (>= tokenizer size) never in the top-k.
                candidates = logits if self.vocab_limit == logits.shape[-1] else logits[:, : self.vocab_limit]
                values, indices = torch.topk(candidates, self.top_k, dim=-1)
                logprobs = values - lse[:, None]
                nxt = next_ids[start:start + part.shape[0]]
                observed = logits.gather(1, nxt.clamp(min=0)[:, None])[:, 0] - lse
                observed = torch.where(nxt >= 0, observed, torch.full_like(observed, float("nan")))
                ok = torch.isfinite(lse) & torch.isfinite(logprobs).all(dim=1) & (torch.isfinite(observed) | (nxt < 0))
                ids_out.append(indices.to(torch.int32).cpu())
                lp_out.append(logprobs.cpu())
                obs_out.append(observed.cpu())
                ok_out.append(ok.cpu())
        ids_all = torch.cat(ids_out).numpy()
        lp_all = torch.cat(lp_out).numpy()
        obs_all = torch.cat(obs_out).numpy()
        ok_all = torch.cat(ok_out).numpy()
        results, offset = [], 0
        for n in lengths:
            part = slice(offset, offset + n)
            results.append(RowTopk(ids_all[part], lp_all[part], obs_all[part], bool(ok_all[part].all())))
            offset += n
        return results

    def _run_batch(self, rows: list[np.ndarray]) -> list[RowTopk]:
        import torch

        try:
            return self._batch_topk(rows)
        except torch.OutOfMemoryError:
            if self.device.type != "cuda":
                raise
            torch.cuda.empty_cache()
            if len(rows) == 1:
                raise CsdError(
                    f"one teacher row of {len(rows[0])} tokens does not fit in GPU memory even alone; align with a "
                    "smaller --max-teacher-tokens or use a larger GPU."
                ) from None
            half = len(rows) // 2  # split and retry: an OOM batch is never fatal
            return self._run_batch(rows[:half]) + self._run_batch(rows[half:])

    def run(self, rows: list[np.ndarray]) -> list[RowTopk]:
        """The `RowTopk` of every row (int teacher ids, each non-empty), in the given order."""
        results: list[RowTopk | None] = [None] * len(rows)
        for batch in plan_batches([len(r) for r in rows], self.batch_tokens):
            for index, result in zip(batch, self._run_batch([rows[i] for i in batch])):
                results[index] = result
        return results


# ---------------------------------------------------------------------------------------------
# One shard


def write_teacher_shard(runner: TeacherRunner, aligned_file: Path, teacher_index: int, tmp_path: Path,
                        block_positions: int):
    """Compute and encode the teacher top-k of one aligned shard into the Parquet file `tmp_path`.

    Returns the executor's `ShardResult` (rows and stats). Raises CsdError when the aligned shard
    lacks the teacher's column or holds an empty row.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from csd_pipeline.executor import ShardResult
    from csd_pipeline.topk_codec import ENCODING, encode_block
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
    with pq.ParquetWriter(str(tmp_path), schema, compression=compression, use_dictionary=False,
                          write_statistics=False, store_schema=True) as writer:
        start, block = 0, 0
        while start < len(rows):
            end = start
            positions = 0
            while end < len(rows) and (positions < block_positions or end == start):
                positions += len(rows[end])
                end += 1
            results = runner.run(rows[start:end])
            kept = [(r, row) for r, row in zip(results, rows[start:end]) if r.finite]
            if kept:
                ids = np.concatenate([r.ids for r, _ in kept])
                logprobs = np.concatenate([r.logprobs for r, _ in kept])
                observed = np.concatenate([r.observed for r, _ in kept])
                observed_ids = np.concatenate([np.append(row[1:], -1) for _, row in kept])
            else:
                ids = np.zeros((0, runner.top_k), np.int64)
                logprobs = np.zeros((0, runner.top_k), np.float32)
                observed, observed_ids = np.zeros(0, np.float32), np.zeros(0, np.int64)
            payload = encode_block(ids, logprobs, observed_ids, observed)
            has_next = observed_ids >= 0
            stats["observed"]["positions"] += int(has_next.sum())
            stats["observed"]["in_top_k"] += int((ids[has_next] == observed_ids[has_next, None]).any(axis=1).sum())
            stats["positions"] += int(sum(len(r) for r in rows[start:end]))
            stats["rejected"]["non_finite"] += sum(not r.finite for r in results)
            stats["payload_bytes"] += len(payload)
            count = end - start
            writer.write_table(pa.table({
                "row_id": pa.array(row_ids[start:end], pa.string()),
                "status": pa.array([RowStatus.OK if r.finite else RowStatus.NON_FINITE for r in results], pa.uint8()),
                "positions": pa.array([len(r) for r in rows[start:end]], pa.int32()),
                "block": pa.array([block] * count, pa.int32()),
                "payload": pa.array([payload] + [None] * (count - 1), pa.binary()),
            }, schema=schema), row_group_size=max(count, 1))
            start, block = end, block + 1
    return ShardResult(rows=len(rows), stats=stats)


_RUNNERS: dict[str, TeacherRunner] = {}


def _runner_key(config: dict) -> str:
    keys = ("teacher", "dtype", "device", "trust_remote_code", "top_k", "vocab_limit", "temperature", "batch_tokens")
    return repr(tuple(config[k] for k in keys))


def runner_for(config: dict) -> TeacherRunner:
    """The (per-process cached) runner for a processor config: the model is loaded once per process."""
    key = _runner_key(config)
    if key not in _RUNNERS:
        from csd_pipeline.model_loading import load_causal_lm

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
        return write_teacher_shard(runner, aligned / task.spec["aligned_file"], config["teacher_index"], tmp_path,
                                   config["block_positions"])

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
        from csd_pipeline.tables import load_table

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
    from csd_pipeline.vocab import load_tokenizer

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
    from csd_pipeline.executor import ShardTask, StageRun, resolve_rank, run_stage
    from csd_pipeline.manifest import MANIFEST_NAME, read_manifest
    from csd_pipeline.model_loading import resolve_device, resolve_dtype
    from csd_pipeline.topk_codec import ENCODING, MAX_ABS_ERROR, STEPS_PER_NAT
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
    from csd_pipeline.model_loading import load_causal_lm

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
        processor="csd_pipeline.teacher_logits:make_shard_processor",
        processor_config=processor_config,
        # Extra keys are recorded in run.json too, so they must not change between re-runs: absolute paths.
        extra={"sources": {"aligned": str(aligned_dir.resolve()), "teacher": str(loaded.path.resolve() / (loaded.gguf_file or "")),
                           "teacher_tokenizer": record.get("name")}},
    )
    try:
        return run_stage(run, rank=rank, world_size=world_size, workers=workers, log=log)
    finally:
        _RUNNERS.pop(runner_key, None)  # do not keep a teacher in memory after the stage
