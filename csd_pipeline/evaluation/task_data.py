"""The data of the project's own lm-evaluation-harness tasks: a JSONL file beside the task's YAML, read offline."""

from __future__ import annotations

import json
from pathlib import Path


def load_task_jsonl(folder: str | Path, data_file: str) -> dict:
    """{"test": datasets.Dataset} of the records in `data_file`, a file name inside `folder` (the task's own)."""
    import datasets

    folder = Path(folder).resolve()
    path = (folder / data_file).resolve()
    if path.parent != folder or not path.is_file():
        raise FileNotFoundError(f"{path}: the task's data file is missing; reinstall csd-pipeline")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
