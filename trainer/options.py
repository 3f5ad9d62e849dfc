"""Where `csd-train`'s option values come from: defaults, a YAML file, `key=value` and flags; `--help`.

Sources apply in order: the defaults (on the `trainer.config` dataclass fields), the `--config`
YAML file, then the command line from left to right (a later value wins; a repeated list flag such
as `--teacher-logits` appends). Every option has one flat name: `seq_len` in YAML and `key=value`
(where `seq-len` is accepted too), `--seq-len` as a flag. Errors name the option to change.

This is a layer on top of the one option system (`csd_pipeline/runtime/options.py`): the fields, their
types, the flag spelling and the coercion of a value are the stage commands'; only the sources
(YAML, `key=value`, their order) and the help layout are csd-train's.
"""

from __future__ import annotations

import os
import typing

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime import options
from csd_pipeline.runtime.options import FALSE_WORDS, TRUE_WORDS, flag
from trainer.config import OPTIONS, TrainConfig


def coerce(name: str, value, origin: str):
    """A YAML or command-line value of option `name` as its field's type (`runtime.options.coerce`)."""
    return options.coerce(name, OPTIONS[name].hint, value, origin)


# options renamed so that no word carries two meanings ("keep" is what a teacher store keeps): old -> new
RENAMED = {"loss_keep_mb": "loss_reuse_mb", "loss_keep_dtype": "loss_reuse_dtype", "keep_last": "save_total_limit"}


def known(name: str, origin: str) -> str:
    """The option called `name` (dashes or underscores); raise `CsdError` with close names when unknown."""
    key = name.replace("-", "_")
    if key in RENAMED:
        raise CsdError(f"option {name!r} in {origin} is now {RENAMED[key]!r} (--{RENAMED[key].replace('_', '-')}); "
                       "rename it there")
    if key not in OPTIONS:
        close = [k for k in OPTIONS if k.startswith(key[:4])]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise CsdError(f"unknown option {name!r} in {origin}{hint}; run `csd-train --help` for the list")
    return key


def load_yaml(path: str) -> dict:
    """Read a YAML mapping of options from the file `path`, or else from the shipped recipe of that name
    (`pretrained/csd_kl_b1_t1.5_fixed0.5`; `csd-pipeline recipes`); raise `CsdError` for a missing or malformed
    file."""
    import yaml

    if not os.path.isfile(path):
        from csd_pipeline.recipes import recipe_path

        shipped = recipe_path(path)
        if not shipped.is_file():
            raise CsdError(f"config file {path} does not exist; pass an existing YAML file or a shipped recipe's "
                           f"name to --config (`csd-pipeline recipes` lists them)")
        path = str(shipped)
    with open(path, encoding="utf-8") as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as err:
            first = str(err).splitlines()[0] if str(err) else "parse error"
            raise CsdError(f"config file {path} is not valid YAML ({first}); fix the file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CsdError(f"config file {path} must hold a mapping of option: value, not {type(data).__name__}")
    return data


def _split_config_files(argv: list[str]) -> tuple[list[str], list[str]]:
    """(YAML paths of `--config`, the rest of `argv`): the files apply first, wherever they appear."""
    paths, rest = [], []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--config" or token.startswith("--config="):
            if "=" in token:
                paths.append(token.split("=", 1)[1])
            elif i + 1 < len(argv):
                paths.append(argv[i + 1])
                i += 1
            else:
                raise CsdError("--config needs a YAML file path")
        else:
            rest.append(token)
        i += 1
    return paths, rest


def _apply_command_line(tokens: list[str], values: dict) -> None:
    """Apply `--flag VALUE`, `--flag=VALUE`, `--bool-flag`, `--no-bool-flag` and `key=value` in order."""
    explicit_lists: set[str] = set()
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("--"):
            raw, has_value, inline = token[2:].partition("=")
            negated = raw.startswith("no-") and raw[3:].replace("-", "_") in OPTIONS
            name = known(raw[3:] if negated else raw, "the command line")
            hint = OPTIONS[name].hint
            if hint is bool and not has_value and not negated and i + 1 < len(tokens) and tokens[i + 1].lower() in (
                    *TRUE_WORDS, *FALSE_WORDS):  # `--progress false`
                values[name] = coerce(name, tokens[i + 1], f"--{flag(name)}")
                i += 1
            elif hint is bool and not has_value:
                values[name] = not negated
            else:
                if negated:
                    raise CsdError(f"--{raw} takes no value; use --{flag(name)} VALUE")
                if not has_value:
                    if i + 1 >= len(tokens):
                        raise CsdError(f"--{flag(name)} needs a value")
                    inline = tokens[i + 1]
                    i += 1
                value = coerce(name, inline, f"--{flag(name)}")
                if typing.get_origin(hint) is list:
                    if name not in explicit_lists:  # a flag replaces the YAML list, repeats append
                        values[name] = []
                        explicit_lists.add(name)
                    value = values[name] + value
                values[name] = value
        elif "=" in token:
            key, _, value = token.partition("=")
            name = known(key, f"override {token!r}")
            values[name] = coerce(name, value, f"override {token!r}")
        else:
            raise CsdError(f"unexpected argument {token!r}; options are --flag VALUE or key=value")
        i += 1


def parse_args(argv: list[str]) -> TrainConfig:
    """Resolve defaults, `--config FILE.yaml`, flags and `key=value` into a validated `TrainConfig`."""
    values: dict = {}
    paths, rest = _split_config_files(list(argv))
    for path in paths:
        for key, value in load_yaml(path).items():
            name = known(str(key), f"config file {path}")
            values[name] = coerce(name, value, f"config file {path}")
    _apply_command_line(rest, values)
    return TrainConfig.from_options(values).validate()


def help_text() -> str:
    """The `csd-train --help` text, generated from the config dataclasses (one section per component)."""
    lines = [
        "usage: csd-train [--config FILE.yaml] [key=value ...] [--option VALUE ...]",
        "",
        "Train a student with Common-Support Distillation from cached aligned + teacher top-k shards.",
        "Single process: `csd-train ...`; N ranks: `torchrun --nproc-per-node N --no-python csd-train ...`.",
        "",
        "options (YAML key / key=value use underscores, flags use dashes):",
    ]
    section = object()
    for option in OPTIONS.values():
        if option.component != section:
            section = option.component
            lines.append(f" {section if section else 'run'}:")
        lines.append(f"  --{flag(option.name):22s} {option.field.metadata.get('help', '')} "
                     f"[default: {option.default}]")
    lines += [" object storage (never saved with the run; see docs/SCALE.md):",
              f"  --{'storage-options JSON':22s} fsspec options for s3:// / gs:// paths (credentials otherwise from "
              "the AWS_* / gcloud environment)",
              f"  --{'cache-dir DIR':22s} keep sha256-checked local copies of the object-store shards read"]
    return "\n".join(lines)
