"""teacher-logits --teacher-server against a real server started here: llama-cpp-python's OpenAI-compatible server
(`python -m llama_cpp.server --logits_all true`) on the Gemma 3 GGUF of the fixtures, on 127.0.0.1.

That server (llama-cpp-python 0.3.36, the version the fixtures pin) cannot be the teacher of a store: its
completions request takes a prompt only as text (`prompt: str | list[str]`, llama_cpp/server/types.py), so it
would tokenise the window its own way, and it keys the top entries by their text (with byte-fallback tokens and
control tokens sharing a text), so ids cannot be recovered exactly. What these tests check on it is everything
around that: a server that refuses the token-id request, one that does not answer in time, one that is gone,
and one that does not serve the named model are each one `error:` line naming the server and the fix, and
nothing of the output is kept (no shard, no marker, no manifest).

One server per module; the aligned rows are a few short Gemma 3 windows. Needs `csd-pipeline fixtures
--served-teacher` (the wheel built from the pinned sdist).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.cases import assert_one_line_error, run

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL_NAME = "gemma3"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, seconds: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"llama_cpp.server exited with {process.returncode} before answering", pytrace=False)
        try:
            if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"llama_cpp.server did not answer at {url} within {seconds:.0f} s", pytrace=False)


@pytest.fixture(scope="module")
def server(fixtures_dir, tmp_path_factory):
    """(url, process) of llama-cpp-python's server on the Gemma 3 GGUF, one thread, up for the module."""
    from csd_pipeline.fixtures.models import GEMMA3
    from csd_pipeline.fixtures.server_wheel import server_installed

    if not server_installed():
        pytest.fail("llama-cpp-python's server is not installed; run `csd-pipeline fixtures --served-teacher`.",
                    pytrace=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(fixtures_dir / "gguf" / GEMMA3.gguf),
               "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--logits_all", "true",
               "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_up(url, process)
        yield url, process
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


@pytest.fixture(scope="module")
def aligned(tmp_path_factory, tokenizer_path, tables_for) -> Path:
    """A few short windows of real text, Gemma 3 teacher ids (gpt-2 student)."""
    from csd_pipeline.align.stage import AlignConfig, run_align

    out = tmp_path_factory.mktemp("aligned")
    config = AlignConfig(corpus=[str(DATA / "kjv-genesis-slice.txt")], student_tokenizer=str(tokenizer_path("gpt-2")),
                         teacher_tokenizers=[str(tokenizer_path("gemma3"))], output=str(out), max_student_tokens=16,
                         split_on_blank_lines=True, tables=[tables_for("gpt-2", "gemma3")])
    run_align(config, rank=0, world_size=1, log=None)
    return out


def teacher_logits(aligned: Path, output: Path, url: str, *extra) -> subprocess.CompletedProcess:
    return run("cli.main", "teacher-logits", "--aligned", aligned, "--output", output, "--teacher-server", url,
               "--teacher-model", MODEL_NAME, "--top-k", "8", "--quiet", *extra, timeout=120)


def nothing_kept(output: Path) -> bool:
    """No shard, completion marker or manifest: what a re-run would trust."""
    return not any(output.rglob("*.parquet")) and not any(output.rglob("*.done")) and not (output / "manifest.json").exists()


def test_a_server_that_takes_no_token_ids_is_one_error_line_and_nothing_is_kept(server, aligned, tmp_path):
    url, _ = server
    result = teacher_logits(aligned, tmp_path / "out", url)
    # llama-cpp-python answers HTTP 500 with pydantic's "Input should be a valid string" for each id
    assert_one_line_error(result, f"teacher server {url} answered POST /v1/completions with HTTP 500",
                          "Input should be a valid string", "must take a token-id prompt")
    assert nothing_kept(tmp_path / "out")


def test_a_server_that_does_not_answer_in_time_is_one_error_line(server, aligned, tmp_path):
    url, process = server
    os.killpg(process.pid, signal.SIGSTOP)  # up, connections accepted, no answer
    try:
        result = teacher_logits(aligned, tmp_path / "out", url, "--server-timeout", "2")
    finally:
        os.killpg(process.pid, signal.SIGCONT)
    assert_one_line_error(result, f"teacher server {url} did not answer within --server-timeout 2 s",
                          "re-run to resume")
    assert nothing_kept(tmp_path / "out")


def test_a_server_that_is_gone_is_one_error_line(aligned, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = teacher_logits(aligned, tmp_path / "out", url)
    assert_one_line_error(result, f"teacher server {url} cannot be reached", "start it")
    assert nothing_kept(tmp_path / "out")


def test_a_model_the_server_does_not_serve_is_one_error_line(server, aligned, tmp_path):
    url, _ = server
    result = run("cli.main", "teacher-logits", "--aligned", aligned, "--output", tmp_path / "out", "--teacher-server",
                 url, "--teacher-model", "llama-70b", "--quiet", timeout=120)
    assert_one_line_error(result, f"teacher server {url} serves {MODEL_NAME}, not --teacher-model llama-70b")
    assert nothing_kept(tmp_path / "out")
