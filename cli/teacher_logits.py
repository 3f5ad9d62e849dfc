"""`csd-pipeline teacher-logits`: run the teacher once over aligned shards and store its top-k.

Every option is a field of `TeacherLogitsConfig` (`csd_pipeline/teacher/config.py`), which holds
its default and help; `run_teacher_logits` takes the config to the executor and the shard writer.
"""

from __future__ import annotations

import click

from cli.outputs import run_stage_command
from csd_pipeline.runtime.options import config_option, placement_options
from csd_pipeline.teacher.config import TeacherLogitsConfig


def selector_options(command):
    """A flag for each option of the store's selectors (the `TeacherLogitsConfig` fields marked `selector=True`), in
    field order, so that a new selector's option needs no line here."""
    from dataclasses import fields

    for f in reversed([f for f in fields(TeacherLogitsConfig) if f.metadata.get("selector")]):
        command = config_option(TeacherLogitsConfig, f.name)(command)
    return command


@click.command()
@config_option(TeacherLogitsConfig, "aligned", type=click.Path(file_okay=False))
@config_option(TeacherLogitsConfig, "teacher")
@config_option(TeacherLogitsConfig, "teacher_server")
@config_option(TeacherLogitsConfig, "teacher_model")
@config_option(TeacherLogitsConfig, "server_top_k")
@config_option(TeacherLogitsConfig, "server_concurrency")
@config_option(TeacherLogitsConfig, "server_timeout")
@config_option(TeacherLogitsConfig, "output", type=click.Path(file_okay=False))
@config_option(TeacherLogitsConfig, "teacher_index")
@selector_options
@config_option(TeacherLogitsConfig, "batch_tokens")
@config_option(TeacherLogitsConfig, "device")
@config_option(TeacherLogitsConfig, "dtype")
@config_option(TeacherLogitsConfig, "temperature")
@config_option(TeacherLogitsConfig, "block_positions")
@config_option(TeacherLogitsConfig, "check_tokenizer", "--skip-tokenizer-check", invert=True)
@placement_options("Processes on this machine, each with its own copy of the teacher (whole shards each).",
                   "process", "processes")
@config_option(TeacherLogitsConfig, "trust_remote_code")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def teacher_logits(**options):
    """Store the teacher's top-k log-probabilities for every aligned teacher position (SPEC §6); re-running
    resumes, and `torchrun --nproc-per-node N` splits the shards over N processes."""
    from csd_pipeline.teacher.stage import run_teacher_logits

    run_stage_command(TeacherLogitsConfig, run_teacher_logits, options)
