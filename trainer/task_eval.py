"""`csd-train --eval-tasks`: lm-evaluation-harness tasks on the student's export during training.

At each `--eval-tasks-every` step and at the end, the run writes its checked export (`export-step-N/` when
`--export-every` wrote one at that step, else `export-eval-tasks/`, replaced each time; at the end `export/`)
and rank 0 runs `csd-pipeline evaluate` on it while the other ranks wait: the same evaluation a user runs
on an export, in its own process, so that the harness neither joins the run's process group nor re-seeds
its random generators. The harness's results JSON and log go to `OUTPUT/eval-tasks/step-N.json` / `.log`;
the scores, under the trackers' names (`eval/csd_next_sentence/acc`, `..._stderr`), to `eval_tasks.jsonl`
(`schemas/training_run.py`) and the `--report-to` trackers; `csd-pipeline report` shows them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from csd_pipeline.errors import CsdError

RESULTS_DIR = "eval-tasks"
SCRATCH_EXPORT = "export-eval-tasks"
# what torchrun sets: the harness process must not take itself for one of the run's ranks
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def check_options(options) -> None:
    """Refuse `--eval-tasks` without lm-eval installed, or with an include path that is not a folder (no import)."""
    from csd_pipeline.evaluation.harness import INSTALL_HINT

    for package in ("lm_eval", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise CsdError(f"--eval-tasks needs lm-evaluation-harness, and `{package}` is not installed; run: "
                           f"{INSTALL_HINT}, or drop --eval-tasks")
    for folder in options.eval_tasks_include_path:
        if not Path(folder).is_dir():
            raise CsdError(f"--eval-tasks-include-path {folder}: no such folder; pass a folder of task YAML files")


def check_tasks(options, ctx) -> None:
    """Refuse unknown `--eval-tasks` names before the first step (rank 0 looks them up; every rank raises)."""
    from trainer import distributed

    failure = None
    if ctx.is_main:
        from csd_pipeline.evaluation.harness import EvaluateConfig, manager_for

        try:
            manager_for(EvaluateConfig(model="", tasks=list(options.eval_tasks),
                                       include_paths=list(options.eval_tasks_include_path)))
        except CsdError as err:
            failure = CsdError(f"--eval-tasks: {err}")
    if distributed.agree_any(failure is not None, ctx.device):
        raise failure if failure is not None else CsdError("--eval-tasks: rank 0 refused the task names; see its error")


def due(options, step: int, last: int) -> bool:
    """Whether `step` (not the run's last: that one is scored on the final export) runs the tasks."""
    return bool(options.eval_tasks and options.eval_tasks_every and step % options.eval_tasks_every == 0
                and step != last)


def evaluate_export(export_dir: Path, options, output: Path, step: int, device: str, ctx) -> dict | None:
    """Run `csd-pipeline evaluate` on `export_dir` (rank 0; collective: the other ranks wait) and return the
    eval_tasks.jsonl record of `step` on rank 0 (None elsewhere). Raises `CsdError` on every rank when the
    harness fails, naming its log."""
    from trainer import distributed

    record, failure = None, None
    if ctx.is_main:
        results_dir = Path(output) / RESULTS_DIR
        results_dir.mkdir(parents=True, exist_ok=True)
        results, log = results_dir / f"step-{step:08d}.json", results_dir / f"step-{step:08d}.log"
        try:
            record = {"step": step, **scores(_run_harness(export_dir, options, device, results, log))}
        except CsdError as err:
            failure = err
    if distributed.agree_any(failure is not None, ctx.device):
        raise failure if failure is not None else CsdError("rank 0's task evaluation failed; see its error")
    return record


def _run_harness(export_dir: Path, options, device: str, results: Path, log: Path) -> dict:
    import json

    command = [sys.executable, "-m", "cli.main", "evaluate", "--model", str(export_dir),
               "--tasks", ",".join(options.eval_tasks), "--device", device, "--output", str(results)]
    if options.eval_tasks_limit:
        command += ["--limit", str(options.eval_tasks_limit)]
    for folder in options.eval_tasks_include_path:
        command += ["--include-path", str(folder)]
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCHER_VARIABLES and not key.startswith("TORCHELASTIC_")}
    results.unlink(missing_ok=True)
    with open(log, "w", encoding="utf-8") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if code != 0 or not results.is_file():
        errors = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines()
                  if line.startswith("error:")]
        said = f" ({errors[-1][len('error:'):].strip()})" if errors else ""
        raise CsdError(f"--eval-tasks: `csd-pipeline evaluate` on {export_dir} failed with exit {code}{said}; its "
                       f"output is in {log}. The run stops here; --resume continues from its last checkpoint")
    return json.loads(results.read_text(encoding="utf-8"))


def scores(results: dict) -> dict[str, float]:
    """The harness's numbers as `eval/TASK/METRIC` (and `..._stderr`); a filter other than `none` is appended
    (`eval/TASK/METRIC/FILTER`). Tasks and groups alike; a value that is not a number is left out."""
    out: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in sorted(results.get(section, {}).items()):
            for key, value in sorted(metrics.items()):
                metric, _, filt = key.partition(",")
                if not isinstance(value, (int, float)) or isinstance(value, bool) or metric == "sample_len":
                    continue
                name = f"eval/{task}/{metric}" + (f"/{filt}" if filt not in ("", "none") else "")
                out.setdefault(name, float(value))
    return out
