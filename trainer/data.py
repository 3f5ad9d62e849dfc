"""Streaming training data: aligned + teacher top-k shards, checked, shuffled, packed, with events.

`TrainingData.open(config)` reads the aligned and teacher manifests (never a glob), checks them
against each other (the teacher manifest records the sha256 of the aligned manifest it was
computed from, and the shards are co-partitioned) and against the student tokenizer
(fingerprint). Any mismatch raises `CsdError` naming the stage to re-run.

`TrainingData.loader(rank, world, state)` streams this rank's micro-batches: the epoch order of
`trainer.shuffle` (one block of shards in memory at a time), greedy packing
(`trainer.packing`), CE targets and CSD events (`csd_pipeline.loss.events`) built in data-loader
worker processes. Worker w of W builds batches w, w+W, ...; the torch DataLoader hands them back
in order, so the stream is the same whatever the number of workers. Every micro-batch carries the
loader state after it: `{"version", "epoch", "position"}`, the next window of this rank.

Only the training entry point imports this module (it imports torch at the top).
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from csd_pipeline.errors import CsdError
from trainer.packing import check_window_length, pack, plan_rows
from trainer.shuffle import EpochPlan

LOADER_STATE_VERSION = 1
ALIGN_RERUN = "csd-pipeline align"
TEACHER_RERUN = "csd-pipeline teacher-logits"


@dataclass
class MicroBatch:
    """One rank's packed micro-batch with its CE targets and per-teacher events (numpy)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    ce_positions: np.ndarray
    ce_tokens: np.ndarray
    teachers: list                 # BatchEvents per active teacher
    shape_counts: list[list[int]]  # per active teacher: accepted chunks [1:1, 1:N, M:1, M:N]
    content_tokens: int
    padding_tokens: int
    windows: int
    state: dict = field(default_factory=dict)


@dataclass
class TeacherSource:
    """One teacher's top-k directory, paired with the aligned data."""

    index: int       # teacher index in the aligned rows (teacher{index}_*)
    directory: Path
    manifest: dict
    weight: float


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _find_key(manifest: dict, *paths: tuple[str, ...]):
    """The value at the first of the key paths present in `manifest` (None when none is)."""
    for path in paths:
        node = manifest
        for key in path:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            return node
    return None


