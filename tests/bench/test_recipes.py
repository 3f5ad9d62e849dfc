"""The recipes: every benchmark arm and the demo's recipe are the flag lists they replaced, and csd-train resolves them alike.

`old_recipe_flags.json` holds the Python flag lists of demo/run.py and bench/ as they were before the recipes
became files (captured once, from commit 9fe06e9): per experiment its training flags, each arm's loss flags,
and the store settings of the quality arms, bench_teacher_store.py and scale_sheet.py. Each recipe must give
the same options with the same values, in the same order; and `csd-train --config TRAIN --config ARM` plus a
run's own flags must resolve to the same TrainConfig as the old command line did. `arm_flags_before.json` holds
every arm of every experiment as it was before the sweep arms moved from files into experiments.yaml (captured
at a6a6fae): its flags, its store's flags, its teacher and the TrainConfig its command resolved to.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.experiments.plan import (
    arm_flags,
    arm_options,
    experiment,
    experiment_names,
    store_args,
    store_settings,
    train_config_args,
    train_options,
)
from csd_pipeline.errors import CsdError
from csd_pipeline.recipes import as_flags, load_recipe, load_store, recipe_path
from trainer.options import parse_args

OLD = json.loads((Path(__file__).parent / "old_recipe_flags.json").read_text(encoding="utf-8"))
BEFORE = json.loads((Path(__file__).parent / "arm_flags_before.json").read_text(encoding="utf-8"))
# the part of a benchmark's csd-train command that is not the recipe (paths need not exist to resolve a config)
RUN = ["--aligned", "/data/aligned", "--teacher-logits", "/data/teacher", "--student-config",
       "demo/student-config.json", "--student-tokenizer", "llama-spm", "--output", "/data/run", "--steps", "600",
       "--seed", "1", "--eval-aligned", "/data/heldout", "--eval-every", "120", "--warmup-steps", "80"]


def _value(text: str):
    """A flag's text as the value it means: 0.90 and 0.9 are one number, `false` one boolean."""
    if text in ("true", "false"):
        return text == "true"
    return float(text) if re.fullmatch(r"-?\d+(\.\d*)?(e-?\d+)?", text) else text


def _pairs(flags: list[str]) -> list[tuple[str, object]]:
    """(option, value) in order, from `--flag value` and `key=value` tokens alike."""
    pairs, tokens = [], list(flags)
    while tokens:
        token = tokens.pop(0)
        key, value = (token[2:], tokens.pop(0)) if token.startswith("--") else token.split("=", 1)
        pairs.append((key.replace("-", "_"), _value(value)))
    return pairs


def _old_arms(name: str) -> dict[str, list[str]]:
    if name == "teachers":
        return OLD["teachers"]["arms"]
    return OLD[name]["arms"]


@pytest.mark.parametrize("name", ["quality", "pretrained", "prune", "teachers"])
def test_each_arm_recipe_is_its_old_flag_list(name):
    exp = experiment(name)  # loads and checks every recipe and store the experiment names
    old_arms = _old_arms(name)
    assert [arm for arm in exp.arms if arm in old_arms] == list(old_arms)  # new arms may follow
    assert _pairs(as_flags(train_options(exp))) == _pairs(OLD[name]["train"])
    for arm, flags in old_arms.items():
        assert _pairs(as_flags(arm_options(exp.arms[arm]))) == _pairs(flags), arm
        old = parse_args([*RUN, *OLD[name]["train"], *flags])
        new = parse_args([*train_config_args(exp, exp.arms[arm]), *RUN])
        assert new == old, arm
    if name == "teachers":
        pretrained = exp.regime_arms["pretrained"]
        assert [arm for arm in pretrained if arm in OLD["teachers"]["pretrained_arms"]] == list(
            OLD["teachers"]["pretrained_arms"])
        for arm, flags in OLD["teachers"]["pretrained_arms"].items():
            assert _pairs(as_flags(arm_options(pretrained[arm]))) == _pairs(flags), arm
    if name == "prune":
        assert {arm: exp.arms[arm].teacher for arm in old_arms} == OLD["prune"]["teachers"]


def test_each_quality_arm_reads_the_store_it_read():
    exp = experiment("quality")
    for arm in exp.arms.values():
        old = OLD["quality"]["stores"].get(arm.name, OLD["quality"]["default_store"])
        assert _pairs(store_args(exp.store_of(arm))) == _pairs(old), arm.name


