"""Per-step metrics: `OUTPUT/metrics.jsonl`, a progress bar on stderr, TensorBoard if installed.

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

from csd_pipeline.runtime.files import atomic_write_text

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"


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
                 progress: bool = True):
        self.is_main = is_main
        self.path = Path(output) / METRICS_FILE
        self.eval_path = Path(output) / EVAL_FILE
        self._bar = None
        self._tensorboard = None
        if not is_main:
            return
        truncate_jsonl(self.path, start_step)
        truncate_jsonl(self.eval_path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if progress:
            self._bar = _progress_bar(total_steps, start_step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(Path(output) / "tensorboard"), purge_step=start_step + 1)
        except ImportError:
            self._tensorboard = None

    def log_step(self, record: dict) -> None:
        """Append one step's record (must hold `step`)."""
        if not self.is_main:
            return
        clean = {key: _json_value(value) for key, value in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tensorboard.add_scalar(f"train/{key}", value, clean["step"])
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
        if self._tensorboard is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tensorboard.add_scalar(f"eval/{key}", value, clean["step"])
        self.message(f"eval step {clean['step']}: " + ", ".join(
            f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in clean.items() if k != "step"))

    def message(self, text: str) -> None:
        """A line on stderr that does not break the progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if not self.is_main:
            return
        self._file.close()
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _progress_bar(total: int, initial: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainBar(total, initial)
    return tqdm(total=total, initial=initial, file=sys.stderr, unit="step", dynamic_ncols=True)


class _PlainBar:
    """A minimal stand-in for tqdm: one line per 10% of the run."""

    def __init__(self, total: int, initial: int):
        self.total, self.n, self.postfix = total, initial, ""

    def update(self, n: int) -> None:
        self.n += n
        if self.total and (self.n * 10 // self.total) != ((self.n - n) * 10 // self.total):
            print(f"step {self.n}/{self.total} {self.postfix}", file=sys.stderr)

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stderr)

    def close(self) -> None:
        pass
