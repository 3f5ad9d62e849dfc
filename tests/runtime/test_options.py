"""The one option system: a config field is declared once and both command lines read it the same way."""

from __future__ import annotations

import dataclasses
import typing

import click
import pytest

from csd_pipeline.align.config import AlignConfig
from csd_pipeline.errors import CsdError
from csd_pipeline.generate.config import GenerateConfig
from csd_pipeline.runtime.options import check_choices, coerce, config_option, flag, optional_base
from csd_pipeline.runtime.ray_engine import EngineConfig
from csd_pipeline.teacher.config import TeacherLogitsConfig
from trainer.config import COMPONENTS, OPTIONS, TrainConfig

STAGE_CONFIGS = (AlignConfig, TeacherLogitsConfig, GenerateConfig, EngineConfig)
TEXT = {int: "7", float: "0.25", str: "word"}


def _fields():
    """(config class, field name, element type) of every scalar int/float/str option of both command lines."""
    for cls in (*STAGE_CONFIGS, *COMPONENTS.values(), TrainConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            base, _ = optional_base(hints[f.name])
            if "help" in f.metadata and base in TEXT and not f.metadata.get("choices"):
                yield cls, f.name, base


@pytest.mark.parametrize(("cls", "name", "kind"), list(_fields()), ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_stage_flag_and_a_yaml_value_read_the_same(cls, name, kind):
    """The click option a stage command gets for a field and csd-train's coercion of a YAML or key=value
    value turn the same text into the same value, whichever command line the config belongs to."""
    command = config_option(cls, name)(click.command()(lambda **values: values))
    parsed = command.main([f"--{flag(name)}", TEXT[kind]], standalone_mode=False)
    hint = typing.get_type_hints(cls)[name]
    assert parsed[name] == coerce(name, hint, TEXT[kind], "a test") == kind(TEXT[kind])
    assert type(parsed[name]) is type(coerce(name, hint, TEXT[kind], "a test"))
    declared = next(f for f in dataclasses.fields(cls) if f.name == name).metadata["help"]
    assert " ".join(declared.split()[:3]) in " ".join(command.get_help(click.Context(command)).split())


def test_coerce_reads_yaml_and_command_line_values():
    assert coerce("teacher_logits", list[str], "a,b,", "x") == ["a", "b"]
    assert coerce("teacher_logits", list[str], ("a", 3), "x") == ["a", "3"]
    assert coerce("progress", bool, "Off", "x") is False and coerce("progress", bool, "yes", "x") is True
    assert coerce("kd_teachers", str | None, "null", "x") is None
    assert coerce("gold_matched_weight", float | None, "0.5", "x") == 0.5
    assert coerce("seq_len", int, 256.0, "x") == 256
    for hint, value in ((int, 2.5), (int, True), (bool, "maybe"), (float, "many"), (str, {"a": 1})):
        with pytest.raises(CsdError, match=r"option seq_len \(config file run.yaml\) expects"):
            coerce("seq_len", hint, value, "config file run.yaml")


def test_every_csd_train_option_is_declared_like_a_stage_option():
    """csd-train's fields carry the same metadata as the stage configs' (help, and choices where there are)."""
    for name, each in OPTIONS.items():
        assert each.field.metadata["help"], name
    loss = TrainConfig().loss
    loss.divergence = "tv"
    with pytest.raises(CsdError, match="--divergence must be one of jsd, kl, reverse_kl, got 'tv'"):
        check_choices(loss)
