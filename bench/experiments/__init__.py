"""The quality experiments: training runs that measure what a loss or a store buys in held-out bits per byte.

Each experiment (quality, pretrained, prune, teachers) is declared in csd_pipeline/recipes/experiments.yaml (regimes, store,
arms as csd-train recipes, seeds) and read by `plan.py`; `runner.py` runs any of them (`python -m
bench.experiments.<name>`); `results.py` writes the generated tables of docs/RESULTS.md and docs/results/*.md from their JSON results.
"""
