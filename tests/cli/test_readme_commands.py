"""The README's pretrained-student commands run as written: every flag and value is one the tools accept."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _commands(heading: str) -> list[list[str]]:
    """The commands of the first code block under `heading` (continuation lines joined, comments dropped)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    joined = re.sub(r"\\\n\s*", " ", block)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def test_the_pretrained_student_commands_parse(tmp_path, monkeypatch):
    import click

    from cli.main import cli
    from trainer.options import parse_args

    commands = _commands("### A pretrained student, a teacher of another tokenizer")
    assert [c[0] for c in commands] == ["csd-pipeline", "csd-pipeline", "csd-train"]
    monkeypatch.chdir(README.parent)  # the corpus path is relative to the repository
    for argv in commands:
        if argv[0] == "csd-train":
            config = parse_args(argv[1:])
            assert config.loss.loss == "csd" and config.student.student == "smollm2-135m-instruct"
            continue
        with click.Context(cli) as ctx:
            command = cli.get_command(ctx, argv[1])
            command.make_context(argv[1], argv[2:], parent=ctx)  # raises on an unknown flag or a bad value
    with pytest.raises(click.exceptions.NoSuchOption), click.Context(cli) as ctx:
        cli.get_command(ctx, "align").make_context("align", ["--no-such-flag"], parent=ctx)