def test_store_recipes_are_the_settings_of_the_store_benchmarks():
    """bench_teacher_store.py's and scale_sheet.py's tuples, as chains of selectors, equal the store recipes'."""
    from csd_pipeline.teacher.store.selectors import chain_from_config

    settings = {**OLD["teacher_store"]["settings"], **OLD["scale_sheet"],
                **{name: {"top_k": 128, **s, "keep": "csd-events"}
                   for name, s in OLD["teacher_store"]["tail_settings"].items()}}
    for name, old in settings.items():
        assert chain_from_config(store_settings(name)) == chain_from_config(old), name
    assert chain_from_config(store_settings("p0.99")) != chain_from_config(settings["p0.90"])
    from bench import bench_teacher_store, scale_sheet

    assert list(bench_teacher_store.SETTINGS) == list(OLD["teacher_store"]["settings"])
    assert list(bench_teacher_store.TAIL_SETTINGS) == list(OLD["teacher_store"]["tail_settings"])
    assert list(scale_sheet.SETTINGS) == list(OLD["scale_sheet"])


def test_demo_recipe_is_the_old_demo_command():
    from demo import run as demo

    assert demo.CSD_ARGS == OLD["demo"]["arms"]["csd"]
    assert demo.TRAIN_ARGS == OLD["demo"]["train"]
    assert ["--top-k", str(demo.TOP_K), *demo.STORE_ARGS] == OLD["demo"]["store"]
    own = [*RUN[:12], "--eval-aligned", "/data/heldout", "--eval-every", "96", "--eval-tasks", "csd_next_sentence"]
    for arm, flags in OLD["demo"]["arms"].items():  # demo/run.py's own flags, then (before) the recipe's
        old = parse_args([*own, *OLD["demo"]["train"], *flags])
        new = parse_args([*map(str, demo.recipe_args(arm)), *own])
        assert new == old, arm
    assert parse_args([*map(str, demo.recipe_args("csd")), *RUN]) != parse_args([*map(str, demo.recipe_args("ce")), *RUN])


def test_every_declared_experiment_loads():
    names = experiment_names()
    assert names == ["quality", "pretrained", "prune", "teachers"]
    for name in names:
        exp = experiment(name)
        assert set(exp.extra.get("default_arms", [])) <= set(exp.arms), name
        for arms in exp.extra.get("comparison_arms", {}).values():
            assert set(arms) <= set(exp.arms), name


def test_bad_recipes_are_refused_with_the_file_named(tmp_path):
    store = tmp_path / "store.yaml"
    store.write_text("top_k: 128\nmin-p: 0.02\n", encoding="utf-8")
    with pytest.raises(CsdError, match=r"store\.yaml: unknown key\(s\) \['min-p'\]"):
        load_store(store)
    nested = tmp_path / "nested.yaml"
    nested.write_text("loss:\n  kind: csd\n", encoding="utf-8")
    with pytest.raises(CsdError, match="nested.yaml must be a flat mapping"):
        load_recipe(nested)
    with pytest.raises(CsdError, match="recipe quality/no-such-arm does not exist.*csd-pipeline recipes"):
        load_recipe("quality/no-such-arm")
    assert recipe_path("pretrained/csd_kl_b1_t1.5_fixed0.5").name == "csd_kl_b1_t1.5_fixed0.5.yaml"
    assert recipe_path(store) == store  # a path of one's own
    with pytest.raises(CsdError, match="no experiment 'nope'"):
        experiment("nope")


def test_the_regimes_are_the_old_ones():
    from bench.experiments import pretrained, prune, quality, teachers

    old = OLD["regimes"]
    assert quality.REGIMES == old["quality"]
    as_slice = {name: {**r, "train": None if r["train"] is None else slice(*r["train"])}
                for name, r in old["pretrained"].items()}
    assert pretrained.REGIMES == as_slice
    assert (prune.TRAIN_TAKE, prune.STEPS) == (slice(*old["prune"]["train"]), old["prune"]["steps"])
    assert teachers.regime_spec("pretrained") == {**old["teachers_pretrained"], "teachers": (("gemma3", "gemma3-270m"),)}
    assert {k: teachers.regime_spec(k)["steps"] for k in old["quality"]} == {k: 600 if k == "data-limited" else 680
                                                                           for k in old["quality"]}
    assert teachers.ALL_REGIMES == ["data-limited", "data-rich", "pretrained"]


