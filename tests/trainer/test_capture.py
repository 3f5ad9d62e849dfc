"""csd-train from one shared teacher capture: on the same windows, the same losses as from a capture made for the
student alone; any other pairing of aligned rows and teacher store is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csd_pipeline.errors import CsdError
from tests.trainer_cases import STUDENT_CONFIG, metrics

DATA = Path(__file__).resolve().parent.parent / "data"
WINDOW = 256  # every blank-line block of devil-slice.txt fits in one window of either tokenizer


@pytest.fixture(scope="module")
def shared_and_own(tokenizer_path, tables_for, tmp_path_factory, one_thread):
    """{"capture", "capture_store", "against", "own", "own_store", "student_config"}: the devil slice captured once
    (SmolLM2 tokenizer) with a tiny random teacher's top-k, a llama-spm student aligned against it, and the
    same student's normal align with its own teacher-logits run."""
    from csd_pipeline.align.stage import AlignConfig, run_align
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from tests.teacher.test_stage import make_tiny_teacher

    root = tmp_path_factory.mktemp("capture-train")
    teacher = make_tiny_teacher(root / "tiny-teacher", tokenizer_path("smollm2"))
    corpus = str(DATA / "devil-slice.txt")
    common = {"output": None, "split_on_blank_lines": True, "shard_bytes": 4000}
    paths = {name: root / name for name in ("capture", "capture_store", "against", "own", "own_store")}
    run_align(AlignConfig(**{**common, "output": str(paths["capture"])}, corpus=[corpus], capture_only=True,
                          teacher_tokenizers=[str(tokenizer_path("smollm2"))], max_teacher_tokens=[WINDOW]))
    tables = [tables_for("llama-spm", "smollm2")]
    run_align(AlignConfig(against_capture=str(paths["capture"]), student_tokenizer=str(tokenizer_path("llama-spm")),
                          output=str(paths["against"]), max_student_tokens=WINDOW, tables=tables))
    run_align(AlignConfig(**{**common, "output": str(paths["own"])}, corpus=[corpus], tables=tables,
                          student_tokenizer=str(tokenizer_path("llama-spm")),
                          teacher_tokenizers=[str(tokenizer_path("smollm2"))], max_student_tokens=WINDOW,
                          max_teacher_tokens=[WINDOW]))
    for aligned, store in (("capture", "capture_store"), ("own", "own_store")):
        run_teacher_logits(TeacherLogitsConfig(aligned=str(paths[aligned]), teacher=str(teacher), top_k=8, device="cpu",
                                               output=str(paths[store]), batch_tokens=512))
    paths["student_config"] = root / "student.json"
    paths["student_config"].write_text(json.dumps(STUDENT_CONFIG))
    return paths


def train_args(paths: dict, aligned: str, store: str, output: Path, *extra: str) -> list[str]:
    return ["--aligned", str(paths[aligned]), "--teacher-logits", str(paths[store]), "--student-config",
            str(paths["student_config"]), "--student-tokenizer", "llama-spm", "--output", str(output), "--steps", "3",
            "--seq-len", str(WINDOW), "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "0",
            "--workers", "0", "--no-progress", *extra]


def parquet_rows(directory: Path) -> list[dict]:
    import pyarrow.parquet as pq

    manifest = json.loads((directory / "manifest.json").read_text())
    return [row for shard in manifest["shards"] for row in pq.read_table(directory / shard["file"]).to_pylist()]


@pytest.mark.slow  # trains two students: a few seconds, the fast tier's budget is 90 s
def test_the_shared_capture_trains_a_student_as_its_own_capture_does(shared_and_own, tmp_path):
    from trainer.loop import train
    from trainer.options import parse_args

    paths = shared_and_own
    assert parquet_rows(paths["against"]) == parquet_rows(paths["own"])  # the same windows, so the same rows
    losses = {}
    for aligned, store in (("against", "capture_store"), ("own", "own_store")):
        train(parse_args(train_args(paths, aligned, store, tmp_path / aligned)))
        losses[aligned] = [row[key] for row in metrics(tmp_path / aligned) for key in ("loss", "ce", "kd")]
    assert len(losses["own"]) == 9 and losses["own"][2] > 0
    assert losses["against"] == pytest.approx(losses["own"], rel=1e-6, abs=1e-7)


def test_other_pairings_are_refused_in_one_line(shared_and_own, tmp_path):
    from trainer.data import TrainingData
    from trainer.options import parse_args

    paths = shared_and_own
    for aligned, store, words in (("against", "own_store", "not computed from the capture"),
                                  ("own", "capture_store", "computed from another aligned directory"),
                                  ("capture", "capture_store", r"is a teacher capture \(no student\)")):
        with pytest.raises(CsdError, match=words) as err:
            TrainingData.open(parse_args(train_args(paths, aligned, store, tmp_path / "run")))
        assert "\n" not in str(err.value) and str(paths[aligned]) in str(err.value)


def test_teacher_logits_runs_over_a_capture_with_every_selector_but_csd_events(shared_and_own, tmp_path):
    """The capture's store holds the rows of the student's own store (same windows, same teacher ids); the
    selectors that need no student run over a capture, --keep csd-events (which reads a student's chunks) is refused."""
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from csd_pipeline.teacher.store.reader import read_teacher_topk

    paths = shared_and_own
    for ours, theirs in zip(read_teacher_topk(paths["capture_store"]), read_teacher_topk(paths["own_store"]), strict=True):
        assert ours.row_id == theirs.row_id and (ours.ids == theirs.ids).all()
        assert (ours.logprobs == theirs.logprobs).all()
    teacher = str(paths["capture"].parent / "tiny-teacher")
    base = {"aligned": str(paths["capture"]), "teacher": teacher, "device": "cpu", "batch_tokens": 512}
    run_teacher_logits(TeacherLogitsConfig(**base, output=str(tmp_path / "selected"), top_k=16, top_p=0.9, min_p=0.01,
                                           tail_samples=4))
    assert sum(1 for _ in read_teacher_topk(tmp_path / "selected")) == sum(1 for _ in read_teacher_topk(paths["capture_store"]))
    with pytest.raises(CsdError, match="is a teacher capture") as err:
        run_teacher_logits(TeacherLogitsConfig(**base, output=str(tmp_path / "events"), top_k=8, keep="csd-events"))
    assert "\n" not in str(err.value)
