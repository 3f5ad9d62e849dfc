"""Versioned Arrow schemas of every stage output (see aligned.py, teacher_topk.py)."""
