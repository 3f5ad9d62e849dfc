"""`csd-pipeline report` on training runs whose held-out folder has several sources: a table of the last
evaluation per source with its change since the first, and one panel per source."""

from __future__ import annotations

import json

from csd_pipeline.report.render import write_report


def _run(folder, evals):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "ce": 3.0 - s / 10,
                                                              "kd": 0.0}) + "\n" for s in (1, 2, 3, 4)))
    (folder / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return folder


def _eval(step, **bits):
    sources = {f"corpus/{name}.txt": {"bits_per_byte": v, "bytes": 100, "nats": v * 100 * 0.6931471805599453}
               for name, v in bits.items()}
    return {"step": step, "bits_per_byte": sum(bits.values()) / len(bits), "sources": sources}


def test_report_shows_each_source_with_its_change(tmp_path):
    csd = _run(tmp_path / "csd", [_eval(2, de=2.0, en=1.2), _eval(4, de=1.5, en=1.26)])
    ce = _run(tmp_path / "ce", [_eval(2, de=2.0, en=1.2), _eval(4, de=1.8, en=1.2)])
    single = _run(tmp_path / "single", [_eval(2, en=1.0), _eval(4, en=0.9)])
    report = write_report([csd, ce, single], tmp_path / "report")
    text = report.read_text(encoding="utf-8")
    assert "| csd | `corpus/de.txt` | 1.5000 (step 4) | 2.0000 (step 2) | -0.5000 (-25.0%) |" in text
    assert "| csd | `corpus/en.txt` | 1.2600 (step 4) | 1.2000 (step 2) | +0.0600 (+5.0%) |" in text
    assert "| ce | `corpus/de.txt` | 1.8000 (step 4) | 2.0000 (step 2) | -0.2000 (-10.0%) |" in text
    assert "| single |" in text and "| single | `corpus/en.txt`" not in text  # one source: the overall figure says it
    assert "![training-heldout-sources](training-heldout-sources.png)" in text
    assert (tmp_path / "report" / "training-heldout-sources.png").stat().st_size > 0


def test_runs_without_per_source_figures_get_no_source_table(tmp_path):
    old = _run(tmp_path / "old", [{"step": 2, "bits_per_byte": 2.0}, {"step": 4, "bits_per_byte": 1.9}])
    text = write_report([old], tmp_path / "report").read_text(encoding="utf-8")
    assert "per source" not in text and not (tmp_path / "report" / "training-heldout-sources.png").exists()
