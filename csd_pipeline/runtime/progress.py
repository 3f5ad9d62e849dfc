"""Progress of the long steps (tables build, align, teacher-logits, training, evaluation).

One rule everywhere: a tqdm bar with its rate and ETA on stderr when stderr is a terminal; nothing at
all when it is not (a log file, a pipe, a batch job) or when the command runs with `--quiet`
(`set_quiet`). `CSD_PROGRESS=0` turns bars off, `CSD_PROGRESS=1` on even without a terminal.

- `bar(total, desc, unit)`: a bar for a loop in this process (a silent `NullBar` when bars are off).
- Stage runs: the executor wraps its shards in a `StageProgress` (the work of the pending shards:
  documents for align, rows for teacher-logits); a shard processor calls `advance(n)` as it goes,
  in the executor's process or in a worker process (through a shared counter the executor hands to
  its workers), so a bar moves during a shard, not only between shards.
- `StageProgress.wrap_log(log)`: log lines printed above the bar instead of through it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

ENV = "CSD_PROGRESS"
_FLUSH_SECONDS = 0.2

_quiet = False
_active = None  # the StageProgress of this process, while a stage runs here
_counter = None  # in a worker process: the executor's shared counter
_unflushed = 0
_flushed_at = 0.0


def set_quiet(quiet: bool = True) -> None:
    """Turn bars off (or back on) for this process: the `--quiet` flag of a command."""
    global _quiet
    _quiet = bool(quiet)


def enabled() -> bool:
    """Whether bars are shown: not quiet, and stderr is a terminal (or CSD_PROGRESS=1)."""
    forced = os.environ.get(ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1" and not _quiet
    return not _quiet and _isatty(sys.stderr)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class NullBar:
    """The bar when bars are off: every call does nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        pass

    def write(self, text: str, file=None) -> None:
        print(text, file=file or sys.stderr)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int | None, desc: str, unit: str = "it", *, initial: int = 0, leave: bool = True,
        unit_scale: bool = False):
    """A tqdm bar on stderr for `total` units, or a `NullBar` when bars are off (see `enabled`)."""
    if not enabled():
        return NullBar()
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        return NullBar()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, leave=leave,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


# ---------------------------------------------------------------------------------------------
# Stage runs: shards written here or in worker processes


def advance(n: int = 1) -> None:
    """Count `n` units of work done by the shard processor running in this process (no-op otherwise)."""
    global _unflushed, _flushed_at
    if _active is not None:
        _active.advance(n)
    elif _counter is not None:
        _unflushed += n
        now = time.monotonic()
        if now - _flushed_at >= _FLUSH_SECONDS:
            _flush_counter()
            _flushed_at = now


def _flush_counter() -> None:
    global _unflushed
    if _counter is not None and _unflushed:
        with _counter.get_lock():
            _counter.value += _unflushed
        _unflushed = 0


def use_counter(counter) -> None:
    """In a worker process: send `advance` to the executor's shared counter (`StageProgress.counter`)."""
    global _counter
    _counter = counter


def shard_finished() -> None:
    """In a worker process, after a shard: hand over the work not yet counted."""
    _flush_counter()


class StageProgress:
    """The bar of one rank's pending shards. `work(spec)` gives a shard's units (None: 1 per shard).

    Use as a context manager around the shards; call `shard_done(task)` after each shard. With
    worker processes, pass `counter` to them (see `use_counter`).
    """

    def __init__(self, stage: str, tasks: list, work: Callable[[dict], int] | None, unit: str, rank: int = 0):
        self._work = {task.name: int(work(task.spec)) if work else 1 for task in tasks}
        self.unit = unit if work else "shard"
        total = sum(self._work.values())
        self.bar = bar(total, f"{stage} (rank {rank})" if rank else stage, self.unit) if tasks else NullBar()
        self.total, self.done, self._shown, self._running = total, 0, 0, 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = None
        self.counter = None

    def __enter__(self) -> StageProgress:
        global _active
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = None
        self._stop.set()
        if self._poller is not None:
            self._poller.join()
        self.bar.close()

    def worker_counter(self):
        """A shared counter for worker processes (they `advance` it); polled into the bar every half second."""
        import multiprocessing

        self.counter = multiprocessing.get_context("spawn").Value("q", 0)
        if not isinstance(self.bar, NullBar):
            self._poller = threading.Thread(target=self._poll, daemon=True)
            self._poller.start()
        return self.counter

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            self._show(max(self.counter.value, self.done))

    def advance(self, n: int) -> None:
        self._running += n
        self._show(self.done + self._running)

    def shard_done(self, task) -> None:
        self.done += self._work.get(task.name, 0)
        self._running = 0
        self._show(max(self.done, self.counter.value if self.counter is not None else 0))

    def _show(self, value: int) -> None:
        with self._lock:
            value = min(value, self.total)
            if value > self._shown:
                self.bar.update(value - self._shown)
                self._shown = value

    def wrap_log(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, printing above the bar (the bar is cleared, the line printed, the bar redrawn)."""
        if isinstance(self.bar, NullBar):
            return log

        def printed_above(message: str) -> None:
            from tqdm import tqdm

            with tqdm.external_write_mode(file=sys.stderr):
                log(message)

        return printed_above
