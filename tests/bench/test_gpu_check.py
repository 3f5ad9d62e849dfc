"""bench/gpu_check.py: without CUDA it says so and exits 0; its measuring code runs end to end (on the CPU,
at toy sizes, where its numbers mean nothing: no GPU was available to this project's sessions)."""

from __future__ import annotations

import json
import math

import pytest


def test_without_a_cuda_device_it_says_so_and_exits_0(monkeypatch, capsys, tmp_path):
    import torch

    from bench import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output", str(tmp_path / "out.json")]) == 0
    assert capsys.readouterr().out.startswith("no CUDA device")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_dry_run_on_the_cpu_measures_every_figure(tmp_path, fixtures_dir, one_thread, capsys):
    from bench import gpu_check

    output = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run-cpu", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert json.loads(capsys.readouterr().out) == result
    teacher, topk, train = result["teacher"], result["bf16_vs_float32_teacher"], result["train"]
    assert teacher["positions"] > 500 and teacher["stage_positions_per_s"] > 0 and teacher["forward_only_positions_per_s"] > 0
    assert topk["windows"] == 4 and 0.5 < topk["float32_topk_held_by_bf16"] <= 1
    assert 0 < topk["largest_logprob_error_p_above_1e-3"] <= topk["largest_logprob_error_shared_ids"] < 5
    assert all(math.isfinite(train[k]) and train[k] > 0 for k in ("ce_step_s", "csd_step_s", "csd_over_ce_step"))
    assert train["chunks_per_step"] > 0
