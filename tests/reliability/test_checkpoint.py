"""A checkpoint cannot run code (issue 16, item 1), and a kill during a checkpoint resumes to the same
losses (item 6).

DCP's `.metadata` is a pickle and its non-tensor values are `torch.save` pickles. A planted pickle
whose `__reduce__` would create a marker file is refused, in one line, by each guard of
`trainer.checkpoint_guard` on its own: the sha256 recorded in complete.json, the unpickler that admits
only DCP's classes (also for checkpoints written before the hash was recorded), and
`weights_only=True` for the values inside `.distcp` files."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest
import torch

from csd_pipeline.errors import CsdError
from tests.reliability.cases import run
from trainer import checkpoint, checkpoint_guard
from trainer.loop import train
from trainer.options import parse_args


class PlantedCommand:
    """Unpickling this runs `touch MARKER` (what an attacker's checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def args(data, output, *extra):
    return ["--aligned", str(data["eval"]), "--student-config", str(data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "2",
            "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "1",
            "--save-total-limit", "1", "--workers", "0", "--no-progress", *extra]


@pytest.fixture(scope="module")
def written(trainer_data, tmp_path_factory):
    """A run of 2 steps with its complete checkpoint step-2."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    output = tmp_path_factory.mktemp("checkpointed") / "run"
    train(parse_args(args(trainer_data, output)))
    torch.set_num_threads(before)
    return output


@pytest.fixture
def copy(written, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(written, target)
    return target


def resume(data, output):
    train(parse_args(args(data, output, "--resume", "steps=3")))


def plant(folder, marker, *, rehash: bool = False, drop_hash: bool = False) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(PlantedCommand(marker)))
    complete = json.loads((folder / checkpoint.COMPLETE_FILE).read_text())
    if rehash:  # an attacker who also edits complete.json
        complete[checkpoint_guard.HASH_KEY] = checkpoint_guard.metadata_sha256(folder)
    if drop_hash:  # a checkpoint written before the hash was recorded
        complete.pop(checkpoint_guard.HASH_KEY)
    (folder / checkpoint.COMPLETE_FILE).write_text(json.dumps(complete))


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_the_completion_record_holds_the_metadata_sha256(written):
    folder = written / "checkpoints" / "step-2"
    complete = json.loads((folder / checkpoint.COMPLETE_FILE).read_text())
    assert complete[checkpoint_guard.HASH_KEY] == checkpoint_guard.metadata_sha256(folder)


def test_planted_metadata_is_refused_by_its_recorded_sha256(trainer_data, copy, tmp_path):
    marker = tmp_path / "ran"
    plant(copy / "checkpoints" / "step-2", marker)
    with pytest.raises(CsdError) as err:
        resume(trainer_data, copy)
    assert "does not have the sha256 recorded in complete.json" in one_line(err)
    assert "delete" in one_line(err) and "step-2" in one_line(err)
    assert not marker.exists()


def test_planted_metadata_with_a_forged_hash_is_refused_by_the_unpickler(trainer_data, copy, tmp_path):
    marker = tmp_path / "ran"
    plant(copy / "checkpoints" / "step-2", marker, rehash=True)
    with pytest.raises(CsdError) as err:
        resume(trainer_data, copy)
    assert "asks to load posix.system, which DCP never writes there" in one_line(err)
    assert not marker.exists()


def test_old_checkpoint_without_a_hash_is_read_through_the_unpickler(trainer_data, written, copy, tmp_path):
    # accepted: the restricted unpickler, not the hash, is what stops code from running
    complete_file = copy / "checkpoints" / "step-2" / checkpoint.COMPLETE_FILE
    complete = json.loads(complete_file.read_text())
    complete.pop(checkpoint_guard.HASH_KEY)
    complete_file.write_text(json.dumps(complete))
    resume(trainer_data, copy)
    assert [s for s, _ in checkpoint.complete_checkpoints(copy)] == [3]
    # ... and the same old checkpoint with a planted pickle is refused
    old = tmp_path / "old"
    shutil.copytree(written, old)
    marker = tmp_path / "ran"
    plant(old / "checkpoints" / "step-2", marker, drop_hash=True)
    with pytest.raises(CsdError, match="asks to load posix.system"):
        resume(trainer_data, old)
    assert not marker.exists()


@pytest.mark.parametrize("process", ["in-process", pytest.param("subprocess", marks=pytest.mark.slow)])
def test_the_cli_prints_one_error_line_and_runs_nothing(trainer_data, copy, tmp_path, capsys, process):
    """`csd-train` (`main` here, or `python -m trainer.main`) on a planted checkpoint: exit 2, one line."""
    from trainer.main import main

    marker = tmp_path / "ran"
    plant(copy / "checkpoints" / "step-2", marker)
    argv = args(trainer_data, copy, "--resume", "steps=3")
    if process == "subprocess":
        result = run("trainer.main", *argv)
        code, stderr = result.returncode, result.stderr
    else:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        code, stderr = exit_.value.code, capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: checkpoint "), stderr
    assert not marker.exists()


def test_storage_file_outside_the_checkpoint_is_refused(trainer_data, copy):
    folder = copy / "checkpoints" / "step-2"
    metadata = checkpoint_guard.read_checked_metadata(folder, {})
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../../../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    plant_hash = json.loads((folder / checkpoint.COMPLETE_FILE).read_text())
    plant_hash[checkpoint_guard.HASH_KEY] = checkpoint_guard.metadata_sha256(folder)
    (folder / checkpoint.COMPLETE_FILE).write_text(json.dumps(plant_hash))
    with pytest.raises(CsdError, match="names a storage file '../../../elsewhere.distcp', which leads outside"):
        resume(trainer_data, copy)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pickled_value_inside_a_distcp_file_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "planted"
    marker = tmp_path / "ran"
    dcp.save({"weight": torch.ones(3), "hyper": PlantedCommand(marker)}, checkpoint_id=str(folder), no_dist=True)
    assert not marker.exists()
    metadata = checkpoint_guard.read_checked_metadata(folder, {})  # the index itself is DCP's own
    state = {"weight": torch.zeros(3), "hyper": None}
    with pytest.raises(CsdError) as err:
        checkpoint_guard.guarded_load(state, folder, metadata)
    assert "value hyper is not plain data" in one_line(err)
    assert not marker.exists()
    # plain values still load
    plain = tmp_path / "plain"
    dcp.save({"weight": torch.ones(3), "lr": 0.1, "name": "adamw"}, checkpoint_id=str(plain), no_dist=True)
    state = {"weight": torch.zeros(3), "lr": None, "name": None}
    checkpoint_guard.guarded_load(state, plain, checkpoint_guard.read_checked_metadata(plain, {}))
    assert state["lr"] == 0.1 and state["name"] == "adamw"
    assert torch.equal(state["weight"], torch.ones(3))


def test_a_failed_dcp_write_is_caught_although_it_is_a_base_exception(trainer_data, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    real_save = dcp.save

    def full_disk(state, checkpoint_id):
        if checkpoint_id.endswith("step-2.tmp"):
            raise CheckpointException("save failed", {0: (OSError(28, "No space left on device"), None)})
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(dcp, "save", full_disk)
    output = tmp_path / "run"
    with pytest.raises(CsdError) as err:
        train(parse_args(args(trainer_data, output, "--save-total-limit", "2")))
    assert "step-2 failed (OSError: [Errno 28] No space left on device" in one_line(err)
    assert "step-1 is intact" in one_line(err)
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-1"]


def _losses(output) -> list[dict]:
    with open(output / "metrics.jsonl", encoding="utf-8") as handle:
        return [{k: r[k] for k in ("step", "loss", "ce", "lr", "grad_norm", "tokens")} for r in map(json.loads, handle)]


@pytest.fixture(scope="module")
def three_steps(trainer_data, tmp_path_factory, one_thread):
    """The losses of an uninterrupted 3-step run, in this process with one torch thread (the killed runs'
    processes have OMP_NUM_THREADS=1: the same reduction order, so the same bits)."""
    reference = tmp_path_factory.mktemp("three-steps") / "run"
    train(parse_args(args(trainer_data, reference, "steps=3")))
    return _losses(reference)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["checkpoint_written", "checkpoint_complete"])
def test_kill_during_a_checkpoint_resumes_to_the_same_losses(trainer_data, three_steps, tmp_path, point, one_thread):
    """The killed run is a process of its own; the resume runs here, with one torch thread as the reference."""
    out = tmp_path / "killed"
    killed = run("trainer.main", *args(trainer_data, out, "steps=3"), env={checkpoint.CRASH_ENV: f"{point}:2"})
    assert killed.returncode == -9
    assert [s for s, _ in checkpoint.complete_checkpoints(out)] == [1]
    assert (out / "checkpoints" / "step-2.tmp").is_dir()  # the checkpoint being written when the kill came
    train(parse_args(args(trainer_data, out, "steps=3", "--resume")))
    assert _losses(out) == three_steps and len(three_steps) == 3
    assert not list((out / "checkpoints").glob("*.tmp"))