class TrainingData:
    """The checked inputs of a run and the factory of its loader."""

    def __init__(self, config, aligned_dir: Path, manifest: dict, student_bundle, tokenizer_source: str,
                 teachers: list[TeacherSource], num_teachers: int):
        self.config = config
        self.aligned_dir = aligned_dir
        self.manifest = manifest
        self.student_bundle = student_bundle
        self.student_vocab = student_bundle.vocab
        self.student_tokenizer = tokenizer_source
        self.teachers = teachers
        self.num_teachers = num_teachers
        self.shard_files = [shard["file"] for shard in manifest["shards"]]
        self.shard_rows = tuple(int(shard["rows"]) for shard in manifest["shards"])

    @property
    def teacher_weights(self) -> list[float]:
        return [t.weight for t in self.teachers]

    @classmethod
    def open(cls, config) -> TrainingData:
        """Read and cross-check the manifests of `config.aligned` and `config.teacher_logits`."""
        from csd_pipeline.runtime.manifest import read_manifest, require_fingerprint, verify_shards
        from csd_pipeline.vocab.vocabulary import load_tokenizer
        from schemas.aligned import SCHEMA_VERSION, STAGE

        aligned_dir = Path(config.aligned)
        manifest = read_manifest(aligned_dir, stage=STAGE, schema_versions=[SCHEMA_VERSION])
        problems = verify_shards(manifest, aligned_dir)
        if problems:
            raise CsdError(f"aligned directory {aligned_dir}: {problems[0]}; re-run `{ALIGN_RERUN}` into it")
        max_student = _find_key(manifest, ("config", "max_student_tokens"))
        if max_student is not None and int(max_student) > config.seq_len:
            raise CsdError(
                f"{aligned_dir} was aligned with --max-student-tokens {max_student}, more than --seq-len "
                f"{config.seq_len}, so a window may not fit a packed row; raise --seq-len to {max_student} or re-run "
                f"`{ALIGN_RERUN}` with --max-student-tokens <= {config.seq_len}"
            )
        from trainer.model import student_tokenizer_source

        tokenizer_source = student_tokenizer_source(config)
        bundle = load_tokenizer(tokenizer_source, trust_remote_code=config.trust_remote_code)
        recorded = _find_key(manifest, ("tokenizers", "student", "fingerprint"))
        require_fingerprint(manifest, aligned_dir, "student tokenizer", recorded, bundle.vocab.fingerprint)
        num_teachers = len(_find_key(manifest, ("tokenizers", "teachers")) or [])
        total = sum(int(s["rows"]) for s in manifest["shards"])
        if total == 0:
            raise CsdError(f"aligned directory {aligned_dir} holds no rows; align a non-empty corpus with `{ALIGN_RERUN}`")
        teachers = []
        if config.loss != "ce":
            weights = config.teacher_weights()
            sources = [_open_teacher(Path(d), aligned_dir, manifest) for d in config.teacher_logits]
            by_index: dict[int, tuple[Path, dict]] = {}
            for directory, teacher_manifest, index in sources:
                if index in by_index:
                    raise CsdError(f"--teacher-logits {by_index[index][0]} and {directory} are both teacher {index}; "
                                   "pass one directory per teacher")
                if num_teachers and index >= num_teachers:
                    raise CsdError(f"--teacher-logits {directory} is teacher {index} but {aligned_dir} aligns "
                                   f"{num_teachers} teacher(s); re-run `{TEACHER_RERUN}` with the right --teacher-index")
                by_index[index] = (directory, teacher_manifest)
            for index, weight in sorted(weights.items()):
                if index not in by_index:
                    raise CsdError(f"--kd-teachers names teacher {index} but no --teacher-logits directory holds it "
                                   f"(given: {sorted(by_index)}); add its directory or drop it from --kd-teachers")
                if weight > 0:
                    directory, teacher_manifest = by_index[index]
                    teachers.append(TeacherSource(index, directory, teacher_manifest, weight))
        return cls(config, aligned_dir, manifest, bundle, tokenizer_source, teachers, num_teachers)

    def loader(self, rank: int, world: int, state: dict | None):
        """This rank's endless stream of `MicroBatch`es, from loader `state` (None: the start)."""
        total = sum(self.shard_rows)
        if total < world:
            raise CsdError(f"aligned directory {self.aligned_dir} has {total} rows, fewer than the {world} ranks; "
                           "align more text or use fewer ranks")
        state = _check_state(state)
        spec = LoaderSpec(
            aligned_dir=str(self.aligned_dir), shard_files=list(self.shard_files), shard_rows=self.shard_rows,
            teacher_dirs=[str(t.directory) for t in self.teachers],
            teacher_shard_files=[[s["file"] for s in t.manifest["shards"]] for t in self.teachers],
            teacher_indices=[t.index for t in self.teachers], tables=self.tables_for_teachers(),
            seed=self.config.seed, shuffle_block=self.config.shuffle_block, seq_len=self.config.seq_len,
            batch_size=self.config.batch_size, spelling=self.config.spelling,
            only_1to1=self.config.loss in ("csd_1to1", "strict"), rank=rank, world=world, epoch=state["epoch"],
            position=state["position"], pad_id=self.pad_id(), teacher_top_k=self.config.teacher_top_k,
            teacher_cache_bytes=self.config.teacher_cache_mb << 20, loss=self.config.loss,
            teacher_control=self.config.teacher_control,
        )
        return BatchLoader(spec, self.config.workers)

    def pad_id(self) -> int:
        roles = self.student_vocab.roles
        for role in ("pad", "eos", "bos"):
            if role in roles:
                return int(roles[role])
        return 0

    def tables_for_teachers(self) -> list[tuple[str, str]]:
        """(student->teacher, teacher->student) table paths of each active teacher, from the aligned manifest."""
        out = []
        for teacher in self.teachers:
            tables = self.manifest.get("tables")
            entry = tables[teacher.index] if isinstance(tables, list) and teacher.index < len(tables) else None
            if not isinstance(entry, dict) or "student_to_teacher" not in entry:
                raise CsdError(f"aligned manifest of {self.aligned_dir} lists no tables for teacher {teacher.index}; "
                               f"re-run `{ALIGN_RERUN}`")
            s2t = self.aligned_dir / entry["student_to_teacher"]
            t2s = self.aligned_dir / entry["teacher_to_student"]
            for path in (s2t, t2s):
                if not path.is_file():
                    raise CsdError(f"table {path} listed by the aligned manifest is missing; re-run `{ALIGN_RERUN}`")
            out.append((str(s2t), str(t2s)))
        return out


