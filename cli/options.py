"""Click options made from the stage configs, so that each default and help text is written once.

`config_option(AlignConfig, "max_student_tokens")` is the flag `--max-student-tokens` with the
field's default and help; the parsed value reaches the command under the field's name, in the
field's unit, ready for `AlignConfig(**values)`. `placement_options` adds `--workers`, `--rank`,
`--world-size` (the executor's `Placement`) and the engine's options (`EngineConfig`).
"""

from __future__ import annotations

import typing
from dataclasses import MISSING

import click

from csd_pipeline.runtime.options import config_field, default_of

_CLICK_TYPES = {int: int, float: float, str: str}


def _value_type(cls, name: str):
    """(element type, is_list) of a config field from its annotation (list[int] -> (int, True))."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0] if args else hint), False


def config_option(cls, name: str, *decls: str, unit: int | None = None, invert: bool = False, **click_kwargs):
    """A click option for field `name` of the config dataclass `cls`.

    decls: the flag (default `--name-with-dashes`). unit: the flag takes the value in units of
    `unit` (e.g. MiB for a field in bytes). invert: a flag that sets a True-by-default field to
    False (`--no-context-token`). A field without default is a required option; a list field is a
    repeatable one. click_kwargs override what is derived (type, nargs, ...).
    """
    meta = config_field(cls, name).metadata
    default = default_of(cls, name)
    value_type, is_list = _value_type(cls, name)
    flag = decls or (f"--{name.replace('_', '-')}",)
    kwargs: dict = {"help": meta.get("help")}
    if invert:
        kwargs.update(is_flag=True, flag_value=not default, default=default)
    elif value_type is bool:
        kwargs.update(is_flag=True, default=default)
    elif is_list:
        kwargs.update(multiple=True, required=default is MISSING, type=_CLICK_TYPES.get(value_type))
    elif default is MISSING:
        kwargs.update(required=True, type=_CLICK_TYPES.get(value_type))
    else:
        shown = default / unit if unit else default
        kwargs.update(default=shown, show_default=default is not None, type=float if unit else _CLICK_TYPES.get(value_type))
    if meta.get("choices"):
        kwargs["type"] = click.Choice(list(meta["choices"]))
    if unit:
        kwargs["callback"] = lambda ctx, param, value: _in_unit(value, unit, flag[0])
    kwargs.update(click_kwargs)
    if kwargs.get("type") is None:
        kwargs.pop("type", None)
    return click.option(*flag, name, **kwargs)


def _in_unit(value: float, unit: int, flag: str) -> int:
    """`value` units as an int (bytes from MiB); a non-finite number is refused naming `flag`."""
    import math

    if not math.isfinite(value):
        raise click.BadParameter(f"{flag} {value} is not a finite number; pass e.g. {flag} 1.")
    return int(value * unit)


def placement_options(workers_help: str, who: str, who_plural: str):
    """`--workers`, `--rank`, `--world-size` and the engine's options (`--engine`, `--ray-address`, ...) of a
    stage command (`executor.Placement`, `ray_engine.EngineConfig`); `who` is what a rank is ("machine",
    "process")."""
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
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def values_for(cls, options: dict) -> dict:
    """The entries of `options` that are fields of the config dataclass `cls` (lists from tuples)."""
    import dataclasses

    values = {}
    for f in dataclasses.fields(cls):
        if f.name in options:
            value = options[f.name]
            values[f.name] = list(value) if isinstance(value, tuple) and _value_type(cls, f.name)[1] else value
    return values
