"""The experiments as recipes/experiments.yaml declares them: regimes, store, arms (csd-train recipes) and seeds.

`experiment(name)` reads and checks one declaration. An arm is a name, its recipe (a YAML file under
`recipes/` that `csd-train --config` reads after the experiment's training recipe), and the store its teacher
rows come from (a store recipe under `recipes/stores/`, the experiment's `store` unless the arm names one) or,
for `prune`, which teacher's store it reads. `train_config_args(experiment, arm)` is the `--config` part of
the arm's `csd-train` command; the experiment's module adds the regime's data, steps and seed after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.recipes import RECIPES, load_recipe, load_store, recipe_flags, recipe_path

EXPERIMENTS = RECIPES / "experiments.yaml"
ARM_FIELDS = ("recipe", "store", "teacher")


@dataclass(frozen=True)
class Arm:
    """One arm: its recipe file, and the store (or, for `prune`, the teacher) it reads; None: the default."""

    name: str
    recipe: str
    store: str | None = None
    teacher: str | None = None


@dataclass(frozen=True)
class Experiment:
    """One experiment of recipes/experiments.yaml."""

    name: str
    train: str
    regimes: dict[str, dict]  # name: {steps, and train/heldout files or every}
    store: str
    seeds: tuple[int, ...]
    arms: dict[str, Arm]
    regime_arms: dict[str, dict[str, Arm]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # default_arms, comparison_arms, ...: what one experiment alone uses

    def arms_of(self, regime: str) -> dict[str, Arm]:
        """The arms a regime runs (its own `regime_arms` where it has them)."""
        return self.regime_arms.get(regime, self.arms)

    def all_arm_names(self) -> list[str]:
        return list(dict.fromkeys([*self.arms, *(a for arms in self.regime_arms.values() for a in arms)]))

    def store_of(self, arm: Arm) -> str:
        return arm.store or self.store


def _arms(name: str, where: str, mapping) -> dict[str, Arm]:
    if not isinstance(mapping, dict) or not mapping:
        raise CsdError(f"{EXPERIMENTS}: {where} must map arm names to {{recipe: ...}}; fix the file")
    arms = {}
    for arm, fields in mapping.items():
        if not isinstance(fields, dict) or "recipe" not in fields or set(fields) - set(ARM_FIELDS):
            raise CsdError(f"{EXPERIMENTS}: {where}, arm {arm!r} needs a recipe and may set only "
                           f"{', '.join(ARM_FIELDS)}; fix the file")
        arms[str(arm)] = Arm(str(arm), **{k: str(v) for k, v in fields.items()})
    return arms


@cache
def experiment(name: str) -> Experiment:
    """The declaration `name` of recipes/experiments.yaml, with every recipe and store it names checked to load."""
    import yaml

    declared = yaml.safe_load(EXPERIMENTS.read_text(encoding="utf-8"))
    if name not in declared:
        raise CsdError(f"{EXPERIMENTS}: no experiment {name!r}; declared: {', '.join(declared)}")
    spec = dict(declared[name])
    missing = [key for key in ("train", "regimes", "store", "seeds", "arms") if key not in spec]
    if missing:
        raise CsdError(f"{EXPERIMENTS}: experiment {name!r} lacks {', '.join(missing)}; add it")
    regime_arms = {str(r): _arms(name, f"{name}.regime_arms.{r}", m) for r, m in (spec.pop("regime_arms", None) or {}).items()}
    regimes = spec.pop("regimes")
    if not isinstance(regimes, dict) or not all(isinstance(r, dict) and "steps" in r for r in regimes.values()):
        raise CsdError(f"{EXPERIMENTS}: {name}.regimes must map each regime to {{steps: N, ...}}; fix the file")
    found = Experiment(name=name, train=str(spec.pop("train")), regimes={str(k): dict(v) for k, v in regimes.items()},
                       store=str(spec.pop("store")), seeds=tuple(int(s) for s in spec.pop("seeds")),
                       arms=_arms(name, f"{name}.arms", spec.pop("arms")), regime_arms=regime_arms, extra=spec)
    load_recipe(found.train)
    for arms in (found.arms, *regime_arms.values()):
        for arm in arms.values():
            load_recipe(arm.recipe)
            load_store(store_path(found.store_of(arm)))
    return found


def store_path(store: str) -> Path:
    """The file of the store recipe called `store` (`recipes/stores/<store>.yaml`)."""
    return recipe_path(f"stores/{store}")


def train_config_args(exp: Experiment, arm: Arm) -> list[str]:
    """`--config <training recipe> --config <arm recipe>`: the recipe part of the arm's csd-train command."""
    return ["--config", str(recipe_path(exp.train)), "--config", str(recipe_path(arm.recipe))]


def arm_flags(exp: Experiment, arm: Arm) -> list[str]:
    """The arm's recipe as flags (what a result records as `args`, as the old flag lists did)."""
    return recipe_flags(arm.recipe)


def pick_arms(exp: Experiment, text: str | None, default: list[str] | None = None) -> list[str]:
    """The arms named in `text` (comma-separated), or `default`, or every arm; raise `CsdError` naming the unknown."""
    known = exp.all_arm_names()
    arms = [a.strip() for a in text.split(",")] if text else list(default or exp.arms)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise CsdError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(known)} (recipes/experiments.yaml)")
    return arms


def pick_seeds(text: str | None, default: tuple[int, ...]) -> list[int]:
    """Comma-separated seeds, or `default`; raise `CsdError` for anything else."""
    if not text:
        return list(default)
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise CsdError(f"--seeds: {text!r} is not a comma-separated list of integers, e.g. --seeds 0,1,2") from None
