"""`csd-pipeline teacher-logits`: run the teacher once over aligned shards and store its top-k.

Every option is a field of `TeacherLogitsConfig` (`csd_pipeline/teacher/config.py`), which holds
its default and help; `run_teacher_logits` takes the config to the executor and the shard writer.
"""

from __future__ import annotations

import click

from cli.options import config_option, placement_options
from cli.outputs import run_stage_command
from csd_pipeline.teacher.config import TeacherLogitsConfig


@click.command()
@config_option(TeacherLogitsConfig, "aligned", type=click.Path(file_okay=False))
@config_option(TeacherLogitsConfig, "teacher")
@config_option(TeacherLogitsConfig, "output", type=click.Path(file_okay=False))
@config_option(TeacherLogitsConfig, "teacher_index")
@config_option(TeacherLogitsConfig, "top_k", "--top-k")
@config_option(TeacherLogitsConfig, "top_p", "--top-p")
@config_option(TeacherLogitsConfig, "min_p", "--min-p")
@config_option(TeacherLogitsConfig, "tail_samples")
@config_option(TeacherLogitsConfig, "sample_seed")
@config_option(TeacherLogitsConfig, "keep")
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