def _open_teacher(directory: Path, aligned_dir: Path, aligned_manifest: dict) -> tuple[Path, dict, int]:
    """Read one teacher manifest and check it against the aligned data; returns (dir, manifest, index)."""
    from csd_pipeline.runtime.manifest import read_manifest, verify_shards

    manifest = read_manifest(directory, stage="teacher-logits")
    recorded = _find_key(manifest, ("aligned", "manifest_sha256"))
    actual = _sha256_file(aligned_dir / "manifest.json")
    if recorded != actual:
        raise CsdError(
            f"teacher top-k in {directory} was computed from another aligned directory than {aligned_dir} "
            f"(aligned manifest sha256 {str(recorded)[:12]} recorded, {actual[:12]} found); "
            f"re-run `{TEACHER_RERUN} --aligned {aligned_dir}`"
        )
    aligned_shards = [(s["name"], s["rows"]) for s in aligned_manifest["shards"]]
    teacher_shards = [(s["name"], s["rows"]) for s in manifest["shards"]]
    if aligned_shards != teacher_shards:
        raise CsdError(f"teacher top-k shards in {directory} are not co-partitioned with {aligned_dir}; "
                       f"re-run `{TEACHER_RERUN} --aligned {aligned_dir}`")
    problems = verify_shards(manifest, directory)
    if problems:
        raise CsdError(f"teacher top-k directory {directory}: {problems[0]}; re-run `{TEACHER_RERUN}` into it")
    index = _find_key(manifest, ("config", "teacher_index"))
    return directory, manifest, int(index or 0)


def _check_state(state: dict | None) -> dict:
    if state is None:
        return {"version": LOADER_STATE_VERSION, "epoch": 0, "position": 0}
    if state.get("version") != LOADER_STATE_VERSION:
        raise CsdError(f"the checkpoint's data-loader state has version {state.get('version')!r}, this trainer "
                       f"reads {LOADER_STATE_VERSION}; resume with the csd-train that wrote it or start a new --output")
    return state


# ---------------------------------------------------------------------------------------------
# The stream (runs in the data-loader workers)


@dataclass
class LoaderSpec:
    """Everything a loader worker needs (plain values, so it crosses process boundaries)."""

    aligned_dir: str
    shard_files: list[str]
    shard_rows: tuple[int, ...]
    teacher_dirs: list[str]
    teacher_shard_files: list[list[str]]
    teacher_indices: list[int]
    tables: list[tuple[str, str]]
    seed: int
    shuffle_block: int
    seq_len: int
    batch_size: int
    spelling: str
    only_1to1: bool
    rank: int
    world: int
    epoch: int
    position: int
    pad_id: int
    teacher_top_k: int = 0
    teacher_cache_bytes: int = 0  # decoded teacher blocks kept per worker, over all teachers and open shards
    loss: str = "csd"             # uld, gold, strict: per-chunk rows (ChunkRows) instead of CSD events
    teacher_control: str = "none"  # shuffled: the batch's teacher rows given to other positions


@dataclass
class _Window:
    shard: int
    row: int           # row within the shard
    length: int
    state_after: dict  # loader state once this window is consumed
    columns: dict      # this row's aligned values


def _aligned_columns(spec: LoaderSpec) -> list[str]:
    from schemas.aligned import teacher_columns

    columns = ["row_id", "student_ids", "student_loss_mask"]
    for index in spec.teacher_indices:
        columns += list(teacher_columns(index))
    return columns


class _ShardColumns:
    """One aligned shard's columns as flat numpy arrays + offsets (O(1) row access, no Python lists)."""

    def __init__(self, path: Path, columns: list[str]):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=columns)
        except (OSError, KeyError, pa.ArrowInvalid) as err:
            raise CsdError(f"cannot read aligned shard {path} ({str(err).splitlines()[0]}); "
                           f"re-run `{ALIGN_RERUN}`") from None
        self.lists: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.scalars: dict[str, list] = {}
        for name in columns:
            column = table.column(name).combine_chunks()
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                offsets = column.offsets.to_numpy()
                values = column.values.to_numpy(zero_copy_only=False)
                self.lists[name] = (values, offsets)
            else:
                self.scalars[name] = column.to_pylist()

    def row(self, i: int) -> dict:
        out = {name: values[i] for name, values in self.scalars.items()}
        for name, (values, offsets) in self.lists.items():
            out[name] = values[offsets[i]:offsets[i + 1]]
        return out


