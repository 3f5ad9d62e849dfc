"""The shipped recipes (package data: `csd_pipeline/recipes/<group>/<name>.yaml`, listed by `csd-pipeline
recipes`): a training recipe is YAML that `csd-train --config` reads, a store recipe says what `teacher-logits`
keeps; both load here and turn into the command-line flags they stand for. A recipe is named by its path under
this folder without `.yaml` (`pretrained/csd_kl_b1_t1.5_fixed0.5`, `stores/top-128`), or by a path of one's own.

A training recipe is a flat mapping of `csd-train` options (`loss: csd`, `teacher_temperature: 1.5`); several
files apply in order, a later one winning (`csd-train --config train.yaml --config arm.yaml`). A store recipe
is a mapping of the teacher store's selection options (STORE_KEYS), the fields of `TeacherLogitsConfig` of
the same names, and also the `config` that `chain_from_config` takes.
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import CsdError

RECIPES = Path(__file__).resolve().parent
EXPERIMENTS_FILE = "experiments.yaml"  # the benchmarks' sweeps (bench/experiments/plan.py), not a recipe
STORE_KEYS = ("top_k", "top_p", "min_p", "tail_samples", "keep")


def recipe_path(name: str | Path) -> Path:
    """The file of `name`: a path of one's own when that file exists (or is absolute), else the shipped recipe of
    that name (`.yaml` added when it does not end so)."""
    own = Path(name)
    named = own if own.suffix in (".yaml", ".yml") else own.with_name(own.name + ".yaml")
    for path in (own, named):
        if path.is_absolute() or path.is_file():
            return path
    return RECIPES / named


def shipped_recipes() -> list[str]:
    """The names of the shipped recipes (`demo/train`, `stores/top-128`, ...), sorted."""
    return sorted(path.relative_to(RECIPES).with_suffix("").as_posix() for path in RECIPES.rglob("*.yaml")
                  if path.name != EXPERIMENTS_FILE)


def load_recipe(name: str | Path) -> dict:
    """A recipe's mapping of option: value, in file order; raise `CsdError` for a missing or malformed file."""
    import yaml

    path = recipe_path(name)
    if not path.is_file():
        raise CsdError(f"recipe {name} does not exist (looked for {path}); name a file of your own or a shipped "
                       f"recipe (`csd-pipeline recipes` lists them)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise CsdError(f"recipe {path} is not valid YAML ({str(err).splitlines()[0]}); fix the file") from None
    if not isinstance(data, dict) or any(isinstance(v, (dict, list)) for v in data.values()):
        raise CsdError(f"recipe {path} must be a flat mapping of option: value; fix the file")
    return data


def load_store(name: str | Path) -> dict:
    """A store recipe's mapping (keys of STORE_KEYS only); raise `CsdError` naming an unknown key."""
    return check_store(load_recipe(name), f"store recipe {recipe_path(name)}")


def check_store(store: dict, where: str) -> dict:
    """`store` when it sets only STORE_KEYS; raise `CsdError` naming `where` and the unknown key(s)."""
    unknown = sorted(set(store) - set(STORE_KEYS))
    if unknown:
        raise CsdError(f"{where}: unknown key(s) {unknown}; a store recipe sets only {', '.join(STORE_KEYS)}")
    return store


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def as_flags(options: dict) -> list[str]:
    """`{seq_len: 256, progress: false}` -> `["--seq-len", "256", "--progress", "false"]`, in the mapping's order
    (the spelling both `csd-train` and the stage CLIs take)."""
    return [token for key, value in options.items() for token in (f"--{key.replace('_', '-')}", _text(value))]


def as_overrides(options: dict) -> list[str]:
    """`{seq_len: 256, progress: false}` -> `["seq_len=256", "progress=false"]`: csd-train's `key=value` form,
    which sets a value as a `--config` file does (a list is replaced, never appended to)."""
    return [f"{key}={_text(value)}" for key, value in options.items()]


def recipe_flags(*names: str | Path) -> list[str]:
    """The flags of one or more recipe files, applied in order (what `--config A --config B` sets)."""
    merged: dict = {}
    for name in names:
        merged.update(load_recipe(name))
    return as_flags(merged)


def store_flags(name: str | Path) -> list[str]:
    """The `teacher-logits` flags of a store recipe (`["--top-k", "128", "--min-p", "0.02", ...]`)."""
    return as_flags(load_store(name))
