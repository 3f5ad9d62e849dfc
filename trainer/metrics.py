"""Per-step metrics: `OUTPUT/metrics.jsonl`, a progress bar on stderr (a terminal only, see
`csd_pipeline.runtime.progress`), and the trackers of `--report-to` (`trainer/trackers.py`).

Only rank 0 writes. Values logged are already global (all-reduced by the loop). On resume the
file is cut back to the resumed step, so a stopped-and-resumed run ends with the same lines
as an uninterrupted one (apart from the timing fields).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from csd_pipeline.runtime import storage
from csd_pipeline.runtime.files import atomic_write_text
from schemas.training_run import EVAL_FILE, METRICS_FILE, TASKS_FILE


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only the lines of a JSONL metrics file whose `step` is <= last_step (atomically)."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                break  # a line cut by a crash: nothing after it is trusted
            if record.get("step", 0) <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(path, "".join(kept))


def _json_value(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf
    return value


class MetricsLogger:
    """Writes one JSON object per step (rank 0 only) and drives the progress bar."""

    def __init__(self, output: str | os.PathLike, is_main: bool, total_steps: int, start_step: int,
                 progress: bool = True, report_to: tuple[str, ...] = ("jsonl",), config: dict | None = None):
        self.is_main = is_main
        # An object store cannot append: the files are kept in a local staging folder, and `sync`
        # uploads them whole (at each checkpoint and at the end).
        self.output = storage.location(output)
        folder = storage.staging_path(self.output / METRICS_FILE).parent if storage.is_remote(self.output) else (
            self.output)
        self.path = folder / METRICS_FILE
        self.eval_path = folder / EVAL_FILE
        self.tasks_path = folder / TASKS_FILE
        self._bar = None
        self._trackers: list = []
        if not is_main:
            return
        if storage.is_remote(self.output):
            for name in (METRICS_FILE, EVAL_FILE, TASKS_FILE):
                self.path.parent.joinpath(name).unlink(missing_ok=True)
                if (self.output / name).is_file():
                    self.output.fs.get_file((self.output / name).path, str(folder / name))
        truncate_jsonl(self.path, start_step)
        truncate_jsonl(self.eval_path, start_step)
        truncate_jsonl(self.tasks_path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if progress:
            from csd_pipeline.runtime.progress import bar

            self._bar = bar(total_steps, "train", "step", initial=start_step)
        from trainer.trackers import open_trackers

        self._trackers = open_trackers(list(report_to), output, start_step, config or {})

    def log_step(self, record: dict) -> None:
        """Append one step's record (must hold `step`)."""
        if not self.is_main:
            return
        clean = {key: _json_value(value) for key, value in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        self._track(clean, "train")
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(
                f"loss {clean.get('loss', float('nan')):.4g} ce {clean.get('ce', float('nan')):.4g} "
                f"lr {clean.get('lr', 0):.2e} tok/s {clean.get('tokens_per_s', 0):.0f}",
                refresh=False,
            )

    def log_eval(self, record: dict) -> None:
        """Append one evaluation record to `eval.jsonl` (and print it under the bar)."""
        if not self.is_main:
            return
        clean = {key: _json_value(value) for key, value in record.items()}
        with open(self.eval_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean, sort_keys=True) + "\n")
        self._track(clean, "eval")
        self.message(f"eval step {clean['step']}: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in clean.items()
            if k != "step" and not isinstance(v, dict)))
        sources = clean.get("sources") or {}
        if len(sources) > 1:  # per source: the file name and its bits per byte (eval.jsonl has the rest)
            self.message("  per source: " + ", ".join(f"{Path(s).name} {f['bits_per_byte']:.4f}"
                                                      for s, f in sources.items()))

    def log_tasks(self, record: dict) -> None:
        """Append one `--eval-tasks` record (`step` and `eval/TASK/METRIC` values) to `eval_tasks.jsonl`."""
        if not self.is_main:
            return
        with open(self.tasks_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        self._track(record, None)
        self.message(f"eval tasks step {record['step']}: " + ", ".join(
            f"{k[len('eval/'):]} {v:.4f}" for k, v in record.items() if k != "step" and not k.endswith("_stderr")))

    def _track(self, record: dict, prefix: str | None) -> None:
        if self._trackers:
            from trainer.trackers import tracker_values

            values = tracker_values(record, prefix)
            for tracker in self._trackers:
                tracker.log(values, record["step"])

    def message(self, text: str) -> None:
        """A line on stderr that does not break the progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def sync(self) -> None:
        """Upload the metrics files to an object-store output (nothing to do on a local disk)."""
        if not self.is_main or not storage.is_remote(self.output):
            return
        self._file.flush()
        for path in (self.path, self.eval_path, self.tasks_path):
            if path.is_file():
                storage.write_object(self.output / path.name, path.read_bytes())

    def close(self) -> None:
        if not self.is_main:
            return
        self.sync()
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        for tracker in self._trackers:
            tracker.close()

