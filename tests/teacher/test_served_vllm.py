"""`teacher-logits --teacher-server` against a real vLLM server (vLLM's CPU build, started here on 127.0.0.1).

One server for the module: SmolLM2-135M-Instruct (the fixture teacher) in float32, at most K prompt
log-probabilities a position. The aligned rows are the real align stage's (tests.teacher.test_stage.aligned:
12 rows of real text, SmolLM2 teacher ids). What must hold (issue 42, item 1):

- the served store has the in-process store's rows, shards and selectors; the server's answers are within
  SERVED_TOLERANCE of a float64 forward of the same weights (vLLM's float32 CPU kernels against float64), so the
  two stores' codes agree but where the two float32 values straddle a rounding boundary of the codec (then one
  step, 1/51 nat, apart); the served store's first REFERENCE_ROWS rows pass the in-process store's own check
  against the float64 forward;
- `kill -9` of the stage after a shard, then a re-run (another URL of the same server, another concurrency),
  gives the uninterrupted run's bytes;
- a server that refuses (K above its --max-logprobs), does not answer in time (SIGSTOP) or is gone stops the stage
  with one `error:` line naming the server and the fix, and no manifest is written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.teacher.test_stage import aligned  # noqa: F401  (a module fixture: the real align stage's output)

pytestmark = pytest.mark.slow

K = 8
NAME = "smollm2"
# vLLM's float32 CPU forward against a float64 forward of the same weights (before the store's codec)
SERVED_TOLERANCE = 5e-4  # measured: 1.7e-4 at worst (torch's own float32 forward: 4e-5)


# Rows checked against the float64 forward (12 rows would take 20 s of float64 arithmetic; all 12 are compared
# with the in-process teacher's store)
REFERENCE_ROWS = 4
_references: dict = {}


def reference(teacher_dir, index: int, ids: np.ndarray) -> np.ndarray:
    """The float64 log-softmax of aligned row `index` (tests.teacher.test_stage.float64_reference), once per module."""
    from tests.teacher.test_stage import float64_reference

    if index not in _references:
        _references[index] = float64_reference(teacher_dir, ids)
    return _references[index]


@pytest.fixture(scope="module")
def teacher_dir(model_path):
    return model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(teacher_dir, tmp_path_factory):
    """(URL, process) of vLLM serving the fixture teacher as NAME."""
    from tests.teacher.vllm_server import vllm_server

    with vllm_server(teacher_dir, NAME, K, tmp_path_factory.mktemp("vllm") / "server.log") as running:
        yield running


def served_config(aligned_dir, output, url, **options):
    from csd_pipeline.teacher.stage import TeacherLogitsConfig

    return TeacherLogitsConfig(aligned=str(aligned_dir), output=str(output), teacher_server=url, teacher_model=NAME,
                               **{"top_k": K, "server_concurrency": 4, **options})


@pytest.fixture(scope="module")
def served_output(aligned, server, tmp_path_factory):  # noqa: F811
    from csd_pipeline.teacher.stage import run_teacher_logits

    output = tmp_path_factory.mktemp("served")
    assert run_teacher_logits(served_config(aligned, output, server[0]), log=None).complete
    return output


def test_the_vllm_store_equals_the_in_process_teachers(aligned, served_output, teacher_dir, tmp_path):  # noqa: F811
    from csd_pipeline import read_teacher_topk
    from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from tests.teacher.test_stage import (
        aligned_rows,
        check_row_against_reference,
        run_stage,
    )

    local = tmp_path / "local"
    assert run_stage(aligned, teacher_dir, local).complete
    served_rows, local_rows, expected = list(read_teacher_topk(served_output)), list(read_teacher_topk(local)), \
        aligned_rows(aligned)
    assert [r.row_id for r in served_rows] == [r.row_id for r in local_rows] == [row_id for _, row_id, _ in expected]
    same, entries = 0, 0
    for index, (served, in_process, (_, _, ids)) in enumerate(zip(served_rows, local_rows, expected)):
        assert served.ok and list(served.lengths) == list(in_process.lengths)
        if index < REFERENCE_ROWS:
            check_row_against_reference(served, ids, reference(teacher_dir, index, ids), K)
        # Two float32 values a few 1e-6 apart round to the same code, or to neighbouring ones (one codec step,
        # 2 x MAX_ABS_ERROR) where they straddle a rounding boundary; a near-tie may swap two ids' order.
        agree = served.ids == in_process.ids
        assert np.all(np.abs(served.logprobs - in_process.logprobs)[agree] <= 2 * MAX_ABS_ERROR + 1e-5)
        observed = ~np.isnan(in_process.observed_logprob)
        assert np.all(np.abs(served.observed_logprob - in_process.observed_logprob)[observed] <= 2 * MAX_ABS_ERROR + 1e-5)
        same += int((agree & (served.logprobs == in_process.logprobs)).sum())
        entries += agree.size
    assert same >= 0.95 * entries, (same, entries)
    served_out, local_out = TeacherTopkOutput.open(served_output), TeacherTopkOutput.open(local)
    assert [s["file"] for s in served_out.manifest["shards"]] == [s["file"] for s in local_out.manifest["shards"]]
    assert served_out.selectors().names == local_out.selectors().names
    assert served_out.manifest["teacher"]["served_model"] == NAME


def test_the_servers_answers_are_float32_close_to_a_float64_forward(aligned, server, teacher_dir):  # noqa: F811
    """The answers before the store's codec: every returned log-probability within SERVED_TOLERANCE of the float64
    reference (the whole difference is float32 arithmetic; the weights are the same file)."""
    from csd_pipeline.teacher.served import COMPLETIONS_PATH, ServedTeacher, prompt_entries
    from tests.teacher.test_stage import VOCAB, aligned_rows

    teacher = ServedTeacher(server[0], NAME, top_k=K, vocab_limit=VOCAB, selectors=(), concurrency=1, timeout=60)
    worst = 0.0
    for index, (_, _, ids) in enumerate(aligned_rows(aligned)[:REFERENCE_ROWS]):
        answer = teacher._call("POST", COMPLETIONS_PATH, teacher.request(ids))
        top, values, observed = prompt_entries(answer, ids, K, VOCAB, server[0])
        exact = reference(teacher_dir, index, ids)
        worst = max(worst, float(np.abs(values - np.take_along_axis(exact, top.astype(np.int64), 1)).max()),
                    float(np.abs(observed[:-1] - exact[np.arange(len(ids) - 1), ids[1:]]).max()))
    assert worst <= SERVED_TOLERANCE, worst


def test_killed_after_a_shard_then_rerun_against_a_moved_url_gives_the_same_bytes(aligned, server, served_output, tmp_path):  # noqa: F811
    from csd_pipeline.runtime.executor import CRASH_ENV
    from csd_pipeline.teacher.stage import run_teacher_logits
    from tests.reliability.cases import REPO, tree

    killed = tmp_path / "killed"
    args = ["teacher-logits", "--aligned", aligned, "--output", killed, "--teacher-server", server[0],
            "--teacher-model", NAME, "--top-k", K, "--server-concurrency", 2, "--quiet"]
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **{CRASH_ENV: "after_marker:1"})
    crashed = subprocess.run([sys.executable, "-m", "cli.main", *map(str, args)], cwd=REPO, env=environment,
                             capture_output=True, text=True, timeout=300)
    assert crashed.returncode == -9 and not (killed / "manifest.json").exists(), crashed.stderr[-2000:]
    assert len(list((killed / "done").glob("*.done"))) == 1
    moved = server[0].replace("127.0.0.1", "localhost")  # the URL is not part of the run's identity
    assert run_teacher_logits(served_config(aligned, killed, moved, server_concurrency=1), log=None).complete
    assert tree(killed) == tree(served_output)


def _error_line(config) -> str:
    """The one line a failed stage prints (the CLI's `error:` line), checked to be the only one."""
    from csd_pipeline.errors import CsdError
    from csd_pipeline.teacher.stage import run_teacher_logits

    with pytest.raises(CsdError) as failure:
        run_teacher_logits(config, log=None)
    message = str(failure.value)
    assert "\n" not in message
    return message


def test_k_above_the_servers_max_logprobs_is_one_line_and_nothing_is_kept(aligned, server, tmp_path):  # noqa: F811
    output = tmp_path / "refused"
    message = _error_line(served_config(aligned, output, server[0], top_k=K + 1))
    assert server[0] in message and "HTTP 400" in message and "--max-logprobs" in message
    assert not (output / "manifest.json").exists() and not list(output.glob("done/*.done"))


def test_a_server_that_does_not_answer_in_time_is_one_line(aligned, server, tmp_path):  # noqa: F811
    url, process = server
    output = tmp_path / "timeout"
    os.killpg(os.getpgid(process.pid), signal.SIGSTOP)
    try:
        message = _error_line(served_config(aligned, output, url, server_timeout=2))
    finally:
        os.killpg(os.getpgid(process.pid), signal.SIGCONT)
    assert url in message and "--server-timeout 2" in message and "re-run to resume" in message
    assert not (output / "manifest.json").exists()


def test_a_server_that_is_gone_is_one_line(aligned, tmp_path):  # noqa: F811
    from tests.teacher.vllm_server import _free_port

    url = f"http://127.0.0.1:{_free_port()}"
    output = tmp_path / "gone"
    message = _error_line(served_config(aligned, output, url))
    assert url in message and "cannot be reached" in message and "start it" in message
    assert not (output / "manifest.json").exists()


def test_tail_samples_are_drawn_among_the_servers_entries_beyond_the_top_k(aligned, server, teacher_dir, tmp_path):  # noqa: F811
    """--top-k 3 --server-top-k K --tail-samples 6: every entry stored beyond a position's top-3 and its observed
    token is one of the float64 forward's K most likely ids, at log(c x m / 6) for a count c of 1..6, m the float64
    tail mass (1 - the top-3 - the observed token; within the codec's error and the server's float32 arithmetic);
    each row draws with its own generator, so another --server-concurrency writes the same bytes."""
    from csd_pipeline import read_teacher_topk
    from csd_pipeline.teacher.stage import run_teacher_logits
    from csd_pipeline.teacher.store.codec import MAX_ABS_ERROR
    from csd_pipeline.teacher.store.reader import TeacherTopkOutput
    from tests.reliability.cases import tree
    from tests.teacher.test_stage import aligned_rows

    options = {"top_k": 3, "server_top_k": K, "tail_samples": 6}
    outputs = [tmp_path / "four", tmp_path / "one"]
    for output, concurrency in zip(outputs, (4, 1)):
        config = served_config(aligned, output, server[0], server_concurrency=concurrency, **options)
        assert run_teacher_logits(config, log=None).complete
    assert tree(outputs[0]) == tree(outputs[1])
    assert TeacherTopkOutput.open(outputs[0]).manifest["teacher"]["server_top_k"] == K
    other = _error_line(served_config(aligned, outputs[1], server[0], **{**options, "server_top_k": K - 1}))
    assert "server_top_k" in other, other  # the draws' reach is part of the run's identity
    checked = drawn = 0
    for index, (row, (_, _, ids)) in enumerate(zip(read_teacher_topk(outputs[0]), aligned_rows(aligned))):
        if index == REFERENCE_ROWS:
            break
        exact = reference(teacher_dir, index, ids)
        for t in range(len(ids) - 1):
            order = np.argsort(-exact[t])
            gaps = exact[t, order[[2, K - 1]]] - exact[t, order[[3, K]]]
            top3, observed = order[:3], int(ids[t + 1])
            tail = 1.0 - np.exp(exact[t, top3]).sum() - (0.0 if observed in top3 else np.exp(exact[t, observed]))
            if gaps.min() < 1e-3 or tail < 0.05:
                continue  # a near tie the server's float32 may order otherwise, or a tail its rounding dominates
            checked += 1
            n = int(row.lengths[t])
            assert set(top3) <= set(row.ids[t, :n].tolist())
            for token, value in zip(row.ids[t, :n], row.logprobs[t, :n]):
                if token in top3 or token == observed:
                    continue
                drawn += 1
                assert token in order[:K], (index, t, token)
                counts = np.exp(value - np.log(tail)) * 6
                assert abs(np.log(counts / round(counts))) <= MAX_ABS_ERROR + 0.02 and 1 <= round(counts) <= 6
    assert checked > 100 and drawn > 100, (checked, drawn)
