"""`csd-pipeline evaluate`: lm-evaluation-harness on the project's own task, offline, on the SmolLM2 fixture;
the harness's accuracy is checked against a float64 count of the same log-likelihoods."""

from __future__ import annotations

import json
import math
import sys

import pytest

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PROJECT_TASKS = ["csd_heldout_devil", "csd_next_sentence", "csd_next_sentence_devil", "csd_next_sentence_kjv"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def _one_error_line(code, out, err, fragment):
    lines = err.strip().splitlines()
    assert code != 0 and out == "", (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], err


def test_a_missing_lm_eval_is_one_error_line_saying_how_to_install(run_cli, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)   # `import lm_eval` now raises ImportError
    code, out, err = run_cli(["evaluate", "--model", "smollm2-135m-instruct", "--tasks", "csd_next_sentence",
                              "--output", tmp_path / "r.json"])
    _one_error_line(code, out, err, "pip install 'csd-pipeline[eval]'")
    code, out, err = run_cli(["evaluate", "--list-tasks"])
    _one_error_line(code, out, err, "pip install 'csd-pipeline[eval]'")


@pytest.fixture(scope="module")
def user_tasks(tmp_path_factory):
    """A user's task folder, the same for the two tests that index the harness's registry: the process indexes it
    once per set of task folders (`harness.task_manager`), about 5 s each."""
    folder = tmp_path_factory.mktemp("user-tasks")
    (folder / "mine.yaml").write_text("task: my_own_task\ndataset_path: json\noutput_type: multiple_choice\n")
    return folder


@pytest.mark.slow   # indexing the harness's ~14,000 task names takes about 8 s
def test_list_tasks_puts_the_projects_first_then_the_users_then_the_harness(run_cli, user_tasks):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'csd-pipeline[eval]')")
    code, out, err = run_cli(["evaluate", "--list-tasks", "--include-path", user_tasks])
    assert code == 0, err
    names = out.splitlines()
    assert names[:4] == PROJECT_TASKS and names[4] == "my_own_task"
    assert "hellaswag" in names[4:] and len(names) > 1000


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_an_unknown_task_and_a_missing_model_are_one_error_line(run_cli, tmp_path, user_tasks):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'csd-pipeline[eval]')")
    output = tmp_path / "r.json"
    code, out, err = run_cli(["evaluate", "--model", "smollm2-135m-instruct", "--tasks", "csd_next_sentence,no_such_task",
                              "--include-path", user_tasks, "--output", output])
    _one_error_line(code, out, err, "unknown task no_such_task")
    code, out, err = run_cli(["evaluate", "--model", tmp_path / "no-such-export", "--tasks", "csd_next_sentence",
                              "--output", output])
    _one_error_line(code, out, err, "no-such-export")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    code, out, err = run_cli(["evaluate", "--model", tmp_path / "model.gguf", "--tasks", "csd_next_sentence",
                              "--output", output])
    _one_error_line(code, out, err, "not GGUF")
    assert not output.exists()


def float64_model(folder):
    """(model, tokenizer) of a Hugging Face folder, the model in float64 for the references."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def smollm2_float64(model_path):
    """(model, tokenizer) of the SmolLM2 fixture in float64, loaded once for this file's float64 references."""
    return float64_model(model_path("smollm2-135m-instruct"))


