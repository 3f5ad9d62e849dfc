"""Versioned schemas of the stage outputs: aligned shards (`aligned.py`) and the files of a training run
(`training_run.py`); the teacher store's Arrow schema lives with its format, in `csd_pipeline/teacher/store/schema.py`."""
