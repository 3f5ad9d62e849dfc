"""The experiments as csd_pipeline/recipes/experiments.yaml declares them: regimes, store, arms and seeds.

`experiment(name)` reads and checks one declaration. An arm is a name, its csd-train options (the overrides it
applies after the experiment's training recipe; inline, or a shipped recipe it names with `recipe`, or both),
and the store its teacher rows come from (a store recipe under `recipes/stores/` or one of the file's own
`stores:`, the experiment's `store` unless the arm names one) or, for `prune`, which teacher's store it reads.
`train_config_args(experiment, arm)` is the recipe part of the arm's `csd-train` command; the experiment's module
adds the regime's data, steps and seed after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from csd_pipeline.errors import CsdError
from csd_pipeline.recipes import (
    RECIPES,
    as_flags,
    as_overrides,
    check_store,
    load_recipe,
    load_store,
    recipe_path,
)

EXPERIMENTS = RECIPES / "experiments.yaml"
ARM_FIELDS = ("recipe", "store", "teacher")  # an arm's other keys are csd-train options
STORES = "stores"  # the top-level key of the store settings that are not files


@dataclass(frozen=True)
class Arm:
    """One arm: its csd-train options (`recipe`, a shipped recipe's name, first, then `options`), and the store
    (or, for `prune`, the teacher) it reads; None: the default."""

    name: str
    options: dict = field(default_factory=dict)
    recipe: str | None = None
    store: str | None = None
    teacher: str | None = None


@dataclass(frozen=True)
class Experiment:
    """One experiment of experiments.yaml."""

    name: str
    train: str | dict  # a shipped recipe's name, or the options themselves
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


def _options(mapping: dict, where: str) -> dict:
    """`mapping` when every key is a csd-train option and every value a scalar; raise `CsdError` naming `where`."""
    from trainer.options import known

    for key, value in mapping.items():
        known(str(key), f"{EXPERIMENTS}, {where}")
        if isinstance(value, (dict, list)) or value is None:
            raise CsdError(f"{EXPERIMENTS}: {where}, option {key!r} must be one value; fix the file")
    return dict(mapping)


def _arms(name: str, where: str, mapping) -> dict[str, Arm]:
    if not isinstance(mapping, dict) or not mapping:
        raise CsdError(f"{EXPERIMENTS}: {where} must map arm names to their options ({{loss: ce}}); fix the file")
    arms = {}
    for arm, fields in mapping.items():
        if not isinstance(fields, dict) or not fields:
            raise CsdError(f"{EXPERIMENTS}: {where}, arm {arm!r} must be a mapping of csd-train options, and may "
                           f"set {', '.join(ARM_FIELDS)}; fix the file")
        own = {k: str(v) for k, v in fields.items() if k in ARM_FIELDS}
        options = _options({k: v for k, v in fields.items() if k not in ARM_FIELDS}, f"{where}, arm {arm!r}")
        arms[str(arm)] = Arm(str(arm), options, **own)
    return arms


@cache
def declared() -> dict:
    """experiments.yaml as a mapping (the experiments, and `stores`)."""
    import yaml

    return yaml.safe_load(EXPERIMENTS.read_text(encoding="utf-8"))


def experiment_names() -> list[str]:
    return [name for name in declared() if name != STORES]


@cache
def experiment(name: str) -> Experiment:
    """The declaration `name` of experiments.yaml, with every recipe and store it names checked to load."""
    if name not in experiment_names():
        raise CsdError(f"{EXPERIMENTS}: no experiment {name!r}; declared: {', '.join(experiment_names())}")
    spec = dict(declared()[name])
    missing = [key for key in ("train", "regimes", "store", "seeds", "arms") if key not in spec]
    if missing:
        raise CsdError(f"{EXPERIMENTS}: experiment {name!r} lacks {', '.join(missing)}; add it")
    regime_arms = {str(r): _arms(name, f"{name}.regime_arms.{r}", m) for r, m in (spec.pop("regime_arms", None) or {}).items()}
    regimes = spec.pop("regimes")
    if not isinstance(regimes, dict) or not all(isinstance(r, dict) and "steps" in r for r in regimes.values()):
        raise CsdError(f"{EXPERIMENTS}: {name}.regimes must map each regime to {{steps: N, ...}}; fix the file")
    train = spec.pop("train")
    train = _options(train, f"{name}.train") if isinstance(train, dict) else str(train)
    found = Experiment(name=name, train=train, regimes={str(k): dict(v) for k, v in regimes.items()},
                       store=str(spec.pop("store")), seeds=tuple(int(s) for s in spec.pop("seeds")),
                       arms=_arms(name, f"{name}.arms", spec.pop("arms")), regime_arms=regime_arms, extra=spec)
    train_options(found)
    for arms in (found.arms, *regime_arms.values()):
        for arm in arms.values():
            arm_options(arm)
            store_settings(found.store_of(arm))
    return found


def store_settings(store: str) -> dict:
    """The `teacher-logits` settings of the store called `store`: experiments.yaml's `stores:` entry of that
    name, else the shipped store recipe `stores/<store>`; raise `CsdError` when neither exists."""
    inline = (declared().get(STORES) or {}).get(store)
    if inline is not None:
        return check_store(dict(inline), f"{EXPERIMENTS}, stores.{store}")
    return load_store(f"stores/{store}")


def store_args(store: str) -> list[str]:
    """The `teacher-logits` flags of the store called `store` (`["--top-k", "128", ...]`)."""
    return as_flags(store_settings(store))


def train_options(exp: Experiment) -> dict:
    """The experiment's training recipe as a mapping of options."""
    return dict(exp.train) if isinstance(exp.train, dict) else load_recipe(exp.train)


def arm_options(arm: Arm) -> dict:
    """The arm's options: its recipe's (if it names one), then its own."""
    return {**(load_recipe(arm.recipe) if arm.recipe else {}), **arm.options}


def train_config_args(exp: Experiment, arm: Arm) -> list[str]:
    """The recipe part of the arm's csd-train command: `--config` of each recipe file, then the inline options
    as `key=value` (which csd-train applies as it applies a file's, before the module's own flags)."""
    files = [name for name in (None if isinstance(exp.train, dict) else exp.train, arm.recipe) if name]
    inline = {**(exp.train if isinstance(exp.train, dict) else {}), **arm.options}
    return [*(token for name in files for token in ("--config", str(recipe_path(name)))), *as_overrides(inline)]


def arm_flags(exp: Experiment, arm: Arm) -> list[str]:
    """The arm's options as flags (what a result records as `args`, as the old flag lists did)."""
    return as_flags(arm_options(arm))


def is_ce_arm(name: str) -> bool:
    """`ce` and its tuned variants (`ce lr1e-4`, ...): the arms among which CE's best is taken."""
    return name == "ce" or name.startswith("ce ")


def best_ce_arm(runs: dict[str, dict[int, float]]) -> tuple[str | None, float | None]:
    """CE tuned: of the CE arms among `runs` (arm -> seed -> figure, lower is better), the one that beats the most
    other CE arms, two arms compared on the seeds both ran (on their whole means where they share none), so that an
    arm run on one easy seed does not win on that seed alone; ties go to more seeds, then the lower mean. Returns
    that arm and its mean over its seeds; (None, None) when no CE arm ran."""
    ce = {arm: seeds for arm, seeds in runs.items() if is_ce_arm(arm) and seeds}
    if not ce:
        return None, None

    def mean(arm: str, seeds) -> float:
        return sum(ce[arm][seed] for seed in seeds) / len(seeds)

    def beats(a: str, b: str) -> bool:
        common = sorted(ce[a].keys() & ce[b].keys())
        return mean(a, common or list(ce[a])) < mean(b, common or list(ce[b]))

    best = min(ce, key=lambda a: (-sum(beats(a, b) for b in ce if b != a), -len(ce[a]), mean(a, list(ce[a]))))
    return best, mean(best, list(ce[best]))


def pick_arms(exp: Experiment, text: str | None, default: list[str] | None = None) -> list[str]:
    """The arms named in `text` (comma-separated), or `default`, or every arm; raise `CsdError` naming the unknown."""
    known = exp.all_arm_names()
    arms = [a.strip() for a in text.split(",")] if text else list(default or exp.arms)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise CsdError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(known)} (csd_pipeline/recipes/experiments.yaml)")
    return arms


def pick_seeds(text: str | None, default: tuple[int, ...]) -> list[int]:
    """Comma-separated seeds, or `default`; raise `CsdError` for anything else."""
    if not text:
        return list(default)
    try:
        return [int(seed) for seed in text.split(",")]
    except ValueError:
        raise CsdError(f"--seeds: {text!r} is not a comma-separated list of integers, e.g. --seeds 0,1,2") from None
