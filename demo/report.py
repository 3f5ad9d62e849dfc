"""The demo's report: `OUT/report.md` with PNG plots next to it.

Loss curves of both students, held-out bits per byte during training, the chunk-shape histogram,
rejections by reason, and the teacher mass covered by explicit events (with the student's REST
mass). Plots need matplotlib (a dev extra); without it the report is text only.
"""

from __future__ import annotations

import json
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [p[0] for p in points], [float(p[1]) for p in points]


def _plots(out: Path, arms: dict, shapes: dict, rejections: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    images = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm, (metrics, evals) in arms.items():
        axes[0].plot(*_series(metrics, "ce"), label=f"{arm}: CE", lw=1)
        if arm == "csd":
            axes[0].plot(*_series(metrics, "kd"), label="csd: KD", lw=1, ls="--")
        axes[1].plot(*_series(evals, "bits_per_byte"), marker="o", label=arm)
    axes[0].set(title="training loss", xlabel="step", ylabel="nats")
    axes[1].set(title="held-out bits per byte", xlabel="step", ylabel="bits/byte")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss-curves.png", dpi=110)
    plt.close(fig)
    images.append("loss-curves.png")

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(list(shapes), list(shapes.values()), color="#4477aa")
    axes[0].set(title="accepted chunks by shape", ylabel="chunks")
    reasons = {k: v for k, v in rejections.items() if v} or {"(none)": 0}
    axes[1].barh(list(reasons), list(reasons.values()), color="#cc6677")
    axes[1].set(title="chunks not used for KD, by reason", xlabel="chunks")
    fig.tight_layout()
    fig.savefig(out / "chunks.png", dpi=110)
    plt.close(fig)
    images.append("chunks.png")

    metrics = arms.get("csd", ([], []))[0]
    steps, mass = _series(metrics, "teacher_event_mass")
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, mass, label="teacher mass on explicit events")
        ax.plot(*_series(metrics, "student_rest_mass"), label="student REST mass")
        ax.set(title="event coverage (CSD student)", xlabel="step", ylim=(0, 1))
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "coverage.png", dpi=110)
        plt.close(fig)
        images.append("coverage.png")
    return images


def write_report(out: Path, summary: dict) -> Path:
    """Write OUT/report.md (and PNGs) from the demo's outputs; return the report's path."""
    arms = {arm: (_jsonl(out / f"student-{arm}" / "metrics.jsonl"), _jsonl(out / f"student-{arm}" / "eval.jsonl"))
            for arm in ("csd", "ce")}
    align = summary["align"]
    shapes = dict(align.get("chunk_shapes", {}).get("teacher0", {}))
    status = dict(align.get("chunk_status", {}).get("teacher0", {}))
    rejections = {k: v for k, v in status.items() if k not in ("ACCEPTED",)}
    images = _plots(out, arms, shapes, rejections)
    scores = summary["scores_bits_per_byte"]
    ce = scores["student, CE only"]
    lines = ["# csd-pipeline demo report", "",
             "Teacher SmolLM2-135M-Instruct (ByteLevel BPE, 49,152 ids) distilled into a 4-layer, 128-wide Llama "
             "student with the Llama 2 SentencePiece tokenizer (32,000 ids), on The Devil's Dictionary "
             f"({summary['steps']} steps per student; CSD arm: `{' '.join(summary['csd_args'])}`).", "",
             "## Held-out bits per byte (lower is better)", "", "| model | bits/byte | vs CE only |", "|---|---|---|"]
    for name, value in scores.items():
        lines.append(f"| {name} | {value:.4f} | {(value - ce) / ce:+.1%} |")
    total = sum(shapes.values()) or 1
    lines += ["", "## Chunks", "", "| shape | accepted chunks | share |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {v / total:.1%} |" for k, v in shapes.items()]
    lines += ["", "| status (not used for KD) | chunks |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rejections.items()]
    csd_metrics = arms["csd"][0]
    if csd_metrics:
        last = csd_metrics[-10:]

        def mean(key):
            values = [float(r[key]) for r in last if r.get(key) is not None]
            return sum(values) / len(values) if values else float("nan")

        lines += ["", "## Event coverage (CSD student, mean of the last 10 steps)", "",
                  f"- teacher mass carried by explicit events: {mean('teacher_event_mass'):.3f}",
                  f"- student REST mass: {mean('student_rest_mass'):.3f}",
                  f"- events per chunk: {mean('events_per_chunk'):.1f}"]
    teacher = summary.get("teacher", {})
    if teacher:
        lines += ["", "## Teacher top-k shards", "", "```", json.dumps(teacher, indent=1, sort_keys=True)[:1500], "```"]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in images]
    lines += ["", f"Total time: {summary['seconds'] / 60:.1f} min."]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return report
