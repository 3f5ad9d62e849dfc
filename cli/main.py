"""`csd-pipeline`: the offline stages (tables, align, teacher-logits, generate) and their tools.

Subcommands live in their own modules and are imported only when invoked, so that
`csd-pipeline --help` never imports torch or transformers.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command or group.
SUBCOMMANDS = {
    "tables": "cli.tables:tables",
    "align": "cli.align:align",
    "teacher-logits": "cli.teacher_logits:teacher_logits",
    "generate": "cli.generate:generate",
    "rounds": "cli.rounds:rounds",
    "status": "cli.outputs:status",
    "inspect": "cli.outputs:inspect",
    "report": "cli.report:report",
    "bits-per-byte": "cli.evaluate:bits_per_byte",
    "evaluate": "cli.harness:evaluate",
    "fixtures": "cli.fixtures:fixtures",
    "recipes": "cli.recipes:recipes",
}

HELP_LINES = {
    "tables": "Build, validate and inspect byte-exact sub-token tables.",
    "align": "Tokenize a corpus with both tokenizers and align it into shards.",
    "teacher-logits": "Run the teacher once and store its top-k log-probabilities.",
    "generate": "Sample completions from the student for a prompt corpus (on-policy data).",
    "rounds": "On-policy rounds: generate, align, teacher-logits, train, export; R times.",
    "status": "Say which shards of a stage output are complete and what is missing.",
    "inspect": "Summarise a stage output: rows, tokens, chunk shapes, rejections.",
    "report": "Write a Markdown report with plots of aligned, teacher and training outputs.",
    "bits-per-byte": "Held-out bits per byte of a model on an aligned folder (any tokenizer).",
    "evaluate": "Score a model on lm-evaluation-harness tasks (extra [eval]; --list-tasks).",
    "fixtures": "Fetch, convert and verify the real tokenizer and model fixtures.",
    "recipes": "List the shipped recipes (csd-train --config NAME), or print one.",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return with_storage_options(getattr(importlib.import_module(module_name), attr))

    def format_commands(self, ctx, formatter):
        rows = [(name, HELP_LINES[name]) for name in SUBCOMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _configure_storage(ctx, param, value) -> None:
    from csd_pipeline.runtime import storage

    if value is None:
        return
    if param.name == "cache_dir":
        storage.use_cache_dir(value)
    else:
        storage.configure(value)


STORAGE_PARAMS = (
    click.Option(["--storage-options"], metavar="JSON", expose_value=False, is_eager=True, callback=_configure_storage,
                 help="fsspec options for s3:// / gs:// paths (e.g. '{\"endpoint_url\": \"http://host:9000\"}'); "
                      "credentials otherwise come from the AWS_* / gcloud environment. Never written to an output."),
    click.Option(["--cache-dir"], type=click.Path(file_okay=False), expose_value=False, is_eager=True,
                 callback=_configure_storage, help="Keep local copies of the object-store shards read, checked by "
                                                   "sha256 (default: stream them)."),
)


def with_storage_options(command):
    """Give every command (each command of a group) `--storage-options` and `--cache-dir`, once."""
    commands = command.commands.values() if isinstance(command, click.Group) else [command]
    for each in commands:
        if not any(p.name == "storage_options" for p in each.params):
            each.params.extend(STORAGE_PARAMS)
    return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="csd-pipeline")
def cli():
    """Offline cross-tokenizer distillation (CSD), one stage at a time."""


def run_cli(command, argv=None) -> None:
    """Run a click command under the one error-to-exit wrapper (`csd_pipeline.errors.exit_on_error`)."""
    from csd_pipeline.errors import exit_on_error

    exit_on_error(lambda: command.main(args=argv, standalone_mode=False),
                  rerun="run the same command again (align and teacher-logits resume where they stopped)",
                  interrupted="interrupted; re-run the same command to resume")


def main(argv=None) -> None:
    run_cli(cli, argv)


if __name__ == "__main__":
    main()
