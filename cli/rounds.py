"""`csd-pipeline rounds`: on-policy rounds (generate, align, teacher-logits, csd-train, export), R times.

Every option is a field of `RoundsConfig` (`csd_pipeline/generate/rounds.py`); docs/ONPOLICY.md.
"""

from __future__ import annotations

import click

from csd_pipeline.generate.rounds import RoundsConfig
from csd_pipeline.runtime.options import config_option, values_for


@click.command()
@config_option(RoundsConfig, "student")
@config_option(RoundsConfig, "teacher")
@config_option(RoundsConfig, "teacher_tokenizer")
@config_option(RoundsConfig, "prompts", "--prompts", type=click.Path())
@config_option(RoundsConfig, "output", type=click.Path(file_okay=False))
@config_option(RoundsConfig, "rounds")
@config_option(RoundsConfig, "steps")
@config_option(RoundsConfig, "prompt_field")
@config_option(RoundsConfig, "prompt_chars")
@config_option(RoundsConfig, "max_new_tokens")
@config_option(RoundsConfig, "temperature")
@config_option(RoundsConfig, "top_p")
@config_option(RoundsConfig, "samples_per_prompt")
@config_option(RoundsConfig, "seed")
@config_option(RoundsConfig, "max_student_tokens")
@config_option(RoundsConfig, "top_k", "--top-k")
@config_option(RoundsConfig, "divergence")
@config_option(RoundsConfig, "ce")
@config_option(RoundsConfig, "train_args", "--train-arg")
@config_option(RoundsConfig, "device")
@click.option("--quiet", is_flag=True, help="Print nothing but errors (csd-train still prints its own).")
def rounds(quiet, **options):
    """Run R on-policy rounds; each round's outputs stay in DIR/round-r/ and re-running resumes."""
    from csd_pipeline.generate.rounds import run_rounds

    config = RoundsConfig(**values_for(RoundsConfig, options))
    export = run_rounds(config, log=(lambda message: None) if quiet else (lambda m: click.echo(m, err=True)))
    click.echo(f"last student: {export}")
