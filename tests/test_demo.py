"""demo/run.py reads a student's held-out bits per byte from its last evaluation instead of scoring it again."""

from __future__ import annotations

import json

from demo.run import final_evaluation


def test_the_final_evaluation_is_the_one_at_the_last_step(tmp_path):
    records = [{"step": 2, "bits_per_byte": 3.0}, {"step": 4, "bits_per_byte": 2.5}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert final_evaluation(tmp_path, 4) == 2.5
    assert final_evaluation(tmp_path, 5) is None  # not evaluated at the last step: the demo scores the export
    assert final_evaluation(tmp_path / "missing", 4) is None
