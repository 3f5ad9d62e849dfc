"""`csd-pipeline report DIR... --output FOLDER`: a Markdown report with PNG plots of any outputs."""

from __future__ import annotations

import click

from csd_pipeline.report import TEACHER_ROWS


@click.command()
@click.argument("directories", nargs=-1, required=True, type=click.Path())
@click.option("--output", required=True, type=click.Path(), help="Folder for report.md and its PNG plots.")
@click.option("--title", default="csd-pipeline report", show_default=True, help="The report's heading.")
@click.option("--teacher-rows", default=TEACHER_ROWS, show_default=True,
              help="Rows read per teacher output for the teacher mass on explicit events.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors.")
def report(directories, output, title, teacher_rows, quiet):
    """Write a report of aligned, teacher-logits and csd-train output folders (recognised by their contents)."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.report.render import write_report
    from csd_pipeline.runtime import progress

    if teacher_rows < 1:
        raise CsdError(f"--teacher-rows {teacher_rows} is not positive; pass 1 or more.")
    progress.set_quiet(quiet)
    path = write_report(list(directories), output, title=title, teacher_rows=teacher_rows,
                        progress_bar=lambda total: progress.bar(total, "teacher mass", "row"))
    if not quiet:
        click.echo(f"wrote {path} (open it in a Markdown viewer; the plots are next to it)")
