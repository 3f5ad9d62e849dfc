"""`csd-pipeline generate`: byte-identical on re-run and across ranks, resumable after a kill, and a
corpus the align stage reads (loss only on the samples), with a tiny random-init student and the
real llama-spm tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from csd_pipeline.generate.backend import sample_seed
from csd_pipeline.generate.config import GenerateConfig
from csd_pipeline.generate.stage import completion_text, run_generate
from csd_pipeline.runtime.manifest import read_manifest
from tests.onpolicy_cases import REPO, prompt_corpus


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_student):
    return tiny_student, prompt_corpus(tmp_path_factory.mktemp("generate") / "prompts.jsonl", documents=5)


def _config(inputs, output, **overrides) -> GenerateConfig:
    student, prompts = inputs
    values = dict(model=str(student), corpus=[str(prompts)], output=str(output), prompt_field="text", prompt_chars=100,
                  max_new_tokens=6, temperature=0.9, top_p=0.9, samples_per_prompt=2, seed=3, batch_size=3,
                  prompts_per_shard=2, device="cpu")
    return GenerateConfig(**(values | overrides))


@pytest.fixture(scope="module")
def sampled(inputs, tmp_path_factory) -> Path:
    """`run_generate` of `_config(inputs, ...)`: the output the tests below compare with and align."""
    output = tmp_path_factory.mktemp("sampled") / "out"
    run_generate(_config(inputs, output))
    return output


def _shards(output: Path) -> list[bytes]:
    manifest = read_manifest(output, stage="generate")
    return [(output / shard["file"]).read_bytes() for shard in manifest["shards"]]


def test_rerun_and_ranks_give_the_same_bytes(inputs, sampled, tmp_path):
    shutil.copytree(sampled, tmp_path / "a")
    first = _shards(tmp_path / "a")
    manifest = (tmp_path / "a" / "manifest.json").read_bytes()
    run_generate(_config(inputs, tmp_path / "a"))  # complete: nothing rewritten
    assert _shards(tmp_path / "a") == first and (tmp_path / "a" / "manifest.json").read_bytes() == manifest
    for rank in (1, 0):
        run_generate(_config(inputs, tmp_path / "b"), rank=rank, world_size=2)
    assert _shards(tmp_path / "b") == first
    records = [json.loads(line) for shard in first for line in shard.decode().splitlines()]
    assert len(records) == 5 * 2 and {r["sample"] for r in records} == {0, 1}
    text = [json.loads(line)["text"] for line in inputs[1].read_text().splitlines()]
    for r in records:  # prompt + reference is the document; samples of one prompt differ (seeded apart)
        assert r["prompt"] + r["reference"] == text[r["record_index"]] and r["completion_tokens"] == 6
    pairs = {}
    for r in records:
        pairs.setdefault(r["record_index"], []).append(r["completion"])
    assert any(a != b for a, b in pairs.values())


def test_a_sample_does_not_depend_on_its_batch(inputs, tmp_path):
    """Batch size 1 and 3 draw the same tokens where the logits agree; greedy decoding must agree fully
    (one sample per prompt: greedy samples of one prompt are the same, so a batch of 3 holds 3 prompts)."""
    run_generate(_config(inputs, tmp_path / "one", batch_size=1, temperature=0.0, samples_per_prompt=1))
    run_generate(_config(inputs, tmp_path / "three", batch_size=3, temperature=0.0, samples_per_prompt=1))
    strip = [[{k: v for k, v in json.loads(line).items()} for line in s.decode().splitlines()]
             for s in _shards(tmp_path / "one")]
    assert strip == [[json.loads(line) for line in s.decode().splitlines()] for s in _shards(tmp_path / "three")]


@pytest.mark.slow
def test_kill_and_resume_end_with_the_same_bytes(inputs, sampled, tmp_path):
    student, prompts = inputs
    command = [sys.executable, "-m", "cli.main", "generate", "--model", str(student), "--corpus", str(prompts),
               "--output", str(tmp_path / "killed"), "--prompt-field", "text", "--prompt-chars", "100",
               "--max-new-tokens", "6", "--temperature", "0.9", "--top-p", "0.9", "--samples-per-prompt", "2",
               "--seed", "3", "--batch-size", "3", "--prompts-per-shard", "2", "--device", "cpu", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "CSD_TEST_CRASH": "before_marker:2"}
    killed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "manifest.json").exists()
    env.pop("CSD_TEST_CRASH")
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert _shards(tmp_path / "killed") == _shards(sampled)


def test_align_reads_the_output_and_trains_only_on_samples(inputs, sampled, tmp_path, tokenizer_path, tables_for):
    from csd_pipeline.align.config import AlignConfig
    from csd_pipeline.align.output import AlignedOutput
    from csd_pipeline.align.stage import run_align
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    run_align(AlignConfig(corpus=[str(sampled)], student_tokenizer=str(inputs[0]),
                          teacher_tokenizers=["smollm2"], output=str(tmp_path / "aligned"), max_student_tokens=256,
                          tables=[tables_for("llama-spm", "smollm2")]))  # the student's tokenizer is llama-spm's
    records = [json.loads(line) for shard in _shards(sampled) for line in shard.decode().splitlines()]
    vocab = load_tokenizer(str(tokenizer_path("llama-spm"))).vocab
    import pyarrow.parquet as pq

    aligned = AlignedOutput.open(tmp_path / "aligned")
    rows = [row for shard in aligned.shards for row in pq.read_table(tmp_path / "aligned" / shard.file).to_pylist()]
    usable = [r for r in records if r["completion"]]
    assert len(rows) == len(usable)
    for row, record in zip(rows, usable, strict=True):
        masked = [i for i, m in zip(row["student_ids"], row["student_loss_mask"], strict=True) if m]
        assert b"".join(vocab.token_bytes[i] for i in masked) == record["completion"].encode("utf-8")


def test_seeds_and_completion_text():
    assert sample_seed(0, "a", 1, 0) != sample_seed(0, "a", 1, 1) != sample_seed(1, "a", 1, 0)
    assert sample_seed(0, "a", 1, 0) == sample_seed(0, "a", 1, 0) < 1 << 63

    class Vocab:
        token_bytes = [b"ab", "é".encode()[:1], "é".encode()[1:], b"\xff", b""]

    assert completion_text(Vocab, [0, 1, 2]) == "abé"
    assert completion_text(Vocab, [0, 1]) == "ab"  # a character cut by the token limit is dropped
    assert completion_text(Vocab, [3, 0, 4]) == "\ufffdab"