def test_a_bad_declaration_names_what_to_fix(tmp_path, monkeypatch):
    from bench.experiments import plan

    declared = tmp_path / "experiments.yaml"
    head = "x:\n  train: demo/train\n  regimes: {{r: {{steps: 5}}}}\n  store: {store}\n  seeds: [0]\n  arms:\n"
    monkeypatch.setattr(plan, "EXPERIMENTS", declared)

    def load(text):
        declared.write_text(text)
        plan.experiment.cache_clear()
        plan.declared.cache_clear()
        return plan.experiment("x")

    try:
        with pytest.raises(CsdError, match=r"unknown option 'stor' in .*experiments.yaml, x.arms, arm 'a'"):
            load(head.format(store="top-128") + "    a: {loss: ce, stor: top-128}\n")
        with pytest.raises(CsdError, match="recipe stores/top-7 does not exist"):
            load(head.format(store="top-7") + "    a: {loss: ce}\n")
        with pytest.raises(CsdError, match="x.regimes must map each regime to {steps: N, ...}"):
            load(head.format(store="top-128").replace("steps", "stepz") + "    a: {loss: ce}\n")
        with pytest.raises(CsdError, match=r"x.arms, arm 'a', option 'beta' must be one value"):
            load(head.format(store="top-128") + "    a: {loss: ce, beta: [1, 2]}\n")
        with pytest.raises(CsdError, match=r"stores.mine: unknown key\(s\) \['top-k'\]"):
            load(head.format(store="mine") + "    a: {loss: ce}\nstores:\n  mine: {top-k: 4}\n")
        exp = load(head.format(store="mine") + "    a: {loss: ce, store: top-32}\n    b: {recipe: demo/csd, beta: 5}\n"
                   "stores:\n  mine: {top_k: 4}\n")
        assert plan.store_args(exp.store_of(exp.arms["a"])) == ["--top-k", "32"]
        assert plan.store_args(exp.store_of(exp.arms["b"])) == ["--top-k", "4"]
        assert plan.arm_flags(exp, exp.arms["b"]) == ["--loss", "csd", "--divergence", "kl", "--beta", "5",
                                                      "--teacher-temperature", "1.5"]
        assert plan.train_config_args(exp, exp.arms["b"]) == [
            "--config", str(recipe_path("demo/train")), "--config", str(recipe_path("demo/csd")), "beta=5"]
        assert plan.pick_arms(exp, None) == ["a", "b"] and plan.pick_seeds("2,3", exp.seeds) == [2, 3]
        with pytest.raises(CsdError, match=r"--arms: unknown arm\(s\) \['c'\]"):
            plan.pick_arms(exp, "a,c")
    finally:
        plan.experiment.cache_clear()
        plan.declared.cache_clear()


@pytest.mark.parametrize("name", ["quality", "pretrained", "prune", "teachers"])
def test_every_arm_gives_the_flags_store_and_config_it_gave_as_a_file(name):
    """Before/after the sweep arms moved inline: each arm's recorded flags, its store's flags, its teacher, and the
    TrainConfig of its csd-train command (the recipe part, then a run's own flags, `--lr` among them) are equal.
    Arms added since (ALM, the advantage weighting) are checked by the test that every arm loads."""
    exp, before = experiment(name), BEFORE[name]
    base = json.loads(json.dumps(parse_args(BEFORE["run"]).to_dict(), default=str))
    assert as_flags(train_options(exp)) == before["train"] and exp.store == before["store"]
    groups = {"arms": exp.arms, **{f"regime_arms.{r}": arms for r, arms in exp.regime_arms.items()}}
    assert list(groups) == [g for g in before if g not in ("train", "store")]
    for group, arms in groups.items():
        assert [a for a in arms if a in before[group]] == list(before[group])   # none lost; arms added since are new
        for arm in (arms[a] for a in before[group]):
            then = before[group][arm.name]
            assert arm_flags(exp, arm) == then["flags"], arm.name
            assert store_args(exp.store_of(arm)) == then["store"], arm.name
            assert arm.teacher == then["teacher"], arm.name
            config = json.loads(json.dumps(parse_args([*train_config_args(exp, arm), *BEFORE["run"]]).to_dict(),
                                           default=str))
            assert {k: v for k, v in config.items() if base[k] != v} == then["config"], arm.name


def test_the_benchmarks_store_settings_are_the_ones_they_were():
    from bench import bench_teacher_store, scale_sheet

    now = {**bench_teacher_store.SETTINGS, **bench_teacher_store.TAIL_SETTINGS, **scale_sheet.SETTINGS}
    assert {name: as_flags(store) for name, store in now.items()} == BEFORE["stores"]
