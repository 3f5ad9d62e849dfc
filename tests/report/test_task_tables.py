"""`csd-pipeline report` on runs scored on tasks with different metrics (accuracy, bits per byte): one table per
set of metrics, each task with its own columns and the harness's standard error where it gave one."""

from __future__ import annotations

import json

from csd_pipeline.report.render import write_report

NEXT, HELDOUT = "csd_next_sentence", "csd_heldout_devil"


def _run(folder, acc: float, passage_bits: float):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "ce": 3.0, "kd": 0.0}) + "\n"
                                                  for s in (1, 2)))
    (folder / "eval.jsonl").write_text(json.dumps({"step": 2, "bits_per_byte": 2.25}) + "\n")
    record = {"step": 2, f"eval/{NEXT}/acc": acc, f"eval/{NEXT}/acc_stderr": 0.023,
              f"eval/{NEXT}/acc_norm": 0.247, f"eval/{NEXT}/acc_norm_stderr": 0.022,
              f"eval/{HELDOUT}/passage_bits_per_byte": passage_bits,
              f"eval/{HELDOUT}/passage_bits_per_byte_stderr": 0.041, f"eval/{HELDOUT}/bits_per_byte": 2.2248}
    (folder / "eval_tasks.jsonl").write_text(json.dumps(record) + "\n")
    return folder


def test_accuracy_and_bits_per_byte_tasks_get_their_own_tables(tmp_path):
    runs = [_run(tmp_path / "csd", 0.273, 2.301), _run(tmp_path / "ce", 0.260, 2.587)]
    text = write_report(runs, tmp_path / "report").read_text(encoding="utf-8")
    assert "| run | task | step | acc | acc_norm | held-out bits/byte |" in text
    assert f"| csd | `{NEXT}` | 2 | 0.273 ± 0.023 | 0.247 ± 0.022 | 2.2500 |" in text
    assert "| run | task | step | bits_per_byte | passage_bits_per_byte | held-out bits/byte |" in text
    assert f"| ce | `{HELDOUT}` | 2 | 2.225 | 2.587 ± 0.041 | 2.2500 |" in text   # no stderr for the pooled figure
    assert f"`{HELDOUT}` | 2 | -" not in text and f"`{NEXT}` | 2 | -" not in text   # no column a task lacks


def test_one_task_evaluation_per_run_is_drawn_as_one_bar_per_model_with_its_error_bar(tmp_path, monkeypatch):
    """Runs scored once (the demo's students) get bars, not one-point lines: per task and metric one bar per run,
    its height the score and its error bar the harness's standard error (none where the harness gave none)."""
    from csd_pipeline.report import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, out, name: figures.append(fig) or name)
    runs = [_run(tmp_path / "csd", 0.273, 2.301), _run(tmp_path / "ce", 0.260, 2.587)]
    write_report(runs, tmp_path / "report")
    (bars,) = [f for f in figures if f._suptitle and "standard tasks" in f._suptitle.get_text()]
    panels = {ax.get_title(): ax for ax in bars.axes if ax.get_visible()}
    assert set(panels) == {f"{NEXT} acc", f"{NEXT} acc_norm", f"{HELDOUT} passage_bits_per_byte",
                           f"{HELDOUT} bits_per_byte"}
    acc = panels[f"{NEXT} acc"]
    assert [p.get_height() for p in acc.patches] == [0.273, 0.260]
    assert [t.get_text() for t in acc.get_xticklabels()] == ["csd", "ce"]
    (caps_and_lines,) = [c for c in acc.containers if hasattr(c, "lines") and c.lines[2]]
    segments = caps_and_lines.lines[2][0].get_segments()
    assert [round(float(s[1][1] - s[0][1]), 6) for s in segments] == [0.046, 0.046]   # 2 x stderr 0.023
