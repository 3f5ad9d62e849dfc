"""The files of a `csd-train` output folder that other tools read (`csd-pipeline report`).

`metrics.jsonl` holds one JSON object per logged step (loss, ce, kd, kd_scale, lr, ...);
`eval.jsonl` one per held-out evaluation (step, bits_per_byte, ..., sources: the same per source);
`eval_tasks.jsonl` one per lm-evaluation-harness run of `--eval-tasks` (step, `eval/TASK/METRIC`, its `_stderr`). The trainer writes them
(`trainer/metrics.py`), the library reads them (`csd_pipeline/report/folders.py`).
"""

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
TASKS_FILE = "eval_tasks.jsonl"
