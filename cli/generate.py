"""`csd-pipeline generate`: the student writes completions for a prompt corpus (on-policy data).

Every option is a field of `GenerateConfig` (`csd_pipeline/generate/config.py`), which holds its
default and help; `run_generate` takes the config to the executor and the shard writer.
"""

from __future__ import annotations

import click

from cli.outputs import run_stage_command
from csd_pipeline.generate.config import GenerateConfig
from csd_pipeline.runtime.options import config_option, placement_options


@click.command()
@config_option(GenerateConfig, "model")
@config_option(GenerateConfig, "corpus", "--corpus", type=click.Path())
@config_option(GenerateConfig, "output", type=click.Path(file_okay=False))
@config_option(GenerateConfig, "mode")
@config_option(GenerateConfig, "chat_template", type=click.Path(dir_okay=False))
@config_option(GenerateConfig, "prompt_field")
@config_option(GenerateConfig, "prompt_chars")
@config_option(GenerateConfig, "max_new_tokens")
@config_option(GenerateConfig, "temperature")
@config_option(GenerateConfig, "top_p")
@config_option(GenerateConfig, "samples_per_prompt")
@config_option(GenerateConfig, "seed")
@config_option(GenerateConfig, "batch_size")
@config_option(GenerateConfig, "prompts_per_shard")
@config_option(GenerateConfig, "backend")
@config_option(GenerateConfig, "device")
@config_option(GenerateConfig, "dtype")
@placement_options("Processes on this machine, each with its own copy of the student (whole shards each).",
                   "process", "processes")
@config_option(GenerateConfig, "trust_remote_code")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def generate(**options):
    """Sample completions from the student for every prompt (docs/ONPOLICY.md); re-running resumes, and the
    output folder is a corpus for `csd-pipeline align`."""
    from csd_pipeline.generate.stage import run_generate

    run_stage_command(GenerateConfig, run_generate, options)
