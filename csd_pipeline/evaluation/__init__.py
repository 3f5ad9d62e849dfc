"""Held-out evaluation that compares models with different tokenizers: bits per byte
(`bits_per_byte.py`) over aligned windows packed as in training (`packing.py`)."""