def choice_log_likelihoods(model, tokenizer, item) -> list[float]:
    """Float64 log-likelihood of each " choice" after the item's context. The context runs once and each choice
    continues from a copy of its key/value cache: the same sums as one whole pass per choice
    (test_the_cached_context_gives_the_whole_pass_log_likelihoods), in a fraction of the float64 work."""
    import copy

    import torch

    context_ids = tokenizer(item["context"])["input_ids"]
    with torch.no_grad():
        context = model(torch.tensor([context_ids]), use_cache=True, logits_to_keep=1)
    scores = []
    for choice in item["choices"]:
        ids = tokenizer(item["context"] + " " + choice)["input_ids"]
        if ids[:len(context_ids)] != context_ids:   # the harness splits off the context the same way
            raise ValueError(f"{item['id']}: the context's tokens change when the choice follows")
        continuation = ids[len(context_ids):]
        with torch.no_grad():
            logits = model(torch.tensor([continuation]), cache=copy.deepcopy(context.cache)).logits
        logp = torch.log_softmax(torch.cat([context.logits[0, -1:], logits[0, :-1]]), dim=-1)
        scores.append(sum(float(logp[j, token]) for j, token in enumerate(continuation)))
    return scores


def reference_accuracy(model, tokenizer, items) -> tuple[float, float]:
    """(acc, acc_norm) counted by hand: float64 log-likelihood of " choice" after the context, argmax (acc_norm:
    divided by the choice's length in bytes, as the harness does)."""
    hits = hits_norm = 0
    for item in items:
        scores = choice_log_likelihoods(model, tokenizer, item)
        hits += max(range(4), key=lambda k: scores[k]) == item["label"]
        norm = [s / len((" " + c).encode("utf-8")) for s, c in zip(scores, item["choices"])]
        hits_norm += max(range(4), key=lambda k: norm[k]) == item["label"]
    return hits / len(items), hits_norm / len(items)


@pytest.mark.slow
def test_the_cached_context_gives_the_whole_pass_log_likelihoods(smollm2_float64):
    """The reference's shortcut (context once, each choice from a copy of its cache) equals one whole float64
    pass per choice: the first item (the shortest context), its first choice and its last (which would see a
    cache changed by the choices before it)."""
    import torch

    from csd_pipeline.evaluation import next_sentence as ns

    model, tokenizer = smollm2_float64
    item = json.loads((ns.TASK_DIR / "devil.jsonl").read_text().splitlines()[0])
    context_ids = tokenizer(item["context"])["input_ids"]
    whole = []
    for choice in (item["choices"][0], item["choices"][-1]):
        ids = tokenizer(item["context"] + " " + choice)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
        whole.append(sum(float(logp[j - 1, ids[j]]) for j in range(len(context_ids), len(ids))))
    cached = choice_log_likelihoods(model, tokenizer, item)
    assert [cached[0], cached[-1]] == pytest.approx(whole, rel=0, abs=1e-9)


@pytest.mark.slow
def test_the_fixture_scores_like_a_float64_count(run_cli, model_path, smollm2_float64, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'csd-pipeline[eval]')")
    from csd_pipeline.evaluation import next_sentence as ns

    output = tmp_path / "results.json"
    code, out, err = run_cli(["evaluate", "--model", "smollm2-135m-instruct", "--tasks", "csd_next_sentence_devil",
                              "--limit", 4, "--batch-size", 4, "--device", "cpu", "--output", output])
    assert code == 0, err
    results = json.loads(output.read_text())
    scores = results["results"]["csd_next_sentence_devil"]
    n = 4
    for metric in ("acc", "acc_norm"):
        value, stderr = scores[f"{metric},none"], scores[f"{metric}_stderr,none"]
        assert stderr == pytest.approx(math.sqrt(value * (1 - value) / (n - 1)))   # the harness's sample stderr
    assert f"csd_next_sentence_devil acc {scores['acc,none']:.4f}" in out
    assert results["csd_pipeline"]["model_path"] == str(model_path("smollm2-135m-instruct"))
    assert results["csd_pipeline"]["dtype"] == "float32" and results["n-samples"]["csd_next_sentence_devil"]["effective"] == n
    items = [json.loads(line) for line in (ns.TASK_DIR / "devil.jsonl").read_text().splitlines()][:n]
    acc, acc_norm = reference_accuracy(*smollm2_float64, items)
    assert (scores["acc,none"], scores["acc_norm,none"]) == pytest.approx((acc, acc_norm))


