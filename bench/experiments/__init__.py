"""The quality experiments: training runs that measure what a loss or a store buys in held-out bits per byte.

Each experiment (quality, pretrained, prune, teachers) is declared in csd_pipeline/recipes/experiments.yaml (regimes, store,
arms as csd-train recipes, seeds) and read by `plan.py`; `runner.py` runs any of them (`python -m
bench.experiments.<name>`); `results.py` writes docs/RESULTS.md's generated tables from their JSON results.
"""
