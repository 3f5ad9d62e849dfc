"""The demo's report: `OUT/report.md` with PNG plots next to it.

It is `csd-pipeline report` over the demo's outputs (the aligned training text, the teacher top-k, both
students), with the held-out scores of `csd-pipeline bits-per-byte` on top. Without the scores it is:

    csd-pipeline report out/demo/aligned out/demo/teacher out/demo/student-csd out/demo/student-ce --output out/demo
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDERS = ("aligned", "teacher", "student-csd", "student-ce")
# (title, [(metric, column)]): the task tables of the report, each with the columns that fit its metrics
TASK_TABLES = [
    ("`csd_next_sentence`: the real next sentence among four (higher is better; chance 0.25)",
     [("acc", "acc"), ("acc_norm", "acc_norm")]),
    ("`csd_heldout_devil`: the held-out text as bits per byte (lower is better)",
     [("passage_bits_per_byte", "mean over passages"), ("bits_per_byte", "byte-weighted")]),
]


def write_report(out: Path, summary: dict) -> Path:
    """Write OUT/report.md (and its PNGs) and OUT/summary.json from the demo's outputs; return the report's path."""
    from csd_pipeline.report.render import write_report as write

    scores = summary["scores_bits_per_byte"]
    ce = scores["student, CE only"]
    preface = ["Teacher SmolLM2-135M-Instruct (ByteLevel BPE, 49,152 ids) distilled into a 4-layer, 128-wide Llama "
               "student with the Llama 2 SentencePiece tokenizer (32,000 ids), on The Devil's Dictionary "
               f"({summary['steps']} steps per student; CSD arm: `{' '.join(summary['csd_args'])}`). "
               f"Total time: {summary['seconds'] / 60:.1f} min.", "",
               "## Held-out bits per byte (lower is better)", "", "| model | bits/byte | vs CE only |", "|---|---|---|"]
    preface += [f"| {name} | {value:.4f} | {(value - ce) / ce:+.1%} |" for name, value in scores.items()] + [""]
    preface += stage_times(summary.get("stage_seconds", {}), summary["seconds"])
    for title, columns in TASK_TABLES if summary.get("scores_tasks") else ():
        preface += [f"## Standard task {title}", "",
                    "lm-evaluation-harness, zero-shot, every item; ± the harness's standard error. The students' "
                    "scores are `csd-train --eval-tasks` on their final exports, the teacher's `csd-pipeline "
                    "evaluate` (docs/EVALUATION.md).", "", "| model | task | " + " | ".join(c for _, c in columns) + " |",
                    "|---|---|" + "---|" * len(columns)]
        preface += [f"| {name} | `{task}` | " + " | ".join(cells) + " |"
                    for name, task, *cells in task_rows(summary["scores_tasks"], columns)]
        preface += [""]
    if summary.get("scores_tasks"):
        from csd_pipeline.report.plots import task_bars

        out.mkdir(parents=True, exist_ok=True)
        figure = task_bars(summary["scores_tasks"], out, "demo-tasks.png")
        preface += [f"![standard tasks, one bar per model]({figure})", ""] if figure else []
    report = write([out / name for name in FOLDERS], out, title="csd-pipeline demo report", preface=preface)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return report


def stage_times(seconds: dict[str, float], total: float) -> list[str]:
    """The report's table of each stage's time (the demo's commands, as `demo.run` timed them)."""
    if not seconds:
        return []
    lines = ["## Time per stage", "", "| stage | seconds | share |", "|---|---|---|"]
    lines += [f"| {name} | {value:.1f} | {value / total:.0%} |" for name, value in seconds.items()]
    return lines + [f"| all | {total:.1f} | |", ""]


def task_rows(tasks: dict, columns: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """(model, task, one cell per column), a cell `value ± stderr` (the value alone where the harness gives no
    stderr, `-` where the task lacks the metric), from per-model `eval/TASK/METRIC` values
    (`trainer.task_eval.scores`); only the tasks with one of the columns' metrics, the group before its tasks."""
    rows = []
    for name, values in tasks.items():
        names = {key.split("/")[1] for key in values if key.split("/")[2] in {m for m, _ in columns}}
        for task in sorted(names, key=lambda t: (len(t), t)):
            rows.append((name, task, *(_cell(values, f"eval/{task}/{metric}") for metric, _ in columns)))
    return rows


def _cell(values: dict, key: str) -> str:
    if key not in values:
        return "-"
    stderr = values.get(f"{key}_stderr")
    return f"{values[key]:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")
