"""`csd-pipeline align`: tokenize a corpus with the student and every teacher, align, write shards.

Every option is a field of `AlignConfig` (`csd_pipeline/align/config.py`), which holds its default
and help; `run_align` takes the config to the executor and the shard writer.
"""

from __future__ import annotations

import click

from cli.options import config_option, placement_options, values_for
from cli.outputs import echo_run_report
from csd_pipeline.align.config import AlignConfig
from csd_pipeline.runtime.options import MIB


@click.command()
@config_option(AlignConfig, "corpus", "--corpus", type=click.Path())
@config_option(AlignConfig, "student_tokenizer")
@config_option(AlignConfig, "teacher_tokenizers", "--teacher-tokenizer")
@config_option(AlignConfig, "output", type=click.Path(file_okay=False))
@config_option(AlignConfig, "mode")
@config_option(AlignConfig, "max_student_tokens")
@config_option(AlignConfig, "max_teacher_tokens")
@config_option(AlignConfig, "context_token", "--no-context-token", invert=True)
@config_option(AlignConfig, "tables", nargs=2, type=click.Path(dir_okay=False))
@config_option(AlignConfig, "text_field")
@config_option(AlignConfig, "split")
@config_option(AlignConfig, "split_on_blank_lines")
@config_option(AlignConfig, "shard_bytes", "--shard-mb", unit=MIB)
@config_option(AlignConfig, "batch_bytes", "--batch-mb", unit=MIB)
@placement_options("Processes on this machine (whole shards each).", "machine", "machines")
@config_option(AlignConfig, "student_chat_template", type=click.Path(dir_okay=False))
@config_option(AlignConfig, "teacher_chat_templates", "--teacher-chat-template")
@config_option(AlignConfig, "include_thinking")
@config_option(AlignConfig, "alignment_regions")
@config_option(AlignConfig, "drop_first_assistant_chunk")
@config_option(AlignConfig, "trust_remote_code")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def align(workers, rank, world_size, quiet, **options):
    """Align a corpus into shards of windows (SPEC §4, §7, §8); re-running resumes."""
    from csd_pipeline.align.stage import run_align

    config = AlignConfig(**values_for(AlignConfig, options))
    log = None if quiet else (lambda message: click.echo(message, err=True))
    report = run_align(config, rank=rank, world_size=world_size, workers=workers, log=log)
    if not quiet:
        echo_run_report(config.output, report)
