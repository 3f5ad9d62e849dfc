"""The project's own lm-evaluation-harness tasks (YAML, a loader and JSONL data; package data)."""
