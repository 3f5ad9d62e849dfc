"""The checked inputs of a training run: aligned + teacher top-k outputs and the student tokenizer.

`TrainingData.open(config)` opens the aligned output (`AlignedOutput`) and each teacher top-k
output (`TeacherTopkOutput`), which read their manifests (never a glob), and checks them against
each other (a teacher output records the sha256 of the aligned manifest it was computed from, or of
the capture the aligned output was aligned against (docs/CAPTURE.md), and the shards are co-partitioned) and against the student tokenizer (fingerprint). Any mismatch
raises `CsdError` naming the stage to re-run. `TrainingData.loader(rank, world, state)` is this
rank's stream of micro-batches (`trainer/loader.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.align.output import ALIGN_RERUN, AlignedOutput
from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.reader import TEACHER_RERUN, TeacherTopkOutput

# 2: each rank reads its own span of shards in lanes (trainer/shuffle.py). 1 (every rank took every
# w-th row of each block) is refused: its positions mean other rows in the new order.
LOADER_STATE_VERSION = 2


def lane_state(epoch: int, position: int) -> dict:
    """One lane's part of the loader state: its epoch and the rows of that epoch it has consumed."""
    return {"epoch": epoch, "position": position}


def rank_state(lanes: list[dict], next_lane: int) -> dict:
    """A rank's loader state: each lane's {"epoch", "position"}, the lane that supplies the next
    micro-batch, and "epoch", the earliest lane's epoch (the one the metrics report)."""
    return {"version": LOADER_STATE_VERSION, "epoch": min(lane["epoch"] for lane in lanes),
            "lanes": [dict(lane) for lane in lanes], "next_lane": next_lane}


@dataclass
class TeacherSource:
    """One active teacher: its top-k output, its index in the aligned rows and its KD weight."""

    index: int
    output: TeacherTopkOutput
    weight: float


class TrainingData:
    """The checked inputs of a run and the factory of its loader."""

    def __init__(self, config, aligned: AlignedOutput, student_bundle, tokenizer_source: str,
                 teachers: list[TeacherSource], loss):
        self.config = config
        self.loss = loss  # the run's `csd_pipeline.loss.training.TrainingLoss`
        self.aligned = aligned
        self.student_bundle = student_bundle
        self.student_vocab = student_bundle.vocab
        self.student_tokenizer = tokenizer_source
        self.teachers = teachers

    @property
    def teacher_weights(self) -> list[float]:
        return [t.weight for t in self.teachers]

    @classmethod
    def open(cls, config) -> TrainingData:
        """Open and cross-check `--aligned`, `--teacher-logits` and the student tokenizer (a `TrainConfig`)."""
        from csd_pipeline.vocab.vocabulary import load_tokenizer
        from trainer.model import student_tokenizer_source

        aligned = AlignedOutput.open(config.data.aligned)
        aligned.require_student("--aligned")
        aligned.verify()
        max_student = aligned.max_student_tokens
        if max_student is not None and max_student > config.data.seq_len:
            raise CsdError(
                f"{aligned.directory} was aligned with --max-student-tokens {max_student}, more than --seq-len "
                f"{config.data.seq_len}, so a window may not fit a packed row; raise --seq-len to {max_student} or re-run "
                f"`{ALIGN_RERUN}` with --max-student-tokens <= {config.data.seq_len}"
            )
        tokenizer_source = student_tokenizer_source(config.student)
        bundle = load_tokenizer(tokenizer_source, trust_remote_code=config.student.trust_remote_code)
        aligned.require_tokenizer("student", bundle.vocab.fingerprint)
        if aligned.total_rows == 0:
            raise CsdError(f"aligned directory {aligned.directory} holds no rows; align a non-empty corpus with "
                           f"`{ALIGN_RERUN}`")
        loss = config.loss.build()
        teachers = _open_teachers(config, aligned, loss) if loss.uses_teachers else []
        for teacher in teachers:
            aligned.tables(teacher.index)  # every table matches the aligned tokenizers, before training starts
        return cls(config, aligned, bundle, tokenizer_source, teachers, loss)

    def loader(self, rank: int, world: int, state: dict | None):
        """This rank's endless stream of `MicroBatch`es, from loader `state` (None: the start)."""
        from trainer.loader import BatchLoader, LoaderSpec

        total = self.aligned.total_rows
        if total < world:
            raise CsdError(f"aligned directory {self.aligned.directory} has {total} rows, fewer than the {world} ranks; "
                           "align more text or use fewer ranks")
        from trainer.shuffle import lanes_per_rank

        lanes = lanes_per_rank(total, world, self.config.data.data_lanes)
        state = _check_state(state, lanes)
        data, loss = self.config.data, self.config.loss
        spec = LoaderSpec(
            aligned=self.aligned, teachers=[t.output for t in self.teachers],
            teacher_indices=[t.index for t in self.teachers],
            tables=[tuple(str(p) for p in self.aligned.tables(t.index)) for t in self.teachers],
            seed=self.config.seed, shuffle_block=data.shuffle_block, seq_len=data.seq_len,
            batch_size=data.batch_size, loss=self.loss,
            rank=rank, world=world, lanes=lanes, lane_states=state["lanes"], next_lane=state["next_lane"], pad_id=self.pad_id(),
            teacher_top_k=loss.teacher_top_k, teacher_cache_bytes=data.teacher_cache_mb << 20,
            teacher_control=loss.teacher_control,
        )
        return BatchLoader(spec, data.workers)

    def pad_id(self) -> int:
        roles = self.student_vocab.roles
        for role in ("pad", "eos", "bos"):
            if role in roles:
                return int(roles[role])
        return 0


