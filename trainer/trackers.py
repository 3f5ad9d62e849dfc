"""Experiment trackers of `csd-train --report-to`: TensorBoard and Weights & Biases, besides `metrics.jsonl`.

`metrics.jsonl` and `eval.jsonl` keep their own keys (`csd-pipeline report`, resume and the benchmarks
read them). A tracker gets the same values under the names users know from TRL and the HF Trainer
(`TRACKER_NAMES`: `train/loss`, `train/kd_loss`, `train/learning_rate`, `eval/bits_per_byte`, ...).
Each tracker is an optional extra (`pip install 'csd-pipeline[tensorboard]'`, `[wandb]`); one that is
asked for and not installed is refused before the run starts (`check_installed`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from csd_pipeline.errors import CsdError

REPORTERS = ("jsonl", "tensorboard", "wandb")
# package to find, extra that installs it
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
# metrics.jsonl key -> tracker name (the rest: `train/KEY`, and `eval/KEY` for eval.jsonl)
TRACKER_NAMES = {"loss": "train/loss", "ce": "train/ce_loss", "kd": "train/kd_loss", "lr": "train/learning_rate",
                 "tokens_per_s": "train/tokens_per_second"}
WANDB_RUN_ID = "wandb-run-id.txt"  # so that a resumed run appends to the same W&B run


def check_installed(report_to: list[str]) -> None:
    """Raise `CsdError` for an unknown reporter or one whose package is not installed (no import)."""
    for name in report_to:
        if name not in REPORTERS:
            raise CsdError(f"--report-to {name!r} is not a reporter; use a comma-separated list of "
                           f"{', '.join(REPORTERS)}")
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            package, extra = PACKAGES[name]
            raise CsdError(f"--report-to {name} needs the {package} package, which is not installed; run "
                           f"`pip install 'csd-pipeline[{extra}]'` (or `pip install {package}`), or drop {name}")


def tracker_values(record: dict, prefix: str | None) -> dict[str, float]:
    """The numeric values of one metrics record under the trackers' names (`prefix`: train or eval; None: the
    record's keys are the names already, as in `eval_tasks.jsonl`)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, str) or not isinstance(value, (int, float)):
            continue  # a non-finite value is a string in the JSON record, and is left out here too
        if prefix is None:
            name = key
        else:
            name = TRACKER_NAMES.get(key, f"train/{key}") if prefix == "train" else f"{prefix}/{key}"
        out[name] = float(value)
    return out


class TensorBoardTracker:
    """Scalars into `OUTPUT/tensorboard/` (events after `start_step` are dropped on resume). TensorBoard has no
    environment setting of its own for where a writer logs, so there is none to honour here."""

    def __init__(self, output: Path, start_step: int, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output / "tensorboard"), purge_step=start_step + 1)

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, by default in `OUTPUT/wandb/`, in project csd-pipeline, named after the output folder. W&B's own
    settings win where they are set (`wandb_init_args`): WANDB_DIR, WANDB_PROJECT, WANDB_NAME, WANDB_RUN_ID, and
    the rest (WANDB_MODE=offline writes the run locally only, WANDB_ENTITY, ...) are W&B's alone."""

    def __init__(self, output: Path, start_step: int, config: dict):
        import wandb

        id_file = output / WANDB_RUN_ID
        run_id = id_file.read_text(encoding="utf-8").strip() if start_step and id_file.is_file() else None
        self.run = wandb.init(config=config, settings=wandb.Settings(console="off", quiet=True),
                              **wandb_init_args(output, run_id, os.environ))
        id_file.write_text(self.run.id + "\n", encoding="utf-8")
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "train/global_step": step})

    def close(self) -> None:
        self.run.finish()


def wandb_init_args(output: Path, run_id: str | None, environ) -> dict:
    """`wandb.init`'s dir, project, name and id: ours only where W&B's own variable is unset in `environ`, since
    an argument of `wandb.init` overrides the environment (a resumed run passes the id it saved, to append)."""
    args = {}
    if not environ.get("WANDB_DIR"):
        args["dir"] = str(output)
    if not environ.get("WANDB_PROJECT"):
        args["project"] = "csd-pipeline"
    if not environ.get("WANDB_NAME"):
        args["name"] = output.name
    if run_id and not environ.get("WANDB_RUN_ID"):
        args["id"], args["resume"] = run_id, "allow"
    return args


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def open_trackers(report_to: list[str], output, start_step: int, config: dict) -> list:
    """The trackers `report_to` names (jsonl is the metrics file itself), opened on rank 0."""
    check_installed(report_to)
    return [TRACKERS[name](Path(output), start_step, config) for name in dict.fromkeys(report_to) if name in TRACKERS]
