"""`custom_dataset` of the csd_next_sentence tasks: their JSONL next to this file, read offline.

lm-evaluation-harness imports this module by path from the task YAML (`!function loader.load`)
and calls `load(**metadata, **dataset_kwargs)`; only `data_file` is read.
"""

from __future__ import annotations

from pathlib import Path


def load(data_file: str, **_ignored) -> dict:
    """{"test": datasets.Dataset} of the items in `data_file` (a name in this folder)."""
    from csd_pipeline.evaluation.task_data import load_task_jsonl

    return load_task_jsonl(Path(__file__).parent, data_file)
