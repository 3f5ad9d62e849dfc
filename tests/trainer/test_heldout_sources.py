"""Held-out bits per byte per source: csd-train records it in eval.jsonl for a held-out folder aligned from two
corpus files, the overall figure is the one the CE-only scoring gave before, and the per-source figures recombine
to it and match a brute-force count per window."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from csd_pipeline.evaluation.per_source import SourceTally, window_nats
from tests.trainer_cases import DATA, align
from trainer.loop import train
from trainer.options import parse_args

SOURCES = ("devil-slice.txt", "kjv-genesis-slice.txt")


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """A held-out aligned folder of two corpus files (two sources)."""
    return align([DATA / name for name in SOURCES], tmp_path_factory.mktemp("heldout") / "eval")


@pytest.fixture(scope="module")
def run(trainer_data, two_sources, tmp_path_factory, one_thread):
    output = tmp_path_factory.mktemp("sources") / "run"
    train(parse_args(["--aligned", str(trainer_data["train"]), "--student-config", str(trainer_data["student_config"]),
                      "--student-tokenizer", "llama-spm", "--output", str(output), "--loss", "ce", "--steps", "3",
                      "--seq-len", "128", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1",
                      "--save-every", "0", "--workers", "0", "--no-progress", "--eval-aligned", str(two_sources),
                      "--eval-every", "2"]))
    return output


def _old_overall(wrapper, aligned, seq_len, batch_size):
    """The held-out nats as `trainer.evaluation` summed them before the per-source figures (CE-only loss)."""
    from csd_pipeline.evaluation.bits_per_byte import eval_batches
    from csd_pipeline.loss.training import cross_entropy_only

    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(aligned, seq_len=seq_len, batch_size=batch_size):
            out = wrapper(torch.as_tensor(batch.packed.input_ids), torch.as_tensor(batch.packed.position_ids),
                          torch.as_tensor(batch.positions), torch.as_tensor(batch.tokens), global_ce_tokens=1.0,
                          loss=cross_entropy_only(None))
            nats += float(out["ce"])
            n_bytes += batch.text_bytes
    return nats, n_bytes


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_every_evaluation_records_each_source_and_they_recombine(run):
    evaluation = [json.loads(line) for line in open(run / "eval.jsonl", encoding="utf-8")]
    assert [r["step"] for r in evaluation] == [2, 3]
    for record in evaluation:
        sources = record["sources"]
        assert sorted(s.rsplit("/", 1)[-1] for s in sources) == sorted(SOURCES)
        for key in ("bytes", "tokens", "rows"):
            assert sum(s[key] for s in sources.values()) == record[key]
        nats = sum(s["nats"] for s in sources.values())
        # the overall nats are a float32 sum in the loss; the per-source ones float64 sums of the same values
        assert nats == pytest.approx(record["nats"], rel=1e-6)
        assert nats / record["bytes"] / math.log(2) == pytest.approx(record["bits_per_byte"], rel=1e-6)
        for s in sources.values():
            assert s["bits_per_byte"] == s["nats"] / s["bytes"] / math.log(2)


def test_overall_figure_is_unchanged_and_sources_match_a_brute_force_count(run, two_sources):
    """The sharded evaluation's code on the exported weights (one rank, no FSDP): the same overall nats as the
    CE-only scoring to the last bit, and per source the count of each window alone with float64 log-softmax."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from trainer.evaluation import bits_per_byte_fsdp
    from trainer.model import StudentWithLoss

    model = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32).eval()
    wrapper = StudentWithLoss(model)
    ctx = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    got = bits_per_byte_fsdp(wrapper, two_sources, ctx, seq_len=128, batch_size=2, chunk_size=None)
    nats, n_bytes = _old_overall(wrapper, two_sources, 128, 2)
    assert got["nats"] == nats and got["bytes"] == n_bytes
    assert got["bits_per_byte"] == nats / n_bytes / math.log(2)
    expected = {}
    manifest = json.loads((two_sources / "manifest.json").read_text())
    with torch.no_grad():
        for shard in manifest["shards"]:
            for row in pq.read_table(two_sources / shard["file"]).to_pylist():
                ids = torch.tensor([row["student_ids"]])
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
                total = expected.setdefault(row["source"], [0.0, 0])
                total[0] -= sum(float(logp[j - 1, ids[0, j]]) for j in range(1, ids.shape[1])
                                if row["student_loss_mask"][j])
                total[1] += len(row["text"].encode("utf-8"))
    assert set(got["sources"]) == set(expected)
    for source, (source_nats, source_bytes) in expected.items():
        assert got["sources"][source]["bytes"] == source_bytes
        assert got["sources"][source]["nats"] == pytest.approx(source_nats, rel=1e-5)


def test_window_sums_and_the_tally():
    logprobs = np.array([-1.0, -2.0, -0.5, -4.0, -0.25])
    assert window_nats(logprobs, [2, 0, 3]).tolist() == [3.0, 0.0, 4.75]
    tally = SourceTally(["a", "b"])
    batch = SimpleNamespace(window_tokens=np.array([2, 0, 3]), window_bytes=[5, 1, 7], window_sources=["b", "a", "b"])
    tally.add(batch, logprobs)
    merged = SourceTally(["a", "b"])
    merged.load((np.asarray(tally.flat()) * 2).tolist())  # as two ranks' sums
    assert merged.by_source()["b"] == {"bits_per_byte": 15.5 / 24 / math.log(2), "nats": 15.5, "bytes": 24,
                                       "tokens": 10, "rows": 4}
    assert merged.by_source()["a"]["nats"] == 0.0
    from csd_pipeline.errors import CsdError

    with pytest.raises(CsdError, match="do not match"):
        window_nats(logprobs, [2, 2])


def test_report_of_the_run_has_a_row_and_a_panel_per_source(run, tmp_path):
    from csd_pipeline.report.render import write_report

    text = write_report([run], tmp_path / "report").read_text(encoding="utf-8")
    for name in SOURCES:
        assert f"{name}` | " in text and "(step 3) |" in text
    assert (tmp_path / "report" / "training-heldout-sources.png").is_file()


def test_the_eval_line_names_each_source_and_trackers_skip_the_dict(tmp_path, capsys):
    from trainer.metrics import MetricsLogger
    from trainer.trackers import tracker_values

    record = {"step": 4, "bits_per_byte": 1.5, "sources": {"/c/de.txt": {"bits_per_byte": 1.75, "bytes": 3},
                                                           "/c/en.txt": {"bits_per_byte": 1.25, "bytes": 5}}}
    logger = MetricsLogger(tmp_path, True, 4, 0, progress=False)
    logger.log_eval(record)
    logger.close()
    err = capsys.readouterr().err
    assert "eval step 4: bits_per_byte 1.5000\n" in err and "per source: de.txt 1.7500, en.txt 1.2500" in err
    assert json.loads((tmp_path / "eval.jsonl").read_text()) == record
    assert tracker_values(record, "eval") == {"eval/bits_per_byte": 1.5}
