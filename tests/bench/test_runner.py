"""bench/experiments/runner.py: a results file keeps every run but the one repeated; --table prints a file's table."""

from __future__ import annotations

import json

from bench.experiments import prune
from bench.experiments.runner import main, run, save_results


def test_a_run_replaces_only_the_run_with_its_key(tmp_path):
    path = tmp_path / "prune.json"
    first = [{"arm": "ce", "seed": 0, "bits_per_byte": 2.5}, {"arm": "ce", "seed": 1, "bits_per_byte": 2.4}]
    save_results(path, first, {"before": 6.0}, ("arm", "seed"), {"regime": "prune-and-heal"}, indent=1)
    save_results(path, [{"arm": "ce", "seed": 1, "bits_per_byte": 2.3}], {"unpruned": 1.4}, ("arm", "seed"),
                 {"regime": "prune-and-heal"}, indent=1)
    written = json.loads(path.read_text())
    assert written["regime"] == "prune-and-heal"
    assert written["reference_bits_per_byte"] == {"before": 6.0, "unpruned": 1.4}
    assert [(r["seed"], r["bits_per_byte"]) for r in written["results"]] == [(0, 2.5), (1, 2.3)]
    assert not list(tmp_path.glob("*.tmp"))


def test_table_of_a_results_file(capsys):
    from bench.experiments.results import RESULTS_DIR

    assert main(prune.BENCH, ["--table", str(RESULTS_DIR / "prune.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("prune and heal: held-out bits per byte")
    merged = json.loads((RESULTS_DIR / "prune.json").read_text())
    for arm in ("ce", "kd smollm2 dynamic"):  # each arm's row: its seed count and the mean of its runs
        values = [r["bits_per_byte"] for r in merged["results"] if r["arm"] == arm]
        row = next(line.split() for line in printed.splitlines() if line.startswith(arm + "  "))
        assert row[len(arm.split()):len(arm.split()) + 2] == [str(len(values)), f"{sum(values) / len(values):.4f}"]


def test_each_benchmark_table_prints_its_block_of_results_md(capsys):
    """`--table FILE` of quality (and --comparison), teachers and onpolicy prints what docs/RESULTS.md's block holds."""
    from bench.experiments import onpolicy, quality, teachers
    from bench.experiments.results import RESULTS_DIR, blocks

    generated = blocks()
    for command, name, block in (
            (lambda f: quality.main(["--table", f]), "quality", "quality"),
            (lambda f: quality.main(["--comparison", "--table", f]), "comparison", "comparison"),
            (lambda f: onpolicy.main(["--table", f]), "onpolicy-multilingual", "onpolicy")):
        assert command(str(RESULTS_DIR / f"{name}.json")) == 0
        assert capsys.readouterr().out == generated[block] + "\n"
    assert main(teachers.BENCH, ["--table", str(RESULTS_DIR / "teachers.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    regimes = [generated[f"teachers-{regime}"].splitlines() for regime in teachers.ALL_REGIMES]
    assert printed == regimes[0] + [line for lines in regimes[1:] for line in lines[2:]]  # one header


def test_each_run_is_also_a_file_of_its_own(tmp_path):
    from bench.experiments.runner import write_run

    record = {"regime": "repeated", "arm": "csd kl b1 t1.5 fixed0.5", "seed": 2, "bits_per_byte": {"de": 1.8}}
    path = write_run("pretrained", record, tmp_path)
    assert path == tmp_path / "runs" / "pretrained" / "repeated" / "csd_kl_b1_t1.5_fixed0.5-seed2.json"
    assert json.loads(path.read_text()) == record
    no_regime = write_run("prune", {"arm": "ce", "seed": 0, "bits_per_byte": 2.3}, tmp_path)
    assert no_regime == tmp_path / "runs" / "prune" / "ce-seed0.json"


def test_quality_writes_each_store_once_and_trains_each_arm_as_before(tmp_path, monkeypatch):
    """quality.py's commands, captured instead of run: one teacher-logits per store the arms read, and a csd-train
    command that resolves to the TrainConfig of the old flag lists (tests/bench/old_recipe_flags.json)."""
    from pathlib import Path

    from bench.experiments import quality
    from trainer.options import parse_args

    commands = []

    def run(cmd, log, threads=None):
        cmd = [str(c) for c in cmd]
        commands.append(cmd)
        if "--steps" in cmd:  # a training run: what train_arm reads afterwards
            out = Path(cmd[cmd.index("--output") + 1])
            out.mkdir(parents=True)
            (out / "eval.jsonl").write_text('{"step": 20, "bits_per_byte": 3.0}\n')
            (out / "metrics.jsonl").write_text('{"step": 20, "ce": 2.0}\n')

    monkeypatch.setattr(quality, "run", run)
    arms = ["ce", "csd kl b1 p0.99 t1.5", "csd kl b1 p0.99k64 t2", "csd kl b1 p0.99k64 t1.5"]
    dirs = quality.prepare("data-limited", tmp_path, tmp_path / "log", arms)
    stores = [c[c.index("smollm2-135m-instruct") + 1:c.index("--output")] for c in commands if "teacher-logits" in c]
    assert stores == [["--top-k", "128"], ["--top-k", "128", "--top-p", "0.99"], ["--top-k", "64", "--top-p", "0.99"]]
    old = json.loads((Path(__file__).parent / "old_recipe_flags.json").read_text())["quality"]
    record = quality.train_arm("data-limited", "csd kl b1 p0.99k64 t2", 1, dirs, tmp_path, 20, tmp_path / "log")
    train = commands[-1]
    assert train[train.index("--teacher-logits") + 1] == str(tmp_path / "data-limited" / "teacher-p0.99k64")
    before = [*train[train.index("--aligned"):], *old["train"], *old["arms"]["csd kl b1 p0.99k64 t2"]]
    assert parse_args(train[1:]) == parse_args(before)
    assert record["bits_per_byte"] == 3.0 and record["args"][-2:] == ["--teacher-temperature", "2"]


def test_a_failed_command_names_its_own_error_line(tmp_path):
    """A run that fails carries the command's `error:` line, not only the path of a log that may stay elsewhere."""
    import sys

    import pytest

    log = tmp_path / "run.log"
    script = "import sys; print('working'); print('error: --lr: 2 is too large', file=sys.stderr); sys.exit(2)"
    with pytest.raises(RuntimeError) as failed:
        run([sys.executable, "-c", script], log)
    assert str(failed.value).startswith("failed (2): ") and str(failed.value).endswith("\nerror: --lr: 2 is too large")


def test_ces_best_arm_is_compared_with_the_others_on_shared_seeds():
    """An arm run once, on the easiest seed, does not beat an arm that is better on that very seed (prune, 2026-12-04:
    `ce lr8e-4` had only seed 1, 2.0894, and was picked over `ce lr4e-4`: 2.0824 on seed 1, 2.0955 over three)."""
    from bench.experiments.plan import best_ce_arm

    runs = {"ce": {0: 2.33, 1: 2.30, 2: 2.33}, "ce lr4e-4": {0: 2.1006, 1: 2.0824, 2: 2.1035},
            "ce lr8e-4": {1: 2.0894}, "ce lr5e-5": {0: 2.5377}, "csd gemma3": {0: 1.9, 1: 1.9}}
    arm, mean = best_ce_arm(runs)
    assert arm == "ce lr4e-4" and abs(mean - (2.1006 + 2.0824 + 2.1035) / 3) < 1e-12
    assert best_ce_arm({"ce lr8e-4": {1: 2.0894}, "ce": {0: 2.5}}) == ("ce lr8e-4", 2.0894)  # no shared seed: means
    assert best_ce_arm({"csd": {0: 1.0}}) == (None, None)
