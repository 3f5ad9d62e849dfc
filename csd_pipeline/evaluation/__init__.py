"""Held-out evaluation: bits per byte, which compares models with different tokenizers (`bits_per_byte.py`,
per source: `per_source.py`, windows packed as in training by `packing.py`), and standard tasks with lm-evaluation-harness (`harness.py`;
the project's own task, built by `next_sentence.py`, in `tasks/`)."""
