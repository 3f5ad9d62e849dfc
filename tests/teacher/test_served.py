"""The served teacher's reading of an answer and its refusals (csd_pipeline/teacher/served.py), without a server.

The answers here have the shape of vLLM's completions answer with `prompt_logprobs` (one dict per prompt token,
keyed by token id, first None), filled from a float64 log-softmax computed here, so each position's top-k and
observed value are checked against a brute-force reference. The real-server tests are in test_served_vllm.py.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from csd_pipeline.errors import CsdError
from csd_pipeline.teacher.served import ServedTeacherError, prompt_entries
from tests.teacher.test_stage import aligned  # noqa: F401  (the real align stage's output, a module fixture)

VOCAB = 300
K = 8
WHERE = "http://127.0.0.1:1"


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def vllm_answer(logprobs: np.ndarray, prompt: list[int], k: int) -> dict:
    """A completions answer as vLLM writes it: prompt_logprobs[i] holds the top-k of the distribution that
    predicts prompt token i (row i - 1 of `logprobs`) and token i itself, keyed by id as a string."""
    entries = [None]
    for i in range(1, len(prompt)):
        row = logprobs[i - 1]
        order = np.argsort(-row, kind="stable")
        ranks = np.empty(len(order), dtype=np.int64)
        ranks[order] = np.arange(1, len(order) + 1)
        chosen = [int(t) for t in order[:k]]
        if prompt[i] not in chosen:
            chosen.append(prompt[i])
        entries.append({str(t): {"logprob": float(row[t]), "rank": int(ranks[t]), "decoded_token": "x"} for t in chosen})
    return {"choices": [{"text": "", "prompt_logprobs": entries}]}


@pytest.fixture
def case():
    """A row of 12 ids and the float64 log-softmax of each of its 13 prompt positions (row + one extra id)."""
    generator = np.random.default_rng(0)
    row = generator.integers(0, VOCAB, size=12)
    logits = generator.normal(0.0, 3.0, size=(13, VOCAB))
    logits[3, row[4]] += 20.0  # a position whose observed token leads
    return row, log_softmax(logits)


def test_entries_are_each_positions_top_k_and_the_observed_value(case):
    row, logprobs = case
    prompt = [int(i) for i in row] + [int(row[-1])]
    ids, values, observed = prompt_entries(vllm_answer(logprobs, prompt, K), row, K, VOCAB, WHERE)
    assert ids.shape == values.shape == (len(row), K)
    for t in range(len(row)):
        expected = np.argsort(-logprobs[t], kind="stable")[:K]
        assert list(ids[t]) == list(expected)
        np.testing.assert_allclose(values[t], logprobs[t, expected], atol=1e-6)
    np.testing.assert_allclose(observed[:-1], logprobs[np.arange(len(row) - 1), row[1:]], atol=1e-6)
    assert np.isnan(observed[-1])
    outside = [t for t in range(len(row) - 1) if row[t + 1] not in ids[t]]
    assert outside and row[4] in ids[3]  # both kinds of position occur (K + 1 entries and K)


def test_fewer_entries_than_asked_are_refused_naming_the_server_and_the_fix(case):
    row, logprobs = case
    prompt = [int(i) for i in row] + [int(row[-1])]
    answer = vllm_answer(logprobs, prompt, K - 2)
    with pytest.raises(ServedTeacherError, match=r"returned \d+ entries at prompt position 1 for a top-8.*--max-logprobs 8"):
        prompt_entries(answer, row, K, VOCAB, WHERE)


def test_answers_of_another_shape_are_refused(case):
    row, logprobs = case
    prompt = [int(i) for i in row] + [int(row[-1])]
    good = vllm_answer(logprobs, prompt, K)
    shorter = {"choices": [{"prompt_logprobs": good["choices"][0]["prompt_logprobs"][1:]}]}
    with pytest.raises(ServedTeacherError, match="for 12 prompt tokens, but the prompt had 13"):
        prompt_entries(shorter, row, K, VOCAB, WHERE)
    by_text = {"choices": [{"prompt_logprobs": [None] + [{"hello": -1.0}] * len(row)}]}
    with pytest.raises(ServedTeacherError, match="not by a token id"):
        prompt_entries(by_text, row, K, VOCAB, WHERE)
    with pytest.raises(ServedTeacherError, match="without choices"):
        prompt_entries({"choices": [{"logprobs": None}]}, row, K, VOCAB, WHERE)
    with pytest.raises(ServedTeacherError, match="outside the teacher tokenizer"):
        prompt_entries(good, row, K, VOCAB - 100, WHERE)  # some ids are beyond a smaller tokenizer


def config(**options):
    from csd_pipeline.teacher.config import TeacherLogitsConfig

    return TeacherLogitsConfig(aligned="A", output="O", **{"teacher_server": "http://127.0.0.1:8000",
                                                           "teacher_model": "m", **options})


@pytest.mark.parametrize(("options", "fragment"), [
    ({"tail_samples": 4}, "--tail-samples 4 from a served teacher are drawn among the entries it returns beyond "
                          "--top-k 32; pass --server-top-k above it"),
    ({"tail_samples": 4, "server_top_k": 32}, "pass --server-top-k above it"),
    ({"server_top_k": 64}, "--server-top-k 64 asks the server for entries that only --tail-samples reads"),
    ({"teacher_server": None, "teacher_model": None, "teacher": "gemma3-270m", "server_top_k": 64},
     "--server-top-k 64 is what a served teacher is asked for"),
    ({"temperature": 2.0}, "--temperature 2.0: a server's prompt log-probabilities are at temperature 1"),
    ({"teacher": "gemma3-270m"}, "both name a teacher"),
    ({"teacher_model": None}, "needs --teacher-model"),
    ({"teacher_server": "127.0.0.1:8000"}, "is not an http:// or https:// URL"),
    ({"server_concurrency": 0}, "--server-concurrency 0 is not positive"),
    ({"server_timeout": 0.0}, "--server-timeout 0.0 is not positive"),
    ({"teacher_server": None, "teacher_model": None}, "no teacher: pass --teacher"),
])
def test_options_a_served_teacher_cannot_honour_are_refused_naming_them(options, fragment):
    with pytest.raises(CsdError, match=None) as refused:
        config(**options).validate()
    assert fragment in str(refused.value)
    assert "\n" not in str(refused.value)


def test_every_option_of_the_stage_is_a_flag_of_the_command():
    """Each `TeacherLogitsConfig` field is a `teacher-logits` flag (--server-top-k was once left out)."""
    from dataclasses import fields

    from cli.teacher_logits import teacher_logits
    from csd_pipeline.teacher.config import TeacherLogitsConfig

    flags = {parameter.name for parameter in teacher_logits.params}
    assert {field.name for field in fields(TeacherLogitsConfig)} <= flags


def test_min_p_top_p_and_tail_samples_beyond_the_top_k_are_allowed(case):
    config(min_p=0.01, top_p=0.9).validate()
    config(tail_samples=8, server_top_k=64, top_k=16).validate()


# ---------------------------------------------------------------------------------------------
# The whole stage with a served teacher whose answers come from the tiny teacher (float64, computed here): the
# store must read back as the in-process store does (same rows, same checks against the float64 reference, same
# shard names and selector metadata). It checks the served path's wiring; the real server is test_served_vllm.py.


def answer_from(model_dir):
    """`_call(method, path, body)` of a served teacher whose model is `model_dir`, in float64."""
    from tests.teacher.test_stage import VOCAB as TINY_VOCAB
    from tests.teacher.test_stage import float64_reference

    lock = threading.Lock()  # loading the float64 model sets torch's default dtype for every thread a moment

    def call(self, method, path, body=None):
        if method == "GET":
            return {"data": [{"id": "tiny"}]}
        prompt = np.asarray(body["prompt"], dtype=np.int64)
        with lock:
            reference = float64_reference(model_dir, prompt)  # [len(prompt), output size], whole-output normaliser
        real = np.full_like(reference, -np.inf)
        real[:, :TINY_VOCAB] = reference[:, :TINY_VOCAB]  # padded output rows are never returned as entries
        return vllm_answer(real, [int(i) for i in prompt], body["prompt_logprobs"])

    return call


@pytest.mark.slow   # a few seconds of training or a model load: the fast tier's budget is 90 s
def test_a_served_store_reads_back_as_the_in_process_one(aligned, tiny_teacher, tmp_path, monkeypatch):  # noqa: F811
    """With --min-p (a selector cutting each position's entries): the values themselves are checked against the
    real server in test_served_vllm.py."""
    from csd_pipeline import read_teacher_topk
    from csd_pipeline.teacher.served import ServedTeacher
    from csd_pipeline.teacher.stage import TeacherLogitsConfig, run_teacher_logits
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from tests.teacher.test_stage import K as TINY_K
    from tests.teacher.test_stage import aligned_rows, run_stage

    options = {"min_p": 0.05}
    monkeypatch.setattr(ServedTeacher, "_call", answer_from(tiny_teacher))
    served, local = tmp_path / "served", tmp_path / "local"
    config = TeacherLogitsConfig(aligned=str(aligned), output=str(served), teacher_server="http://127.0.0.1:1",
                                 teacher_model="tiny", top_k=TINY_K, server_concurrency=3, **options)
    assert run_teacher_logits(config, log=None).complete
    assert run_stage(aligned, tiny_teacher, local, **options).complete
    rows, expected = list(read_teacher_topk(served)), aligned_rows(aligned)
    assert [r.row_id for r in rows] == [row_id for _, row_id, _ in expected] == [r.row_id for r in read_teacher_topk(local)]
    for row, local_row in zip(rows, read_teacher_topk(local)):
        assert row.ok and list(row.lengths) == list(local_row.lengths)
    served_out, local_out = TeacherTopkOutput.open(served), TeacherTopkOutput.open(local)
    assert [s["file"] for s in served_out.manifest["shards"]] == [s["file"] for s in local_out.manifest["shards"]]
    assert served_out.selectors().names == local_out.selectors().names
    assert served_out.manifest["teacher"]["served_model"] == "tiny"


# ---------------------------------------------------------------------------------------------
# Transient failures: a raw HTTP server on 127.0.0.1 that takes one action per connection (closes it with a reset,
# answers 503, or answers 200 with a JSON body and closes), so the client needs a new connection each time.


def scripted_server(actions: list):
    """(URL, connections served) of a server that takes actions[i] on its i-th connection ("reset", or an HTTP
    status), the last action for every connection after them; a daemon thread, on 127.0.0.1."""
    import json
    import socket
    import struct

    listener = socket.create_server(("127.0.0.1", 0))
    served = []
    body = json.dumps({"data": [{"id": "m"}]}).encode()

    def serve():
        while True:
            connection, _ = listener.accept()
            action = actions[min(len(served), len(actions) - 1)]
            served.append(action)
            with connection:
                connection.recv(65536)
                if action == "reset":  # SO_LINGER 0: the close sends RST, as a dropped kept-alive connection does
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    continue
                head = f"HTTP/1.1 {action} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                connection.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", served


def teacher_at(url: str):
    from csd_pipeline.teacher.served import ServedTeacher

    return ServedTeacher(url, "m", top_k=K, vocab_limit=VOCAB, selectors=(), concurrency=1, timeout=10)


@pytest.mark.parametrize("actions", [["reset", 200], ["reset", 503, "reset", 200], [502, 504, 200]])
def test_a_reset_connection_or_a_busy_answer_is_sent_again(actions, monkeypatch):
    from csd_pipeline.teacher import served as served_module

    monkeypatch.setattr(served_module, "RETRY_PAUSE", 0.01)
    url, served = scripted_server(actions)
    teacher_at(url).check_model()  # GET /v1/models lists "m"
    assert served == actions


@pytest.mark.parametrize(("action", "fragment"), [("reset", "cannot be reached"), (503, "HTTP 503")])
def test_a_failure_that_persists_is_one_line_after_the_retries(action, fragment, monkeypatch):
    from csd_pipeline.teacher import served as served_module

    monkeypatch.setattr(served_module, "RETRY_PAUSE", 0.01)
    url, served = scripted_server([action])
    with pytest.raises(ServedTeacherError) as failure:
        teacher_at(url).check_model()
    assert fragment in str(failure.value) and url in str(failure.value) and "\n" not in str(failure.value)
    assert len(served) == served_module.RETRIES + 1
