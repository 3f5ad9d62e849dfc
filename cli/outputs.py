"""`csd-pipeline status DIR` and `csd-pipeline inspect DIR`: generic over stage outputs."""

from __future__ import annotations

import json

import click


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
    report = summarise(directory)
    if as_json:
        click.echo(json.dumps(report, sort_keys=True))
        return
    click.echo(f"{directory}: {report['stage']} output, schema version {report['schema_version']}")
    click.echo(f"shards: {report['shards']}, rows: {report['rows']}, bytes on disk: {report['bytes_on_disk']}")
    for key in ("windows", "documents", "tokens", "bytes_per_token", "chunk_status", "chunk_shapes", "rejections", "chat"):
        if key in report:
            click.echo(f"{key}: {json.dumps(report[key], sort_keys=True)}")


def summarise(directory) -> dict:
    """The `inspect` report of a stage output: its totals, and for an aligned output what
    `AlignedOutput.summary` adds (tokens, bytes/token, shapes, rejections); other stages' stats as they are."""
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.runtime.manifest import read_manifest
    from csd_pipeline.teacher.reader import TeacherTopkOutput
    from schemas.aligned import STAGE as ALIGN_STAGE
    from schemas.teacher_topk import STAGE as TEACHER_STAGE

    manifest = read_manifest(directory)  # any stage; the output's own reader checks its schema version
    if manifest["stage"] == ALIGN_STAGE:
        aligned = AlignedOutput.open(directory)
        return {**_totals(aligned.manifest), **aligned.summary()}
    if manifest["stage"] == TEACHER_STAGE:
        manifest = TeacherTopkOutput.open(directory).manifest
    return {**_totals(manifest), "stats": manifest["totals"].get("stats", {})}


def _totals(manifest: dict) -> dict:
    totals = manifest["totals"]
    return {"stage": manifest["stage"], "schema_version": manifest["schema_version"], "shards": totals["shards"],
            "rows": totals["rows"], "bytes_on_disk": totals["bytes"]}


def echo_run_report(output, report) -> None:
    """One line after a stage run: complete (see inspect), or this rank done (see status)."""
    if report.complete:
        click.echo(f"{output}: complete; see `csd-pipeline inspect {output}`.")
    else:
        click.echo(f"{output}: rank {report.rank} of {report.world_size} done; the manifest is written when every "
                   f"rank is done (`csd-pipeline status {output}`).")
