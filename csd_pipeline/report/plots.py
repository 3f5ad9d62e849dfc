"""The report's PNG figures (matplotlib, drawn off-screen). Each function writes one file and returns
its name, or None when there is nothing to draw."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from schemas.aligned import SHAPES

DPI = 110
# What each chunk status means, in a few words (schemas/aligned.py has the full story).
STATUS_MEANING = {
    "ACCEPTED": "enters the KD loss",
    "SPECIAL": "context token at the row's head",
    "NO_PREDICTOR": "first chunk, no context token before it",
    "WHITESPACE_GAP_WITHOUT_SOURCE": "whitespace the source does not confirm",
    "MISMATCH": "a run spells other bytes than the source",
    "OUTSIDE_LOSS_REGION": "chat: outside the final assistant message",
    "UNTRUSTED_TOKEN": "a token without a trusted spelling",
    "DUMMY_PREFIX": "SentencePiece: the document's leading space",
    "TOO_LONG": "longer than a window (reserved)",
}
COLORS = ("#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee", "#aa3377", "#bbbbbb")


def pyplot():
    """matplotlib.pyplot on the off-screen Agg backend; `CsdError` naming the package when it is missing."""
    try:
        import matplotlib
    except ImportError:
        raise CsdError("matplotlib is not installed; run `pip install matplotlib` "
                       "(csd-pipeline report draws its plots with it).") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    plt = pyplot()
    fig.tight_layout()
    tmp = out / f"{name}.tmp.png"
    fig.savefig(tmp, dpi=DPI)
    plt.close(fig)
    tmp.replace(out / name)
    return name


def _label_bars(ax, bars, values, total: int | None = None, horizontal: bool = False) -> None:
    for bar, value in zip(bars, values):
        text = f"{value:,}" + (f" ({value / total:.1%})" if total else "")
        if horizontal:
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
        else:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=8)


def chunks(tables, out: Path, name: str) -> str | None:
    """Accepted chunks by shape (per teacher) and the chunks not used for KD by status."""
    teachers = sorted(tables.chunk_shapes)
    if not teachers or not tables.rows:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(teachers)
    for t, teacher in enumerate(teachers):
        values = [tables.chunk_shapes[teacher][s] for s in SHAPES]
        x = np.arange(len(SHAPES)) + (t - (len(teachers) - 1) / 2) * width
        bars = left.bar(x, values, width, color=COLORS[t % len(COLORS)], label=teacher)
        _label_bars(left, bars, values, None if len(teachers) > 1 else sum(values) or 1)
    left.set_xticks(np.arange(len(SHAPES)), [f"{s}\n(student:teacher)" if s == "1:1" else s for s in SHAPES])
    left.set(title="accepted chunks by shape (log scale)", ylabel="chunks")
    left.set_yscale("log")  # 1:1 chunks outnumber the others by one or two orders of magnitude
    left.set_ylim(0.8, max(max(tables.chunk_shapes[t].values()) for t in teachers) * 4)
    if len(teachers) > 1:
        left.legend(loc="upper right")
    rows = [(status + (f" ({teacher})" if len(teachers) > 1 else "") + f"\n{STATUS_MEANING.get(status, '')}", n)
            for teacher in teachers for status, n in tables.chunk_status[teacher].items()
            if status != "ACCEPTED" and n]
    if rows:
        bars = right.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color="#cc6677")
        _label_bars(right, bars, [r[1] for r in rows][::-1], horizontal=True)
        right.margins(x=0.3)
        right.tick_params(axis="y", labelsize=8)
    else:
        right.text(0.5, 0.5, "every chunk accepted", ha="center", va="center", transform=right.transAxes)
        right.set_yticks([])
    right.set(title="chunks not used for KD, by status", xlabel="chunks")
    return _save(fig, out, name)


def windows(tables, out: Path, name: str) -> str | None:
    """Histogram of tokens per window, one line per side (student, each teacher)."""
    if not tables.rows:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    top = max(max(h) for h in tables.window_tokens.values() if h)
    edges = np.linspace(0, top + 1, min(60, top + 1) + 1)
    for i, (side, histogram) in enumerate(tables.window_tokens.items()):
        values, counts = np.array(list(histogram), dtype=float), np.array(list(histogram.values()), dtype=float)
        mean = (values * counts).sum() / counts.sum()
        ax.hist(values, bins=edges, weights=counts, histtype="step", lw=1.6, color=COLORS[i % len(COLORS)],
                label=f"{side} (mean {mean:.0f} tokens)")
    ax.set(title=f"window lengths ({tables.rows:,} windows, context token included)", xlabel="tokens in the window",
           ylabel="windows")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out, name)


def sources(tables, out: Path, name: str, limit: int = 15) -> str | None:
    """Per source file: windows, and the share of content chunks accepted for KD (first teacher)."""
    from csd_pipeline.report.stats import source_label

    entries = tables.sources[:limit]
    if len(entries) < 2:
        return None
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, max(2.4, 1.0 + 0.32 * len(entries))), sharey=True)
    labels = [source_label(e["source"], 36) for e in entries][::-1]
    counts = [e["rows"] for e in entries][::-1]
    bars = left.barh(labels, counts, color="#4477aa")
    _label_bars(left, bars, counts, horizontal=True)
    left.margins(x=0.25)
    left.set(title="windows per source", xlabel="windows")
    teacher = sorted(entries[0]["chunks"])[0]
    shares = [e["chunks"][teacher]["accepted"] / max(e["chunks"][teacher]["content"], 1) for e in entries][::-1]
    bars = right.barh(labels, shares, color="#228833")
    for bar, share in zip(bars, shares):
        right.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {share:.1%}", va="center", fontsize=8)
    right.set(title=f"content chunks accepted for KD ({teacher})", xlabel="share", xlim=(0, 1.15))
    return _save(fig, out, name)


def teacher_mass(coverage, out: Path, name: str) -> str | None:
    """Distribution of the teacher mass on explicit events per accepted chunk (by shape) and of the
    stored top-k mass per position."""
    if not coverage.mass.size:
        return None
    plt = pyplot()
    fig = plt.figure(figsize=(11, 5.2))
    grid = fig.add_gridspec(2, 3)
    edges = np.linspace(0, 1, 21)
    for code, shape in enumerate(SHAPES):  # one small panel per shape: their counts differ by orders of magnitude
        ax = fig.add_subplot(grid[code // 2, code % 2])
        values = np.clip(coverage.mass[coverage.shape == code], 0, 1)  # quantized log-probs may sum past 1
        if values.size:
            ax.hist(values, bins=edges, weights=np.full(values.size, 1 / values.size), color=COLORS[code])
            ax.axvline(values.mean(), color="black", lw=1, ls="--")
        ax.set_title(f"{shape}: {values.size:,} chunks" + (f", mean {values.mean():.2f}" if values.size else ""),
                     fontsize=10)
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
        if code // 2:
            ax.set_xlabel("teacher mass on explicit events")
        if code % 2 == 0:
            ax.set_ylabel("share of chunks")
    right = fig.add_subplot(grid[:, 2])
    right.hist(np.clip(coverage.topk_mass, 0, 1), bins=edges, weights=np.full(coverage.topk_mass.size, 1 / coverage.topk_mass.size),
               color="#777777")
    right.axvline(coverage.topk_mass.mean(), color="black", lw=1, ls="--")
    right.set(title=f"stored {coverage.stored_label}: mass per position\n(mean {coverage.topk_mass.mean():.2f})",
              xlabel="teacher probability in the top-k", ylabel="share of positions", xlim=(0, 1))
    right.grid(alpha=0.3)
    fig.suptitle(f"teacher mass on explicit events, per accepted chunk by shape (dashed: mean; "
                 f"{coverage.rows_read:,} rows)", fontsize=11)
    return _save(fig, out, name)


def _smooth(values: list[float]) -> np.ndarray:
    """A centred moving average over about 1/25 of the run (the raw curve is drawn faintly under it)."""
    window = max(1, len(values) // 25)
    if window == 1:
        return np.asarray(values)
    padded = np.pad(np.asarray(values, dtype=float), (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(padded, np.ones(window) / window, mode="valid")


def training_curves(runs, out: Path, name: str) -> str | None:
    """Loss, CE and KD per step, one line per run (smoothed over the faint raw values)."""
    keys = [k for k in ("loss", "ce", "kd") if any(any(v != 0 for v in r.series(k)[1]) for r in runs)]
    if not keys:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(3.9 * len(keys) + 0.5, 3.8), squeeze=False)
    titles = {"loss": "total loss (CE + scaled KD)", "ce": "cross-entropy (CE)", "kd": "KD divergence per chunk"}
    for ax, key in zip(axes[0], keys):
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if not steps or (key == "kd" and not any(values)):
                continue
            color = COLORS[i % len(COLORS)]
            ax.plot(steps, values, color=color, lw=0.6, alpha=0.3)
            ax.plot(steps, _smooth(values), color=color, lw=1.6, label=run.label)
        ax.set(title=titles[key], xlabel="step", ylabel="nats")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out, name)


def heldout(runs, out: Path, name: str) -> str | None:
    """Held-out bits per byte at each evaluation, one line per run."""
    with_evals = [(i, r) for i, r in enumerate(runs) if r.series("bits_per_byte", evals=True)[0]]
    if not with_evals:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, run in with_evals:
        steps, values = run.series("bits_per_byte", evals=True)
        ax.plot(steps, values, marker="o", color=COLORS[i % len(COLORS)], label=f"{run.label}: {values[-1]:.4f} at "
                f"step {steps[-1]}")
    ax.set(title="held-out bits per byte (lower is better)", xlabel="step", ylabel="bits/byte")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, name)


def _panels(count: int):
    """(figure, 2-D array of axes) of `count` small panels, three to a row."""
    columns = min(3, count)
    rows = -(-count // columns)
    return pyplot().subplots(rows, columns, figsize=(3.9 * columns + 0.5, 3.1 * rows + 0.4), squeeze=False)


def tasks(runs, out: Path, name: str, limit: int = 6) -> str | None:
    """lm-evaluation-harness scores at each task evaluation (`csd-train --eval-tasks`), ± the harness's standard
    error: one panel per task and metric, one line per run; bars of the last scores when no run has two."""
    pairs = sorted({pair for run in runs for pair in run.task_metrics()})[:limit]
    if not pairs:
        return None
    if all(len(run.task_series(*pair)[0]) <= 1 for run in runs for pair in pairs):
        return task_bars({run.label: run.tasks[-1] for run in runs if run.tasks}, out, name, limit)
    fig, axes = _panels(len(pairs))
    for ax, (task, metric) in zip(axes.ravel(), pairs):
        for i, run in enumerate(runs):
            steps, values, errors = run.task_series(task, metric)
            if steps:
                ax.errorbar(steps, values, yerr=np.nan_to_num(errors), marker="o", ms=3, capsize=2,
                            color=COLORS[i % len(COLORS)], label=f"{run.label}: {values[-1]:.3f}")
        ax.set_title(f"{task} {metric}", fontsize=10)
        ax.set(xlabel="step", ylabel=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(pairs):]:
        ax.set_visible(False)
    fig.suptitle("standard tasks on the export (bars: the harness's standard error)", fontsize=11)
    return _save(fig, out, name)


def task_bars(scores: dict[str, dict], out: Path, name: str, limit: int = 6) -> str | None:
    """lm-evaluation-harness scores as one bar per model with the harness's standard error as its error bar: one
    panel per task and metric. `scores`: model label -> {`eval/TASK/METRIC`: value, `..._stderr`: error}."""
    keys = sorted({key for values in scores.values() for key in values
                   if key.startswith("eval/") and not key.endswith("_stderr") and key.count("/") >= 2})[:limit]
    if not keys:
        return None
    fig, axes = _panels(len(keys))
    labels = list(scores)
    for ax, key in zip(axes.ravel(), keys):
        values = [float(scores[m].get(key, np.nan)) for m in labels]
        errors = [float(scores[m].get(f"{key}_stderr", 0.0)) for m in labels]
        bars = ax.bar(range(len(labels)), values, yerr=errors, capsize=4,
                      color=[COLORS[i % len(COLORS)] for i in range(len(labels))])
        for bar, value in zip(bars, values):
            if value == value:
                ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.3f}", ha="center", va="bottom",
                        fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=7)
        ax.set_title(key.removeprefix("eval/").replace("/", " "), fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    for ax in axes.ravel()[len(keys):]:
        ax.set_visible(False)
    fig.suptitle("standard tasks (error bars: the harness's standard error)", fontsize=11)
    return _save(fig, out, name)


def heldout_sources(runs, out: Path, name: str, limit: int = 12) -> str | None:
    """Held-out bits per byte per source at each evaluation: one panel per source (its own scale: languages
    differ), one line per run; runs with fewer than two sources are left out."""
    from csd_pipeline.report.stats import source_label

    drawn = [(i, r) for i, r in enumerate(runs) if len(r.sources()) > 1]
    sources = sorted({s for _, r in drawn for s in r.sources()})[:limit]
    if not sources:
        return None
    fig, axes = _panels(len(sources))
    for ax, source in zip(axes.ravel(), sources):
        for i, run in drawn:
            steps, values = run.source_series(source)
            if steps:
                change = f" ({(values[-1] - values[0]) / values[0]:+.1%})" if len(steps) > 1 and values[0] else ""
                ax.plot(steps, values, marker="o", ms=3, color=COLORS[i % len(COLORS)],
                        label=f"{run.label}: {values[-1]:.4f}{change}")
        ax.set_title(source_label(source, 36), fontsize=10)
        ax.set(xlabel="step", ylabel="bits/byte")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes.ravel()[len(sources):]:
        ax.set_visible(False)
    fig.suptitle("held-out bits per byte per source (lower is better; in brackets: change since the first "
                 "evaluation)", fontsize=11)
    return _save(fig, out, name)


def event_coverage(runs, out: Path, name: str) -> str | None:
    """Teacher mass on explicit events and student REST mass during training (CSD runs)."""
    # one teacher: `teacher_event_mass`; several: `teacher{i}_teacher_event_mass` (trainer.loop)
    prefixes = [(i, r, sorted({k[:-len("teacher_event_mass")] for rec in r.steps[:1] for k in rec
                               if k.endswith("teacher_event_mass")})) for i, r in enumerate(runs)]
    drawn = [(i, r, p) for i, r, p in prefixes if p]
    if not drawn:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, run, found in drawn:
        color = COLORS[i % len(COLORS)]
        for prefix in found:
            for key, style, what in (("teacher_event_mass", "-", "teacher mass on explicit events"),
                                     ("student_rest_mass", "--", "student REST mass")):
                steps, values = run.series(prefix + key)
                if steps:
                    ax.plot(steps, _smooth(values), color=color, ls=style, lw=1.4,
                            label=f"{run.label}{' ' + prefix.rstrip('_') if prefix else ''}: {what}")
    ax.set(title="event coverage during training", xlabel="step", ylabel="probability mass", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, name)
