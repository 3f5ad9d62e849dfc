"""Processes the tools start end with the process that started them.

Issue 35, item 3. A parent killed with SIGKILL runs no clean-up, so its helpers are told by the kernel instead: on Linux
`prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the kernel kill a child as soon as the thread that started it
ends. Elsewhere a daemon thread polls the parent's pid twice a second. Either way a child that finds its
parent already gone (it died between the fork and the call) ends at once.

Used by the data-loader workers of csd-train (`trainer/loader.py`), align's shard workers
(`csd_pipeline/runtime/executor.py`) and the csd-train that `csd-pipeline rounds` starts.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5


def _prctl():
    """libc's `prctl`, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def _watch_parent(parent_pid: int) -> None:
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent watch", daemon=True).start()


def end_with_parent(parent_pid: int) -> None:
    """Called in a child: be killed when `parent_pid` (the process that started this one) ends."""
    prctl = _prctl()
    if prctl is None:
        _watch_parent(parent_pid)
    elif prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def popen_options() -> dict:
    """`subprocess.Popen` keyword arguments that make the child end with this process (call from the thread
    that starts the child and outlives it, e.g. the main thread)."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return {}

    def before_exec() -> None:  # in the child, between fork and exec: nothing here may take a lock
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return {"preexec_fn": before_exec}
