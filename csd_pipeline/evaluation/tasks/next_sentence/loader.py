"""`custom_dataset` of the csd_next_sentence tasks: their JSONL next to this file, read offline.

lm-evaluation-harness imports this module by path from the task YAML (`!function loader.load`)
and calls `load(**metadata, **dataset_kwargs)`; only `data_file` is read.
"""

from __future__ import annotations

import json
from pathlib import Path


def load(data_file: str, **_ignored) -> dict:
    """{"test": datasets.Dataset} of the items in `data_file` (a name in this folder)."""
    import datasets

    path = Path(__file__).resolve().parent / data_file
    if path.parent != Path(__file__).resolve().parent or not path.is_file():
        raise FileNotFoundError(f"{path}: the task's data file is missing; reinstall csd-pipeline")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}
