"""The demo's report: `OUT/report.md` with PNG plots next to it.

It is `csd-pipeline report` over the demo's outputs (the aligned training text, the teacher top-k, both
students), with the held-out scores of `csd-pipeline bits-per-byte` on top. Without the scores it is:

    csd-pipeline report out/demo/aligned out/demo/teacher out/demo/student-csd out/demo/student-ce --output out/demo
"""

from __future__ import annotations

import json
from pathlib import Path

FOLDERS = ("aligned", "teacher", "student-csd", "student-ce")


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
    if summary.get("scores_tasks"):
        preface += ["## Standard task `csd_next_sentence` (higher is better; chance 0.25)", "",
                    "lm-evaluation-harness, zero-shot, every item; ± the harness's standard error. The students' "
                    "scores are `csd-train --eval-tasks` on their final exports, the teacher's `csd-pipeline "
                    "evaluate` (docs/EVALUATION.md).", "", "| model | task | acc | acc_norm |", "|---|---|---|---|"]
        preface += [f"| {name} | `{task}` | {acc} | {norm} |" for name, task, acc, norm in task_rows(summary["scores_tasks"])]
        preface += [""]
    report = write([out / name for name in FOLDERS], out, title="csd-pipeline demo report", preface=preface)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return report


def task_rows(tasks: dict) -> list[tuple[str, str, str, str]]:
    """(model, task, acc, acc_norm), each score `value ± stderr`, from per-model `eval/TASK/METRIC` values
    (`trainer.task_eval.scores`); the group before its tasks."""
    rows = []
    for name, values in tasks.items():
        for task in sorted({key.split("/")[1] for key in values}, key=lambda t: (len(t), t)):
            cells = [f"{values[f'eval/{task}/{m}']:.3f} ± {values.get(f'eval/{task}/{m}_stderr', float('nan')):.3f}"
                     if f"eval/{task}/{m}" in values else "-" for m in ("acc", "acc_norm")]
            rows.append((name, task, *cells))
    return rows
