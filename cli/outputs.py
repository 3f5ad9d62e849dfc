"""`csd-pipeline status DIR` and `csd-pipeline inspect DIR`: generic over stage outputs.

Also what every stage command (align, teacher-logits, generate) does once its options are parsed:
`run_stage_command`, which ends with `echo_run_report`.
"""

from __future__ import annotations

import json

import click

from csd_pipeline.runtime.options import values_for


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--finalize", is_flag=True, help="Write the manifest if every shard is complete (any rank may do it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(directory, finalize, as_json):
    """Say which shards of a stage output are complete and what is missing."""
    from csd_pipeline.runtime.run_record import finalize as write_manifest
    from csd_pipeline.runtime.run_record import stage_status

    if finalize:
        write_manifest(directory, log=lambda message: None if as_json else click.echo(message, err=True))
    report = stage_status(directory)
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
        return
    state = "complete (manifest written)" if report["complete"] else "not complete (no manifest yet)"
    click.echo(f"{directory}: {report['stage']} output, {state}")
    click.echo(f"shards: {report['shards_done']} of {report['shards_total']} complete")
    for name in report["missing"][:20]:
        click.echo(f"  missing: {name}")
    if len(report["missing"]) > 20:
        click.echo(f"  ... and {len(report['missing']) - 20} more")
    if not report["complete"] and not report["missing"]:
        click.echo(f"every shard is complete; run `csd-pipeline status {directory} --finalize` to write the manifest.")


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(directory, as_json):
    """Summarise a stage output from its manifest: rows, tokens, chunk shapes, rejections."""
    from csd_pipeline.report.stats import inspect_summary, source_lines

    report = inspect_summary(directory)
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
        return
    click.echo(f"{directory}: {report['stage']} output, schema version {report['schema_version']}")
    click.echo(f"shards: {report['shards']}, rows: {report['rows']}, bytes on disk: {report['bytes_on_disk']}")
    for key in ("windows", "documents", "tokens", "bytes_per_token", "chunk_status", "chunk_shapes", "rejections", "chat",
                "window_tokens"):
        if key in report:
            click.echo(f"{key}: {json.dumps(report[key], sort_keys=True)}")
    for line in source_lines(report.get("sources", [])):
        click.echo(line)


def run_stage_command(config_cls, run, options: dict, on_complete=None) -> None:
    """Build `config_cls` from a stage command's parsed `options`, `run(config, rank=, world_size=, workers=,
    engine=, log=)` for this rank (progress on stderr unless --quiet), call `on_complete(config.output)` when the
    output is complete, then (unless --quiet) say where the run stands (`echo_run_report`)."""
    from csd_pipeline.runtime.progress import set_quiet
    from csd_pipeline.runtime.ray_engine import EngineConfig

    quiet = options["quiet"]
    config = config_cls(**values_for(config_cls, options))
    engine = EngineConfig(**values_for(EngineConfig, options))
    log = None if quiet else (lambda message: click.echo(message, err=True))
    set_quiet(quiet)
    report = run(config, rank=options["rank"], world_size=options["world_size"], workers=options["workers"],
                 engine=engine, log=log)
    if report.complete and on_complete is not None:
        on_complete(config.output)
    if not quiet:
        echo_run_report(config.output, report)


def echo_run_report(output, report) -> None:
    """One line after a stage run: complete (see inspect), or this rank done (see status)."""
    if report.complete:
        click.echo(f"{output}: complete; see `csd-pipeline inspect {output}`.")
    else:
        click.echo(f"{output}: rank {report.rank} of {report.world_size} done; the manifest is written when every "
                   f"rank is done (`csd-pipeline status {output}`).")
