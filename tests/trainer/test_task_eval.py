"""csd-train --eval-tasks: lm-evaluation-harness runs on the export during training and at the end; its scores
(checked against a float64 count on the exports themselves) go to eval_tasks.jsonl, the trackers and the report."""

from __future__ import annotations

import json
import math

import pytest

from csd_pipeline.errors import CsdError
from trainer.options import parse_args

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TASK = "csd_next_sentence_devil"
LIMIT = 8


def run_args(data, output, *extra):
    return ["--aligned", str(data["train"]), "--student-config", str(data["student_config"]),
            "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "2",
            "--seq-len", "128", "--batch-size", "1", "--lr", "3e-3", "--warmup-steps", "1", "--save-every", "0",
            "--workers", "0", "--no-progress", "--device", "cpu", *extra]


@pytest.mark.parametrize("extra, fragment", [
    (["--eval-tasks-every", "2"], "need --eval-tasks"),
    (["--eval-tasks-limit", "5"], "need --eval-tasks"),
    (["--eval-tasks", TASK, "--eval-tasks-include-path", "/no/such/folder"], "--eval-tasks-include-path /no/such"),
    (["--eval-tasks", TASK, "--eval-tasks-every", "-1"], "--eval-tasks-every must be 0 or more"),
])
def test_task_options_are_checked_before_the_run(tmp_path, extra, fragment):
    with pytest.raises(CsdError, match=fragment.replace("/", ".")):
        parse_args(["--aligned", str(tmp_path), "--student-config", "s.json", "--student-tokenizer", "llama-spm",
                    "--output", str(tmp_path / "run"), "--loss", "ce", *extra])


def test_tasks_are_refused_for_an_object_store_output(tmp_path):
    with pytest.raises(CsdError, match="--eval-tasks runs the harness on a local export, but --output s3://bucket/run"):
        parse_args(["--aligned", str(tmp_path), "--student-config", "s.json", "--student-tokenizer", "llama-spm",
                    "--output", "s3://bucket/run", "--loss", "ce", "--eval-tasks", TASK])


@pytest.mark.slow   # two harness processes on a 2-layer student: about 20 s
def test_tasks_run_on_the_exports_and_reach_the_metrics_trackers_and_report(trainer_data, tmp_path, monkeypatch,
                                                                          one_thread):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'csd-pipeline[eval]')")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from csd_pipeline.evaluation import next_sentence as ns
    from csd_pipeline.report.render import write_report
    from tests.evaluation.test_harness import float64_model, reference_accuracy
    from trainer.loop import train

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    output = tmp_path / "run"
    train(parse_args(run_args(trainer_data, output, "--eval-tasks", TASK, "--eval-tasks-every", "1",
                              "--eval-tasks-limit", str(LIMIT), "--eval-aligned", str(trainer_data["eval"]),
                              "--eval-max-rows", "2", "--report-to", "jsonl,tensorboard")))
    records = [json.loads(line) for line in (output / "eval_tasks.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    items = [json.loads(line) for line in (ns.TASK_DIR / "devil.jsonl").read_text().splitlines()][:LIMIT]
    # step 1 was scored on the scratch export (written for it), step 2 on the final one
    for record, export in zip(records, (output / "export-eval-tasks", output / "export"), strict=True):
        acc, acc_norm = reference_accuracy(*float64_model(export), items)
        assert (record[f"eval/{TASK}/acc"], record[f"eval/{TASK}/acc_norm"]) == pytest.approx((acc, acc_norm))
        assert record[f"eval/{TASK}/acc_stderr"] == pytest.approx(math.sqrt(acc * (1 - acc) / (LIMIT - 1)))
        harness = json.loads((output / "eval-tasks" / f"step-{record['step']:08d}.json").read_text())
        assert harness["csd_pipeline"]["model_path"] == str(export) and harness["csd_pipeline"]["limit"] == LIMIT
    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    scalars = events.Scalars(f"eval/{TASK}/acc_norm")
    assert [e.step for e in scalars] == [1, 2]
    assert [e.value for e in scalars] == pytest.approx([r[f"eval/{TASK}/acc_norm"] for r in records])
    report = write_report([output], tmp_path / "report").read_text()
    bits = json.loads((output / "eval.jsonl").read_text().splitlines()[-1])["bits_per_byte"]
    last = records[-1]
    row = (f"| run | `{TASK}` | 2 | {last[f'eval/{TASK}/acc']:.3f} ± {last[f'eval/{TASK}/acc_stderr']:.3f} | "
           f"{last[f'eval/{TASK}/acc_norm']:.3f} ± {last[f'eval/{TASK}/acc_norm_stderr']:.3f} | {bits:.4f} |")
    assert row in report, report
    assert (tmp_path / "report" / "training-tasks.png").is_file()