def _windows(spec: LoaderSpec):
    """This rank's windows in data order from (spec.epoch, spec.position), across epochs, forever."""
    columns = _aligned_columns(spec)
    epoch, start = spec.epoch, spec.position
    while True:
        plan = EpochPlan(spec.seed, epoch, spec.shard_rows, spec.shuffle_block)
        count = plan.rank_count(spec.rank, spec.world)
        offsets = plan.shard_offsets
        position = start
        for _, rows in plan.rank_rows(spec.rank, spec.world, start):
            shard_of = np.searchsorted(offsets, rows, side="right") - 1
            shards = {s: _ShardColumns(Path(spec.aligned_dir) / spec.shard_files[s], columns)
                      for s in np.unique(shard_of).tolist()}
            for global_row, shard in zip(rows.tolist(), shard_of.tolist(), strict=True):
                local = global_row - int(offsets[shard])
                row = shards[shard].row(local)
                position += 1
                after = ({"version": LOADER_STATE_VERSION, "epoch": epoch, "position": position}
                         if position < count else {"version": LOADER_STATE_VERSION, "epoch": epoch + 1, "position": 0})
                yield _Window(shard, local, len(row["student_ids"]), after, row)
        epoch, start = epoch + 1, 0


def _batch_plans(spec: LoaderSpec):
    """(batch index, windows, placements) in order; the packing plan only needs window lengths."""
    pending: deque = deque()
    source = _windows(spec)
    capacity = spec.batch_size * spec.seq_len
    index = 0
    while True:
        # enough windows that the plan stops on a window that does not fit (never on a short buffer)
        while sum(w.length for w in pending) <= capacity:
            window = next(source)
            check_window_length(window.length, spec.seq_len, window.columns["row_id"])
            pending.append(window)
        placements, used = plan_rows([w.length for w in pending], spec.seq_len, spec.batch_size)
        yield index, [pending.popleft() for _ in range(used)], placements
        index += 1


