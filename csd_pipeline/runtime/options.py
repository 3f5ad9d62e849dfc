"""Options of every config, for both command lines: each dataclass field carries its default, help and choices once.

Every config dataclass (the stage configs `AlignConfig`, `TeacherLogitsConfig`, `GenerateConfig`, the table
and rounds configs, `EngineConfig`, and csd-train's components in `trainer/config.py`) declares each option
with `option(default, help)`: one declaration per field, nothing written twice. From those fields:

- `config_option(cls, name)` is the click option of a stage command (`--name-with-dashes`, the field's
  type, default, help and choices), one decorator per field; `placement_options` adds the executor's;
- `coerce(hint, value)` turns a YAML or `key=value` value into the field's type, for csd-train's layer of
  `--config` files and `key=value` on top of the same fields (`trainer/options.py`);
- `flag(name)` is the spelling both use, and `check_choices(config)` refuses a value outside a field's
  choices naming the flag.

Only the standard library at import: the configs are imported by `--help` (click is imported by the
functions that build click options).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, field

from csd_pipeline.errors import CsdError

MIB = 1 << 20
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def option(default=MISSING, help: str = "", **metadata):
    """A config field with a default (MISSING: required) and its help text.

    A list default is copied for every instance. `metadata` may add "choices" (allowed values) and, for
    csd-train, "trajectory" (True: a resumed run must keep the value).
    """
    meta = {"help": help, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line spelling of an option (`seq_len` -> `seq-len`)."""
    return name.replace("_", "-")


def config_field(cls, name: str) -> dataclasses.Field:
    """The dataclass field `name` of the config class `cls` (ValueError when there is none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise ValueError(f"{cls.__name__} has no option {name!r}")


def default_of(cls, name: str):
    """The default value of option `name` of `cls` (MISSING when it is required)."""
    return field_default(config_field(cls, name))


def field_default(f: dataclasses.Field):
    """The default of the field `f` (a fresh copy of a list; MISSING when it is required)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def optional_base(hint) -> tuple[object, bool]:
    """(the type without None, whether None is allowed) of a field's annotation (`int | None` -> (int, True))."""
    args = typing.get_args(hint)
    optional = type(None) in args
    return (next(a for a in args if a is not type(None)) if optional else hint), optional


def value_type(cls, name: str) -> tuple[object, bool]:
    """(element type, is_list) of a config field from its annotation (list[int] -> (int, True))."""
    base, _ = optional_base(typing.get_type_hints(cls)[name])
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], True
    return base, False


def _coerce_to(base, value):
    """`value` as `base` (list[str], bool, int, float or str); raises TypeError/ValueError."""
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        raise TypeError
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
        raise ValueError
    if base is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    if base is float:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    if isinstance(value, (dict, list)):
        raise ValueError
    return str(value)


def coerce(name: str, hint, value, origin: str):
    """A YAML or command-line `value` of option `name` as its type `hint` (a list from "a,b"; None from
    "none", "null" or "" where None is allowed); raise `CsdError` naming the option and `origin`."""
    base, optional = optional_base(hint)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
        return None
    try:
        return _coerce_to(base, value)
    except (TypeError, ValueError):
        kind = getattr(base, "__name__", str(base))
        raise CsdError(f"option {name} ({origin}) expects {kind}, got {value!r}; fix the value") from None


def check_choices(config) -> None:
    """Raise `CsdError` naming the flag when a field of `config` holds a value outside its "choices"."""
    for f in dataclasses.fields(config):
        choices = f.metadata.get("choices")
        if choices and getattr(config, f.name) not in choices:
            raise CsdError(f"--{flag(f.name)} must be one of {', '.join(choices)}, got {getattr(config, f.name)!r}")


_CLICK_TYPES = {int: int, float: float, str: str}


def config_option(cls, name: str, *decls: str, unit: int | None = None, invert: bool = False, **click_kwargs):
    """The click option of field `name` of the config dataclass `cls` (a decorator of a stage command).

    decls: the flag (default `--name-with-dashes`). unit: the flag takes the value in units of
    `unit` (e.g. MiB for a field in bytes). invert: a flag that sets a True-by-default field to
    False (`--no-context-token`). A field without default is a required option; a list field is a
    repeatable one. click_kwargs override what is derived (type, nargs, ...). The parsed value reaches
    the command under the field's name, in the field's unit, ready for `cls(**values_for(cls, options))`.
    """
    import click

    meta = config_field(cls, name).metadata
    default = default_of(cls, name)
    element, is_list = value_type(cls, name)
    decls = decls or (f"--{flag(name)}",)
    kwargs: dict = {"help": meta.get("help")}
    if invert:
        kwargs.update(is_flag=True, flag_value=not default, default=default)
    elif element is bool:
        kwargs.update(is_flag=True, default=default)
    elif is_list:
        kwargs.update(multiple=True, required=default is MISSING, type=_CLICK_TYPES.get(element))
    elif default is MISSING:
        kwargs.update(required=True, type=_CLICK_TYPES.get(element))
    else:
        shown = default / unit if unit else default
        kwargs.update(default=shown, show_default=default is not None, type=float if unit else _CLICK_TYPES.get(element))
    if meta.get("choices"):
        kwargs["type"] = click.Choice(list(meta["choices"]))
    if unit:
        kwargs["callback"] = lambda ctx, param, value: _in_unit(value, unit, decls[0])
    kwargs.update(click_kwargs)
    if kwargs.get("type") is None:
        kwargs.pop("type", None)
    return click.option(*decls, name, **kwargs)


def _in_unit(value: float, unit: int, flag_name: str) -> int:
    """`value` units as an int (bytes from MiB); a non-finite number is refused naming the flag."""
    import math

    import click

    if not math.isfinite(value):
        raise click.BadParameter(f"{flag_name} {value} is not a finite number; pass e.g. {flag_name} 1.")
    return int(value * unit)


def placement_options(workers_help: str, who: str, who_plural: str):
    """`--workers`, `--rank`, `--world-size` and the engine's options (`--engine`, `--ray-address`, ...) of a
    stage command (`executor.Placement`, `ray_engine.EngineConfig`); `who` is what a rank is ("machine",
    "process")."""
    import click

    from csd_pipeline.runtime.executor import Placement
    from csd_pipeline.runtime.ray_engine import EngineConfig

    options = (
        click.option("--workers", default=Placement.workers, show_default=True, type=int,
                     help=f"{workers_help} With --engine ray: Ray actors."),
        click.option("--rank", type=int, default=None, help=f"This {who}'s rank (default: RANK or SLURM_PROCID, else 0)."),
        click.option("--world-size", type=int, default=None,
                     help=f"Number of {who_plural} (default: WORLD_SIZE or SLURM_NTASKS, else 1)."),
        config_option(EngineConfig, "engine"),
        config_option(EngineConfig, "ray_address"),
        config_option(EngineConfig, "num_cpus_per_worker"),
        config_option(EngineConfig, "num_gpus_per_worker"),
    )

    def decorate(command):
        for each in reversed(options):
            command = each(command)
        return command

    return decorate


def values_for(cls, options: dict) -> dict:
    """The entries of `options` (a click command's parsed values) that are fields of the config dataclass
    `cls` (lists from tuples)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in options:
            value = options[f.name]
            values[f.name] = list(value) if isinstance(value, tuple) and value_type(cls, f.name)[1] else value
    return values
