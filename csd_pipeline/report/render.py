"""`csd-pipeline report`: one Markdown file with its PNG plots next to it, for any set of outputs.

Each folder is recognised (`folders.recognise`): an aligned output gets its chunk shapes, statuses
by reason, window lengths and per-source coverage (`stats.aligned_tables`); a teacher top-k output
the teacher mass on explicit events and its distribution (`coverage.teacher_coverage`); training runs
are drawn together (loss, CE, KD, held-out bits per byte, per source when the held-out folder has several
sources, lm-evaluation-harness task scores, event coverage), so arms compare at a glance.
The folder holds only the report: `report.md` and `*.png` it refers to by relative name. An object-store
`--output` (`s3://...`) gets the same files, drawn locally, uploaded whole, `report.md` last.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from csd_pipeline.report import TEACHER_ROWS, plots
from csd_pipeline.report.folders import Folder, labels, read_run, recognise
from schemas.aligned import SHAPES

REPORT_NAME = "report.md"


def write_report(directories: list, output, *, title: str = "csd-pipeline report", preface: list[str] | None = None,
                 teacher_rows: int = TEACHER_ROWS, progress_bar=None) -> Path:
    """Write `output/report.md` and its PNGs for `directories` (`output`: a folder or an object-store URL);
    return the report's path (a `UPath` for a URL).

    `preface`: Markdown lines put under the title (the demo's scores). `teacher_rows`: rows read per
    teacher output for the mass on explicit events. Raises `CsdError` (before writing anything) when a
    folder is not an aligned, teacher-logits or csd-train output, or when matplotlib is missing.
    """
    from csd_pipeline.errors import CsdError

    if not directories:
        raise CsdError("pass at least one output folder of align, teacher-logits or csd-train.")
    from csd_pipeline.runtime import storage

    folders = [recognise(d) for d in directories]
    plots.pyplot()  # a missing matplotlib is one line before anything is written
    target = storage.location(output)
    if target.is_file():
        raise CsdError(f"--output {storage.redact(str(target))} is a file; pass a folder for the report.")
    if storage.is_remote(target):  # drawn in a local staging folder, uploaded at the end
        storage.check_writable(target)
        out = storage.staging_path(target)
        shutil.rmtree(out, ignore_errors=True)
    else:
        out = target
    out.mkdir(parents=True, exist_ok=True)
    names = labels(folders)
    lines = [f"# {title}", ""] + list(preface or [])
    aligned_dirs = [f.path for f in folders if f.kind == "aligned"]
    for n, (folder, name) in enumerate(zip(folders, names), 1):
        if folder.kind == "aligned":
            lines += _aligned_section(folder, name, out, f"aligned-{n}")
        elif folder.kind == "teacher":
            lines += _teacher_section(folder, name, out, f"teacher-{n}", aligned_dirs, teacher_rows, progress_bar)
    runs = [read_run(f, name) for f, name in zip(folders, names) if f.kind == "training"]
    if runs:
        lines += _training_section(runs, out)
    report = out / REPORT_NAME
    tmp = out / f"{REPORT_NAME}.tmp"
    tmp.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    tmp.replace(report)
    if out is not target:  # every plot uploaded whole, report.md last: a reader never finds it without its plots
        storage.upload_folder(out, target, last=REPORT_NAME, replace=False)
    return target / REPORT_NAME


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def _images(*names) -> list[str]:
    lines = []
    for name in names:
        if name:
            lines += [f"![{name[:-4]}]({name})", ""]
    return lines


def _aligned_section(folder: Folder, name: str, out: Path, stem: str) -> list[str]:
    from csd_pipeline.report.stats import aligned_tables, source_label

    tables = aligned_tables(folder.output)
    stats = folder.output.manifest["totals"].get("stats", {})
    docs = stats.get("documents", {})
    lines = [f"## Aligned output `{name}`", "", f"Folder `{folder.path}`: {tables.rows:,} windows of "
             f"{tables.documents:,} documents ({docs.get('read', tables.documents):,} read), "
             f"{tables.text_bytes:,} bytes of text.", ""]
    lines += _table(["side", "tokens", "bytes per token"],
                    [[side, f"{n:,}", f"{tables.text_bytes / n:.3f}" if n else "-"] for side, n in tables.tokens.items()])
    for teacher in sorted(tables.chunk_shapes):
        shapes, status = tables.chunk_shapes[teacher], tables.chunk_status[teacher]
        accepted, content = sum(shapes.values()), sum(v for k, v in status.items() if k != "SPECIAL")
        lines += [f"Chunks against {teacher}: {accepted:,} of {content:,} content chunks accepted for KD "
                  f"({_share(accepted, content)}).", ""]
        lines += _table(["shape (student:teacher)", "accepted chunks", "share"],
                        [[s, f"{shapes[s]:,}", _share(shapes[s], accepted)] for s in SHAPES])
        lines += _table(["status", "meaning", "chunks", "share of all chunks"],
                        [[k, plots.STATUS_MEANING.get(k, ""), f"{v:,}", _share(v, sum(status.values()))]
                         for k, v in status.items() if v])
    rejected = {**stats.get("rejected_documents", {}),
                **{f"window regions: {k}": v for k, v in stats.get("rejected_regions", {}).items()}}
    if any(rejected.values()):
        lines += _table(["refused before alignment", "count"], [[k, f"{v:,}"] for k, v in rejected.items() if v])
    teacher = sorted(tables.chunk_shapes)[0] if tables.chunk_shapes else None
    lines += _table(["source", "windows", "documents", "student tokens", f"accepted ({teacher})"],
                    [[f"`{source_label(e['source'])}`", f"{e['rows']:,}", f"{e['documents']:,}",
                      f"{e['tokens']['student']:,}",
                      _share(e["chunks"][teacher]["accepted"], e["chunks"][teacher]["content"]) if teacher else "-"]
                     for e in tables.sources[:20]])
    if len(tables.sources) > 20:
        lines += [f"... and {len(tables.sources) - 20} more sources (`csd-pipeline inspect --json` lists all).", ""]
    return lines + _images(plots.chunks(tables, out, f"{stem}-chunks.png"),
                           plots.windows(tables, out, f"{stem}-windows.png"),
                           plots.sources(tables, out, f"{stem}-sources.png"))


def _teacher_section(folder: Folder, name: str, out: Path, stem: str, aligned_dirs: list, rows: int,
                     progress_bar) -> list[str]:
    from csd_pipeline.report.coverage import matching_aligned, teacher_coverage

    manifest = folder.output.manifest
    stats, config = manifest["totals"].get("stats", {}), manifest.get("config", {})
    observed = stats.get("observed", {})
    cuts = ", ".join(f"--{key.replace('_', '-')} {config[key]}" for key in ("top_p", "min_p", "tail_samples") if config.get(key))
    lines = [f"## Teacher top-k `{name}`", "",
             f"Folder `{folder.path}`: teacher `{manifest.get('sources', {}).get('teacher', '?')}`, top-"
             f"{config.get('top_k', '?')}{f' ({cuts})' if cuts else ''} of {stats.get('positions', 0):,} positions in "
             f"{manifest['totals']['rows']:,} rows ({stats.get('rejected', {}).get('non_finite', 0)} rejected as "
             f"non-finite), {stats.get('entries', 0) / max(stats.get('positions', 0), 1):.1f} entries stored per "
             f"position{' (only those CSD turns into events: --keep csd-events)' if folder.output.keep != 'top-k' else ''}"
             f"; the observed next token is among the stored entries at "
             f"{_share(observed.get('in_top_k', 0), observed.get('positions', 0))} of positions.", ""]
    aligned = matching_aligned(folder.output, aligned_dirs)
    bar = progress_bar(min(rows, manifest["totals"]["rows"])) if progress_bar else None
    coverage = teacher_coverage(folder.path, aligned, max_rows=rows, advance=bar.update if bar else None)
    if bar:
        bar.close()
    if coverage.mass.size:
        lines += [f"Teacher mass on explicit events (the probability CSD compares event by event; the rest is "
                  f"REST): mean {coverage.mass.mean():.3f} over {coverage.mass.size:,} accepted chunks, "
                  f"{coverage.events / coverage.mass.size:.1f} events per chunk, from {coverage.rows_read:,} of "
                  f"{coverage.rows_total:,} rows (aligned folder `{aligned}`). Mass of the stored "
                  f"{coverage.stored_label} per position: mean {coverage.topk_mass.mean():.3f}.", ""]
        lines += _table(["shape", "chunks", "mean mass", "p10", "median"],
                        [[s, f"{v['chunks']:,}", f"{v['mean']:.3f}", f"{v['p10']:.3f}", f"{v['p50']:.3f}"]
                         for s, v in coverage.by_shape().items()])
    else:
        lines += ["No accepted chunk with a predictor in the rows read: nothing to measure.", ""]
    return lines + _images(plots.teacher_mass(coverage, out, f"{stem}-mass.png"))


def _training_section(runs, out: Path) -> list[str]:
    lines = ["## Training runs", ""]
    rows = []
    for run in runs:
        last = run.steps[-1] if run.steps else {}
        steps, bpb = run.series("bits_per_byte", evals=True)
        loss = run.config.get("loss", "?")
        rows.append([run.label, f"`{loss}`" + (f" {run.config.get('divergence', '')}" if loss != "ce" else ""),
                     f"{last.get('step', 0)} / {run.config.get('steps', '?')}",
                     *(f"{last[k]:.4f}" if isinstance(last.get(k), (int, float)) and not (k == "kd" and loss == "ce")
                       else "-" for k in ("loss", "ce", "kd")),
                     f"{bpb[-1]:.4f} (step {steps[-1]})" if bpb else "-", f"{min(bpb):.4f}" if bpb else "-"])
    lines += _table(["run", "loss", "steps", "last loss", "last CE", "last KD", "held-out bits/byte", "best"], rows)
    lines += _images(plots.training_curves(runs, out, "training-curves.png"),
                     plots.heldout(runs, out, "training-heldout.png"))
    lines += _tasks_table(runs)
    lines += _images(plots.tasks(runs, out, "training-tasks.png"))
    lines += _sources_table(runs)
    return lines + _images(plots.heldout_sources(runs, out, "training-heldout-sources.png"),
                           plots.event_coverage(runs, out, "training-event-coverage.png"))


def _tasks_table(runs) -> list[str]:
    """lm-evaluation-harness scores of `csd-train --eval-tasks` at each run's last task evaluation, ± the harness's
    standard error, next to the held-out bits per byte of the same step: one table per set of metrics (accuracy
    tasks apart from bits-per-byte tasks), each with its tasks' own columns."""
    by_task: dict[str, set] = {}
    for run in runs:
        for task, metric in run.task_metrics():
            by_task.setdefault(task, set()).add(metric)
    tables: dict[tuple, list] = {}
    for run in runs:
        bits = dict(zip(*run.series("bits_per_byte", evals=True)))
        for task in sorted({t for t, _ in run.task_metrics()}):
            metrics, cells, step = tuple(sorted(by_task[task])), [], None
            for metric in metrics:
                steps, values, errors = run.task_series(task, metric)
                step = steps[-1] if steps else step
                cells.append(f"{values[-1]:.3f}" + (f" ± {errors[-1]:.3f}" if errors[-1] == errors[-1] else "")
                             if steps else "-")
            tables.setdefault(metrics, []).append([run.label, f"`{task}`", step, *cells,
                                                   f"{bits[step]:.4f}" if step in bits else "-"])
    if not tables:
        return []
    lines = ["Standard tasks (lm-evaluation-harness on the run's export, `csd-train --eval-tasks`; ± the harness's "
             "standard error) at the last task evaluation, next to the held-out bits per byte of that step.", ""]
    for metrics, rows in tables.items():
        lines += _table(["run", "task", "step", *metrics, "held-out bits/byte"], rows)
    return lines


def _sources_table(runs) -> list[str]:
    """Held-out bits per byte per source at the last evaluation, with the change since the first (runs whose
    held-out folder has several sources)."""
    from csd_pipeline.report.stats import source_label

    rows = []
    for run in runs:
        sources = run.sources()
        if len(sources) < 2:
            continue
        for source in sources:
            steps, values = run.source_series(source)
            if not steps:
                continue
            change = values[-1] - values[0]
            rows.append([run.label, f"`{source_label(source)}`", f"{values[-1]:.4f} (step {steps[-1]})",
                         f"{values[0]:.4f} (step {steps[0]})",
                         f"{change:+.4f} ({change / values[0]:+.1%})" if len(steps) > 1 and values[0] else "-"])
    if not rows:
        return []
    return ["Held-out bits per byte per source (the corpus file of each held-out window; lower is better): the "
            "last evaluation, and its change since the first.", ""] + _table(
        ["run", "source", "last", "first", "change"], rows)
