"""Options of the stage configs: each dataclass field carries its default and its help, once.

The stage configs (`AlignConfig`, `TeacherLogitsConfig`, the table configs) declare every option
with `option(default, help)`; the command line (`cli/options.py`) builds its flags from these
fields, so a default or a help text is written in one place. Only the standard library here: the
configs are imported by `--help`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, field

MIB = 1 << 20


def option(default=MISSING, help: str = "", **metadata):
    """A config field with a default (MISSING: required) and its help text.

    A list default is copied for every instance. `metadata` may add "choices" (allowed values).
    """
    meta = {"help": help, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def config_field(cls, name: str) -> dataclasses.Field:
    """The dataclass field `name` of the config class `cls` (ValueError when there is none)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f
    raise ValueError(f"{cls.__name__} has no option {name!r}")


def default_of(cls, name: str):
    """The default value of option `name` of `cls` (MISSING when it is required)."""
    f = config_field(cls, name)
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING
