"""`csd-pipeline align`: tokenize a corpus with the student and every teacher, align, write shards.

`--capture-only` writes a teacher capture (no student) and `--against-capture DIR` aligns a student
against one (docs/CAPTURE.md).

Every option is a field of `AlignConfig` (`csd_pipeline/align/config.py`), which holds its default
and help; `run_align` takes the config to the executor and the shard writer.
"""

from __future__ import annotations

import click

from cli.outputs import run_stage_command
from csd_pipeline.align.config import AlignConfig
from csd_pipeline.runtime.options import MIB, config_option, placement_options


def _table_pairs(ctx, param, pairs):
    """--tables takes two files; a pair whose second item is an option means only one file was given."""
    from csd_pipeline.errors import CsdError

    for pair in pairs:
        for item in pair:
            if item.startswith("--"):
                raise CsdError(f"--tables takes two files, S2T T2S, but got {pair[0]} followed by the option {item}; "
                               "give both tables of the teacher (student->teacher, then teacher->student).")
    return pairs


@click.command()
@config_option(AlignConfig, "corpus", "--corpus", type=click.Path())
@config_option(AlignConfig, "student_tokenizer")
@config_option(AlignConfig, "teacher_tokenizers", "--teacher-tokenizer")
@config_option(AlignConfig, "output", type=click.Path(file_okay=False))
@config_option(AlignConfig, "mode")
@config_option(AlignConfig, "max_student_tokens")
@config_option(AlignConfig, "max_teacher_tokens")
@config_option(AlignConfig, "context_token", "--no-context-token", invert=True)
@config_option(AlignConfig, "tables", nargs=2, type=click.Path(dir_okay=False), callback=_table_pairs)
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
@config_option(AlignConfig, "capture_only")
@config_option(AlignConfig, "against_capture", type=click.Path(file_okay=False))
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def align(**options):
    """Align a corpus into shards of windows (SPEC §4, §7, §8); re-running resumes."""
    from csd_pipeline.align.stage import run_align

    run_stage_command(AlignConfig, run_align, options, on_complete=_refuse_empty)


def _refuse_empty(output) -> None:
    """End non-zero, even with --quiet, when the corpus gave no aligned row (every record rejected)."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.runtime.manifest import read_manifest

    totals = read_manifest(output)["totals"]
    if totals["rows"]:
        return
    rejected = totals.get("stats", {}).get("rejected_documents", {})
    reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(rejected.items())) or "none read"
    raise CsdError(f"{output} holds 0 aligned rows: no record of the corpus gave text ({reasons}); check --text-field, "
                   "--mode and the corpus, then align into a new --output.")
