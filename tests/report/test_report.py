"""`csd-pipeline report` on each kind of folder: aligned, teacher top-k (a tiny random teacher), a
csd-train run; the teacher mass on explicit events against a brute-force sum."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR
from schemas.aligned import ChunkStatus

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def teacher_output(trainer_data, tmp_path_factory, tiny_teacher):
    """Top-8 of a tiny random Llama with SmolLM2's vocabulary on `train_short` (teacher 0)."""
    import torch

    from tests.teacher.test_stage import run_stage

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("teacher") / "topk"
    run_stage(trainer_data["train_short"], tiny_teacher, out)
    torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def training_run(trainer_data, teacher_output, tmp_path_factory):
    """Four CSD steps of the tiny student on `train_short` with the tiny teacher, evaluated twice."""
    import torch

    from trainer.loop import train
    from trainer.options import parse_args

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run") / "student-csd"
    train(parse_args(["--aligned", str(trainer_data["train_short"]), "--teacher-logits", str(teacher_output),
                      "--student-config", str(trainer_data["student_config"]), "--student-tokenizer", "llama-spm",
                      "--output", str(out), "--steps", "4", "--seq-len", "128", "--batch-size", "2",
                      "--warmup-steps", "1", "--save-every", "0", "--workers", "0", "--no-progress",
                      "--eval-aligned", str(trainer_data["eval"]), "--eval-every", "2"]))
    torch.set_num_threads(threads)
    return out


def test_teacher_mass_of_one_to_one_chunks_equals_the_stored_top_k(trainer_data, teacher_output):
    # 1:1 chunk: explicit events = stored top-k ids (and the observed id) whose spelling the student has
    from csd_pipeline.report.coverage import teacher_coverage
    from csd_pipeline.teacher.store.reader import read_teacher_topk
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    coverage = teacher_coverage(teacher_output, trainer_data["train_short"], max_rows=10_000)
    student = set(load_tokenizer("llama-spm").vocab.spellings())
    spelling = {i: s for s, ids in load_tokenizer("smollm2").vocab.spellings().items() for i in ids}
    expected = []
    manifest = json.loads((trainer_data["train_short"] / "manifest.json").read_text())
    rows = [r for s in manifest["shards"] for r in pq.read_table(trainer_data["train_short"] / s["file"]).to_pylist()]
    for row, topk in zip(rows, read_teacher_topk(teacher_output), strict=True):
        t0 = 0
        for m, n, status in zip(row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"],
                                row["teacher0_chunk_status"]):
            if status == ChunkStatus.ACCEPTED and m == n == 1 and t0 > 0:
                observed = row["teacher0_ids"][t0]
                ids = set(topk.ids[t0 - 1].tolist()) | {observed}
                logp = {int(i): float(lp) for i, lp in zip(topk.ids[t0 - 1], topk.logprobs[t0 - 1])}
                logp.setdefault(observed, float(topk.observed_logprob[t0 - 1]))
                expected.append(sum(math.exp(logp[i]) for i in ids if spelling.get(i) in student))
            t0 += n
    got = coverage.mass[coverage.shape == 0]
    assert coverage.rows_read == sum(s["rows"] for s in manifest["shards"]) and got.size == len(expected) > 20
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    # stored log-probs are within MAX_ABS_ERROR nat of the teacher's, so a sum may pass 1 by that factor
    assert 0 < coverage.mass.min() and coverage.mass.max() <= math.exp(MAX_ABS_ERROR)
    assert coverage.topk_mass.size == sum(len(r["teacher0_ids"]) for r in rows)


def test_report_writes_a_file_for_each_kind_of_folder(trainer_data, teacher_output, training_run, tmp_path):
    from csd_pipeline.report.render import write_report

    out = tmp_path / "report"
    folders = [trainer_data["train"], trainer_data["train_short"], teacher_output, training_run]
    report = write_report(folders, out, teacher_rows=5)
    text = report.read_text()
    for heading in ("## Aligned output `train`", "## Aligned output `train-short`", "## Teacher top-k `topk`",
                    "## Training runs"):
        assert heading in text
    assert "from 5 of" in text  # --teacher-rows bounds the rows read
    images = [line[line.index("(") + 1:-1] for line in text.splitlines() if line.startswith("![")]
    assert sorted(images) == sorted(p.name for p in out.glob("*.png"))  # every plot is linked, nothing else left
    assert {"aligned-1-chunks.png", "aligned-1-windows.png", "teacher-3-mass.png", "training-curves.png",
            "training-heldout.png", "training-event-coverage.png"} <= set(images)
    for name in images:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("*.tmp*"))


def test_report_cli_refuses_an_unknown_folder_with_one_line(trainer_data, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not an output")
    result = subprocess.run([sys.executable, "-m", "cli.main", "report", str(trainer_data["train"]),
                             str(tmp_path / "notes"), "--output", str(tmp_path / "report")],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "notes" in lines[0], result.stderr
    assert not (tmp_path / "report").exists()  # nothing written before every folder is recognised


def test_report_of_a_stage_output_that_is_not_complete(trainer_data, tmp_path):
    import shutil

    from csd_pipeline.report.folders import recognise

    copy = tmp_path / "aligned"
    shutil.copytree(trainer_data["train"], copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(CsdError, match="status"):
        recognise(copy)
