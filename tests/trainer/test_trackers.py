"""csd-train --report-to: TensorBoard's event file and W&B's offline run hold the metrics under the names
TRL and HF Trainer users know; metrics.jsonl keeps its own keys; a tracker that is not installed is one error."""

from __future__ import annotations

import json

import pytest

from csd_pipeline.errors import CsdError
from tests.trainer_cases import metrics
from trainer.loop import train
from trainer.options import parse_args

TRAIN_NAMES = ("train/loss", "train/ce_loss", "train/kd_loss", "train/learning_rate", "train/grad_norm",
               "train/tokens_per_second", "train/epoch")


def run_args(data, output, *extra):
    return ["--aligned", str(data["train"]), "--student-config", str(data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "2",
            "--seq-len", "128", "--batch-size", "1", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "0",
            "--workers", "0", "--no-progress", "--eval-aligned", str(data["eval"]), "--eval-max-rows", "2", *extra]


def test_tensorboard_event_file_holds_the_metrics(trainer_data, tmp_path, one_thread):
    pytest.importorskip("tensorboard")  # an optional extra: `pip install 'csd-pipeline[tensorboard]'`
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output = tmp_path / "run"
    train(parse_args(run_args(trainer_data, output, "--report-to", "jsonl,tensorboard")))
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert set(TRAIN_NAMES) | {"eval/bits_per_byte"} <= tags, tags
    rows = metrics(output)
    assert sorted(rows[0]) == sorted(metrics_keys(rows[0]))  # metrics.jsonl keeps its keys
    for key, name in (("loss", "train/loss"), ("lr", "train/learning_rate"), ("ce", "train/ce_loss")):
        assert [e.step for e in events.Scalars(name)] == [r["step"] for r in rows]
        assert [e.value for e in events.Scalars(name)] == pytest.approx([r[key] for r in rows], rel=1e-6)
    evaluation = json.loads((output / "eval.jsonl").read_text().splitlines()[-1])
    assert events.Scalars("eval/bits_per_byte")[-1].value == pytest.approx(evaluation["bits_per_byte"], rel=1e-6)


def metrics_keys(row: dict) -> list[str]:
    """The keys docs/TRAINING.md lists for metrics.jsonl (a CE run with one teacher slot)."""
    return [k for k in row if k in {
        "step", "loss", "ce", "kd", "kd_scale", "lr", "grad_norm", "tokens", "ce_tokens", "padding_tokens",
        "aligned_rows", "supervised_tokens_per_row", "chunks_1to1", "chunks_1toN", "chunks_Mto1", "chunks_MtoN",
        "skipped", "nonfinite_skipped", "epoch", "tokens_per_s", "step_time_s", "data_wait_s", "elapsed_s"}]


def wandb_records(path):
    """The protobuf records of a W&B transaction log (`run-ID.wandb`: a 7-byte header, then LevelDB-style
    32 KiB blocks of records, each a 7-byte header (crc32c, length, type: full, first, middle, last))."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at the end of a block
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_wandb_offline_run_holds_the_metrics(trainer_data, tmp_path, monkeypatch, one_thread):
    pytest.importorskip("wandb")  # an optional extra: `pip install 'csd-pipeline[wandb]'`
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    output = tmp_path / "run"
    args = run_args(trainer_data, output, "--report-to", "jsonl,wandb", "--save-every", "1")
    train(parse_args(args + ["stop_at_step=1"]))
    train(parse_args(args + ["--resume"]))  # continues the same W&B run (offline: a second folder, same id)
    import wandb

    wandb.teardown()  # the W&B service writes the run's log asynchronously: stop it so that every record is on disk
    logs = sorted((output / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and logs[0].name == logs[1].name, list((output / "wandb").iterdir())
    history, config = [], set()
    for log in logs:
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
            elif kind == "run":
                config |= {item.key for item in record.run.config.update}
    train_rows = [h for h in history if "train/loss" in h]
    assert all(set(TRAIN_NAMES) <= set(h) for h in train_rows)
    rows = metrics(output)
    assert [(h["train/global_step"], h["train/loss"]) for h in train_rows] == [(r["step"], r["loss"]) for r in rows]
    evaluation = json.loads((output / "eval.jsonl").read_text().splitlines()[-1])
    assert [(h["train/global_step"], h["eval/bits_per_byte"]) for h in history if "eval/bits_per_byte" in h] == [
        (2, evaluation["bits_per_byte"])]
    assert {"seq_len", "lr", "loss", "report_to"} <= config
    assert (output / "wandb-run-id.txt").read_text().strip() == logs[0].stem.removeprefix("run-")


def test_a_tracker_that_is_not_installed_is_one_error_naming_the_extra(trainer_data, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(CsdError, match=r"--report-to wandb needs the wandb package.*pip install 'csd-pipeline\[wandb\]'"):
        parse_args(run_args(trainer_data, tmp_path / "run", "--report-to", "tensorboard,wandb"))
    with pytest.raises(CsdError, match="--report-to 'mlflow' is not a reporter"):
        parse_args(run_args(trainer_data, tmp_path / "run", "--report-to", "mlflow"))
    assert parse_args(run_args(trainer_data, tmp_path / "run")).report_to == ["jsonl"]


def test_wandb_settings_of_the_user_win_over_the_run_folder(trainer_data, tmp_path, monkeypatch, one_thread):
    """WANDB_DIR, WANDB_PROJECT and WANDB_NAME, when set, decide where the run goes and what it is called."""
    pytest.importorskip("wandb")
    elsewhere = tmp_path / "wandb-home"
    elsewhere.mkdir()
    for key, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_DIR", str(elsewhere)),
                       ("WANDB_PROJECT", "my-project"), ("WANDB_NAME", "my-run")):
        monkeypatch.setenv(key, value)
    output = tmp_path / "run"
    train(parse_args(run_args(trainer_data, output, "--report-to", "jsonl,wandb", "--steps", "1")))
    import wandb

    wandb.teardown()
    assert not (output / "wandb").exists()
    logs = sorted(elsewhere.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, list(elsewhere.rglob("*"))
    runs = [r.run for r in wandb_records(logs[0]) if r.WhichOneof("record_type") == "run"]
    assert (runs[0].project, runs[0].display_name) == ("my-project", "my-run")
    assert (output / "wandb-run-id.txt").read_text().strip() == logs[0].stem.removeprefix("run-")


def test_wandb_init_args_leave_each_set_variable_to_wandb(tmp_path):
    from trainer.trackers import wandb_init_args

    run = tmp_path / "run"
    assert wandb_init_args(run, None, {}) == {"dir": str(run), "project": "csd-pipeline", "name": "run"}
    assert wandb_init_args(run, "abc", {}) == {"dir": str(run), "project": "csd-pipeline", "name": "run",
                                               "id": "abc", "resume": "allow"}
    every = {"WANDB_DIR": "/x", "WANDB_PROJECT": "p", "WANDB_NAME": "n", "WANDB_RUN_ID": "r"}
    assert wandb_init_args(run, "abc", every) == {}
    assert wandb_init_args(run, None, {"WANDB_DIR": ""})["dir"] == str(run)  # an empty variable counts as unset
