"""`csd-pipeline bits-per-byte`: the CLI scores a causal LM on an aligned folder's bytes, and a wrong
argument is one `error:` line."""

from __future__ import annotations

import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_model(tiny_student):
    """A random 2-layer Llama over the llama-spm vocabulary, saved as an HF folder (conftest `tiny_student`)."""
    return tiny_student


def brute_force_bits_per_byte(model_dir, aligned) -> tuple[float, int]:
    """Each window alone, float64 log-softmax, every loss-masked student token after the first."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    manifest = json.loads((aligned / "manifest.json").read_text())
    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for shard in manifest["shards"]:
            for row in pq.read_table(aligned / shard["file"]).to_pylist():
                ids = torch.tensor([row["student_ids"]])
                logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
                nats -= sum(float(logp[j - 1, ids[0, j]]) for j in range(1, ids.shape[1]) if row["student_loss_mask"][j])
                n_bytes += len(row["text"].encode("utf-8"))
    return nats / n_bytes / math.log(2), n_bytes


def test_cli_matches_a_brute_force_count(trainer_data, tiny_model, run_cli):
    aligned = trainer_data["eval"]
    code, out, err = run_cli(["bits-per-byte", "--aligned", str(aligned), "--model", str(tiny_model),
                              "--seq-len", "128", "--batch-size", "2", "--device", "cpu", "--json"])
    assert code == 0, err
    result = json.loads(out)
    expected, n_bytes = brute_force_bits_per_byte(tiny_model, aligned)
    assert result["side"] == "student" and result["bytes"] == n_bytes
    assert result["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    (source, figures), = result["sources"].items()  # one corpus file: its figures are the overall ones
    assert source.endswith("devil-slice.txt") and figures["bytes"] == n_bytes and figures["tokens"] == result["tokens"]
    assert figures["bits_per_byte"] == pytest.approx(result["bits_per_byte"], rel=1e-12)
    # a freshly initialised model is close to uniform: about ln(32000) nats per token
    assert abs(result["nats"] / result["tokens"] - math.log(32000)) < 0.5


@pytest.mark.parametrize("extra, fragment", [
    (["--side", "teacher"], "--side teacher"),
    (["--side", "teacher3"], "teacher"),   # a teacher index the folder does not have
])
def test_wrong_arguments_are_one_error_line(trainer_data, tiny_model, run_cli, extra, fragment):
    code, out, err = run_cli(["bits-per-byte", "--aligned", str(trainer_data["eval"]), "--model", str(tiny_model),
                              "--seq-len", "128", "--device", "cpu", *extra])
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


def test_a_folder_that_is_not_an_aligned_output_is_refused(tmp_path, tiny_model, run_cli):
    code, out, err = run_cli(["bits-per-byte", "--aligned", str(tmp_path), "--model", str(tiny_model),
                              "--device", "cpu"])
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error:") and str(tmp_path) in lines[0], err
