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


def test_the_shipped_teacher_task_scores_stand_for_this_checkout():
    # make demo seeds the machine's task-score cache with demo/task-scores/ (the teacher's harness run is the same
    # every time); `evaluate --cache-dir` reuses a file only for its exact key. The key must be this checkout's
    # (fixture teacher, task files, lm-eval version, options), or the seed is stale: re-run make demo and copy
    # the new file from ~/.cache/csd-pipeline/task-scores/.
    from csd_pipeline.evaluation.harness import EvaluateConfig, cache_file, cache_key
    from demo.run import ROOT, TASKS, TEACHER

    key = cache_key(EvaluateConfig(model=TEACHER, tasks=TASKS.split(","), device="cpu"))
    folder = ROOT / "demo" / "task-scores"
    assert sorted(folder.glob("*.json")) == [cache_file(folder, key)]
    shipped = [cache_file(folder, key)]
    results = json.loads(shipped[0].read_text(encoding="utf-8"))
    assert results["csd_pipeline"]["cache_key"] == key
    assert set(results["results"]) >= set(TASKS.split(","))