def _open_teachers(config, aligned: AlignedOutput, loss) -> list[TeacherSource]:
    """The active teachers of `--teacher-logits` / `--kd-teachers`, each checked against the aligned data."""
    by_index: dict[int, TeacherTopkOutput] = {}
    for directory in config.data.teacher_logits:
        output = TeacherTopkOutput.open(directory)
        output.verify()  # its own consistency first: then a mismatch below is between the stages
        output.check_pairs_with(aligned)
        index = output.teacher_index
        if index in by_index:
            raise CsdError(f"--teacher-logits {by_index[index].directory} and {output.directory} are both teacher "
                           f"{index}; pass one directory per teacher")
        if aligned.num_teachers and index >= aligned.num_teachers:
            raise CsdError(f"--teacher-logits {output.directory} is teacher {index} but {aligned.directory} aligns "
                           f"{aligned.num_teachers} teacher(s); re-run `{TEACHER_RERUN}` with the right --teacher-index")
        by_index[index] = output
    teachers = []
    for index, weight in sorted(config.teacher_weights().items()):
        if index not in by_index:
            raise CsdError(f"--kd-teachers names teacher {index} but no --teacher-logits directory holds it "
                           f"(given: {sorted(by_index)}); add its directory or drop it from --kd-teachers")
        if weight > 0:
            _check_top_k(config.loss.teacher_top_k, by_index[index])
            loss.check_teacher(aligned, by_index[index])
            teachers.append(TeacherSource(index, by_index[index], weight))
    return teachers


def _check_top_k(wanted: int, output: TeacherTopkOutput) -> None:
    """`--teacher-top-k` may not ask for more entries than the teacher output stores."""
    stored = (output.manifest.get("config") or {}).get("top_k")
    if wanted:
        output.require_exact(f"--teacher-top-k {wanted}", f"pass --teacher-top-k 0 (all), or re-run `{TEACHER_RERUN}` "
                                                          "with the --top-k you want")
    if wanted and stored is not None and wanted > int(stored):
        raise CsdError(f"--teacher-top-k {wanted} is more than the {stored} entries per position stored in "
                       f"{output.directory}; pass at most {stored} (0: all), or re-run `{TEACHER_RERUN}` with --top-k {wanted}")


def _check_state(state: dict | None, lanes: int) -> dict:
    """The loader state to start from (None: the start), checked against this run's `lanes` per rank."""
    if state is None:
        return rank_state([lane_state(0, 0)] * lanes, 0)
    version = state.get("version")
    if version == 1:
        raise CsdError("the checkpoint's data-loader state has version 1 (every rank read every shard and took every "
                       f"w-th row), this trainer reads version {LOADER_STATE_VERSION} (each rank reads its own span of "
                       "shards), so its position names other rows; resume with the csd-train that wrote it, or start a "
                       "new --output from its weights")
    if version != LOADER_STATE_VERSION:
        raise CsdError(f"the checkpoint's data-loader state has version {version!r}, this trainer "
                       f"reads {LOADER_STATE_VERSION}; resume with the csd-train that wrote it or start a new --output")
    if len(state.get("lanes", [])) != lanes or not 0 <= state.get("next_lane", -1) < lanes:
        raise CsdError(f"the checkpoint's data-loader state has {len(state.get('lanes', []))} lanes per rank, this run "
                       f"has {lanes}; resume with the --data-lanes (and data) the checkpoint was written with")
    return state
