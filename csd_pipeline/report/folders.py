"""What each folder given to `csd-pipeline report` is: an aligned output, a teacher top-k output (both
known by their manifest's stage) or a csd-train run (known by its `metrics.jsonl`; it has no manifest).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.storage import is_remote, location
from csd_pipeline.teacher.store.schema import STAGE as TEACHER_STAGE
from schemas.aligned import STAGE as ALIGN_STAGE

KINDS = {ALIGN_STAGE: "aligned", TEACHER_STAGE: "teacher"}


@dataclass
class Folder:
    """One report input: `kind` ("aligned", "teacher" or "training"), its path and, for a stage output,
    its reader (`AlignedOutput` or `TeacherTopkOutput`; None for a run)."""

    kind: str
    path: Path
    output: object | None = None


@dataclass
class TrainingRun:
    """The curves of one csd-train run: per-step records (`metrics.jsonl`), held-out evaluations
    (`eval.jsonl`), its resolved options (`config.yaml`, {} when absent) and its lm-evaluation-harness
    scores (`eval_tasks.jsonl`, `csd-train --eval-tasks`)."""

    path: Path
    label: str
    steps: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    config: dict = field(default_factory=dict)
    tasks: list = field(default_factory=list)

    def task_metrics(self) -> list[tuple[str, str]]:
        """The (task, metric) pairs of `eval_tasks.jsonl` (keys `eval/TASK/METRIC`, stderr left out), sorted."""
        pairs = set()
        for record in self.tasks:
            for key in record:
                task, _, metric = key.removeprefix("eval/").partition("/")
                if key.startswith("eval/") and metric and not metric.endswith("_stderr"):
                    pairs.add((task, metric))
        return sorted(pairs)

    def task_series(self, task: str, metric: str) -> tuple[list, list, list]:
        """(steps, values, standard errors or NaN) of one task's metric."""
        key = f"eval/{task}/{metric}"
        points = [(r["step"], float(r[key]), float(r.get(f"{key}_stderr", float("nan")))) for r in self.tasks
                  if isinstance(r.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points], [p[2] for p in points]

    def series(self, key: str, evals: bool = False) -> tuple[list, list]:
        """(steps, values) of `key`, leaving out records without a finite number for it."""
        points = [(r["step"], float(r[key])) for r in (self.evals if evals else self.steps)
                  if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        return [p[0] for p in points], [p[1] for p in points]

    def sources(self) -> list[str]:
        """The sources of the held-out evaluations that recorded per-source figures (`eval.jsonl`'s "sources"),
        sorted."""
        return sorted({s for r in self.evals if isinstance(r.get("sources"), dict) for s in r["sources"]})

    def source_series(self, source: str) -> tuple[list, list]:
        """(steps, held-out bits per byte of `source`), leaving out evaluations without a finite figure for it."""
        points = [(r["step"], float(f["bits_per_byte"])) for r in self.evals
                  if isinstance(r.get("sources"), dict) and isinstance(f := r["sources"].get(source), dict)
                  and isinstance(f.get("bits_per_byte"), (int, float)) and f["bits_per_byte"] == f["bits_per_byte"]]
        return [p[0] for p in points], [p[1] for p in points]


def recognise(directory) -> Folder:
    """The `Folder` of `directory`. Raises `CsdError` (one line, saying what to pass) for anything else."""
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.runtime.manifest import MANIFEST_NAME, read_manifest
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from schemas.training_run import METRICS_FILE

    path = location(directory)
    if not path.is_dir():
        raise CsdError(f"{path} is not a folder; pass output folders of align, teacher-logits or csd-train.")
    if (path / MANIFEST_NAME).is_file():
        stage = read_manifest(path).get("stage")  # any stage; the output's own reader checks its schema version
        if stage not in KINDS:
            raise CsdError(f"{path} is a {stage} output, which the report does not cover; pass output "
                           "folders of align, teacher-logits or csd-train.")
        kind = KINDS[stage]
        return Folder(kind, path, (AlignedOutput if kind == "aligned" else TeacherTopkOutput).open(path))
    if (path / METRICS_FILE).is_file():
        return Folder("training", path)
    if (path / "run.json").is_file():
        raise CsdError(f"{path} is a stage output that is not complete (no {MANIFEST_NAME} yet); run "
                       f"`csd-pipeline status {path}` to see what is missing.")
    inside = sorted(p.name for p in path.iterdir() if p.is_dir() and ((p / MANIFEST_NAME).is_file()
                                                                      or (p / METRICS_FILE).is_file()))
    hint = f" (its sub-folders {', '.join(inside[:6])} are: pass them)" if inside else ""
    raise CsdError(f"{path} is neither a stage output (no {MANIFEST_NAME}) nor a csd-train run (no {METRICS_FILE})"
                   f"{hint}; pass output folders of align, teacher-logits or csd-train.")


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # a line cut by a crash: the metrics writer trusts nothing after it either
    return [r for r in records if isinstance(r, dict) and "step" in r]


def read_run(folder: Folder, label: str) -> TrainingRun:
    """The `TrainingRun` of a csd-train output folder."""
    from schemas.training_run import EVAL_FILE, METRICS_FILE, TASKS_FILE

    config = {}
    resolved = folder.path / "config.yaml"  # trainer.loop.RESOLVED_CONFIG (that module imports torch)
    if resolved.is_file():
        import yaml

        try:
            config = yaml.safe_load(resolved.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError:
            config = {}
    return TrainingRun(folder.path, label, _jsonl(folder.path / METRICS_FILE), _jsonl(folder.path / EVAL_FILE),
                       config if isinstance(config, dict) else {}, _jsonl(folder.path / TASKS_FILE))


def labels(folders: list[Folder]) -> list[str]:
    """Short, distinct names for the folders: the folder name, with its parent's when two share it."""
    # not resolve(): a link keeps the name it was given; an object-store URL is already absolute
    paths = [f.path if is_remote(f.path) else Path(os.path.abspath(f.path)) for f in folders]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]