def float64_bits(model, tokenizer, text: str) -> tuple[float, int]:
    """(nats, bytes) of `text` whole: a float64 sum of the model's log-probabilities of its tokens after the
    tokenizer's prefix token (BOS, else EOS), as the harness's rolling log-likelihood scores a short document."""
    import torch

    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = [prefix, *tokenizer(text, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    return -sum(float(logp[j - 1, ids[j]]) for j in range(1, len(ids))), len(text.encode("utf-8"))


@pytest.mark.slow
def test_the_heldout_text_task_scores_bits_per_byte_like_a_float64_sum(run_cli, smollm2_float64, tmp_path):
    """csd_heldout_devil on two passages: each passage's bits per byte, their mean and its standard error
    (sample standard deviation over sqrt(n)), and the byte-weighted bits per byte equal a float64 reference."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'csd-pipeline[eval]')")
    import statistics
    from pathlib import Path

    import csd_pipeline.evaluation as evaluation
    from csd_pipeline.evaluation.task_data import load_task_jsonl

    n = 2
    output, cache = tmp_path / "results.json", tmp_path / "cache"
    command = ["evaluate", "--model", "smollm2-135m-instruct", "--tasks", "csd_heldout_devil", "--limit", n,
               "--device", "cpu", "--output", output, "--cache-dir", cache]
    code, out, err = run_cli(command)
    assert code == 0, err
    assert "reused" not in out and len(list(cache.glob("*.json"))) == 1
    scores = json.loads(output.read_text())["results"]["csd_heldout_devil"]
    output.unlink()
    code, again, err = run_cli(command)   # the same model, task files, lm-eval and options: the cached scores
    assert code == 0, err
    assert "task scores reused from" in again and json.loads(output.read_text())["results"]["csd_heldout_devil"] == scores
    documents = load_task_jsonl(Path(evaluation.__file__).parent / "tasks" / "heldout_text", "devil.jsonl")["test"]
    model, tokenizer = smollm2_float64
    counts = [float64_bits(model, tokenizer, documents[i]["text"]) for i in range(n)]
    per_passage = [nats / size / math.log(2) for nats, size in counts]
    assert len(set(per_passage)) == n   # distinct passages: a standard error of zero would prove nothing
    assert scores["passage_bits_per_byte,none"] == pytest.approx(statistics.fmean(per_passage), rel=1e-4)
    assert scores["passage_bits_per_byte_stderr,none"] == pytest.approx(
        statistics.stdev(per_passage) / math.sqrt(n), rel=1e-3)
    byte_weighted = sum(nats for nats, _ in counts) / sum(size for _, size in counts) / math.log(2)
    assert scores["bits_per_byte,none"] == pytest.approx(byte_weighted, rel=1e-4)
    assert scores["bits_per_byte_stderr,none"] == "N/A"   # the harness has no standard error for the pooled figure
    mean_line = (f"csd_heldout_devil passage_bits_per_byte {scores['passage_bits_per_byte,none']:.4f} ± "
                 f"{scores['passage_bits_per_byte_stderr,none']:.4f}")
    assert mean_line in out and f"csd_heldout_devil bits_per_byte {scores['bits_per_byte,none']:.4f}" in out


def test_the_task_cache_key_changes_with_any_task_file(tmp_path):
    """A task's YAML, data or code changed in an include folder (or a file added) gives another key; the same
    files give the same key."""
    from csd_pipeline.evaluation.harness import task_files_sha256

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "mine.yaml").write_text("task: mine\nmetadata:\n  version: 1.0\n")
    first = task_files_sha256([str(folder)])
    assert task_files_sha256([str(folder)]) == first != task_files_sha256([])
    (folder / "mine.yaml").write_text("task: mine\nmetadata:\n  version: 1.1\n")
    second = task_files_sha256([str(folder)])
    (folder / "data.jsonl").write_text("{}\n")
    assert len({first, second, task_files_sha256([str(folder)])}) == 3
