"""The benchmarks: the speed suite (`bench/bench_<topic>.py`, run by `python -m bench.run_all`) and the experiments
(`bench/experiments/`, declared in csd_pipeline/recipes/experiments.yaml); run them from the repository root with `python -m`."""