class _BatchBuilder:
    """Turns planned windows into a `MicroBatch` (tables and teacher shards loaded once per worker)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec
        self._contexts = None
        self._teacher_cache: dict[tuple[int, int], object] = {}

    def contexts(self):
        if self._contexts is None:
            from csd_pipeline.loss.events import EventContext
            from csd_pipeline.vocab.tables import load_table

            self._contexts = [
                EventContext(load_table(s2t), load_table(t2s), tables_name=str(Path(s2t).parent))
                for s2t, t2s in self.spec.tables
            ]
        return self._contexts

    def teacher_row(self, t: int, shard: int, row: int):
        from csd_pipeline.teacher.reader import read_teacher_shard

        key = (t, shard)
        if key not in self._teacher_cache:
            # a block spans at most `shuffle_block` shards: keep that many per teacher
            mine = [k for k in self._teacher_cache if k[0] == t]
            for old in mine[: max(0, len(mine) - self.spec.shuffle_block + 1)]:
                del self._teacher_cache[old]
            open_shards = min(self.spec.shuffle_block, len(self.spec.shard_files))
            share = self.spec.teacher_cache_bytes // (open_shards * len(self.spec.teacher_dirs))
            self._teacher_cache[key] = read_teacher_shard(
                Path(self.spec.teacher_dirs[t]), self.spec.teacher_shard_files[t][shard], cache_bytes=share
            )
        topk = self._teacher_cache[key][row]
        return keep_most_likely(topk, self.spec.teacher_top_k) if self.spec.teacher_top_k else topk

    def build(self, windows: list[_Window], placements) -> MicroBatch:
        from csd_pipeline.loss.events import build_row_events, ce_targets, collate_events, empty_events

        spec = self.spec
        packed = pack([w.columns["student_ids"] for w in windows], placements, spec.seq_len, spec.batch_size,
                      spec.pad_id)
        offsets = packed.flat_offsets
        ce_positions, ce_tokens = ce_targets([w.columns["student_ids"] for w in windows],
                                             [w.columns["student_loss_mask"] for w in windows], offsets)
        from csd_pipeline.loss import teacher_rows as baseline_rows

        baseline = spec.loss in baseline_rows.BASELINE_LOSSES
        teachers, shapes = [], []
        for t, index in enumerate(spec.teacher_indices):
            context = self.contexts()[t]
            topks = [self.teacher_row(t, w.shard, w.row) for w in windows]
            if spec.teacher_control == "shuffled":  # the same stored rows, at other positions of the batch
                first = windows[0].state_after
                rng = np.random.default_rng([spec.seed, spec.rank, t, first["epoch"], first["position"]])
                topks = baseline_rows.shuffle_teacher_rows(topks, rng)
            rows = []
            for w, topk in zip(windows, topks, strict=True):
                if not topk.ok:  # a rejected teacher row (non-finite values): CE only, counted
                    rows.append(baseline_rows.empty_chunk_rows(context, {"teacher_rows_rejected": 1}) if baseline
                                else empty_events({"teacher_rows_rejected": 1}))
                elif baseline:
                    rows.append(baseline_rows.build_row_chunks(w.columns, index, topk, context,
                                                               only_1to1=spec.only_1to1,
                                                               source=spec.shard_files[w.shard]))
                else:
                    rows.append(build_row_events(w.columns, index, topk, context, spelling=spec.spelling,
                                                 only_1to1=spec.only_1to1, source=spec.shard_files[w.shard]))
            events = (baseline_rows.collate_chunk_rows if baseline else collate_events)(rows, offsets)
            teachers.append(events)
            shapes.append(events.shape_counts())
        return MicroBatch(
            input_ids=packed.input_ids, position_ids=packed.position_ids, ce_positions=ce_positions,
            ce_tokens=ce_tokens, teachers=teachers, shape_counts=shapes, content_tokens=packed.content_tokens,
            padding_tokens=spec.batch_size * spec.seq_len - packed.content_tokens, windows=len(windows),
            state=dict(windows[-1].state_after),
        )


def keep_most_likely(topk, n: int):
    """The row with only its n most likely stored entries per position (all when n >= k).

    The stored entries are the teacher's k most likely ids, so their n most likely are exactly what a
    top-n capture would store (up to the encoding's quantisation).
    """
    from dataclasses import replace

    if not topk.ok or n >= topk.ids.shape[1]:
        return topk
    order = np.argsort(-topk.logprobs, axis=1, kind="stable")[:, :n]
    return replace(topk, ids=np.take_along_axis(topk.ids, order, axis=1),
                   logprobs=np.take_along_axis(topk.logprobs, order, axis=1))


@dataclass
class _LoaderError:
    """A `CsdError` raised in a worker, carried back as a value (the DataLoader would add a traceback)."""

    message: str


def stream_batches(spec: LoaderSpec, worker: int = 0, workers: int = 1):
    """Yield the `MicroBatch`es with index % workers == worker, in order."""
    builder = _BatchBuilder(spec)
    try:
        for index, windows, placements in _batch_plans(spec):
            if index % workers == worker:
                yield builder.build(windows, placements)
    except CsdError as err:
        yield _LoaderError(str(err))


class _Stream(torch.utils.data.IterableDataset):
    """The loader stream as a torch IterableDataset (worker w builds batches w, w+W, ...)."""

    def __init__(self, spec: LoaderSpec):
        self.spec = spec

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return stream_batches(self.spec, worker, workers)


def _identity(batch):
    return batch


class BatchLoader:
    """Iterator of `MicroBatch`es; `workers` > 0 builds them in that many worker processes."""

    def __init__(self, spec: LoaderSpec, workers: int):
        self.spec = spec
        if workers == 0:
            self._iter = stream_batches(spec)
            self._loader = None
        else:
            self._loader = torch.utils.data.DataLoader(
                _Stream(spec), batch_size=None, num_workers=workers, collate_fn=_identity,
                prefetch_factor=4, persistent_workers=False,
            )
            self._iter = iter(self._loader)

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        batch = next(self._iter)
        if isinstance(batch, _LoaderError):
            raise CsdError(batch.message)
        return batch

    def close(self) -> None:
        """Stop the worker processes."""
        shutdown = getattr(self._iter, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iter = iter(())
