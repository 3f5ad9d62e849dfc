"""Shared helpers of the reliability tests (tests/reliability/test_*.py): the commands as a user runs
them, one-line error checks, output trees, and small file systems that fill up or are read-only.

The file systems are tmpfs mounts (the tests run as root in CI); where mounting is not allowed the
tests that need one are skipped, saying why. Root ignores permission bits, so a read-only folder
is a tmpfs remounted read-only, not a chmod.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parents[1] / "data"
CORPUS = DATA / "devil-slice.txt"  # 6000 bytes: three aligned shards of 2000 bytes
PAGE = 4096


def run(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m <args>` from the repository root, this checkout's code first on the path."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, env=environment, capture_output=True,
                          text=True, timeout=timeout)


def pair_tables() -> list[str]:
    """The llama-spm/smollm2 tables, built once and cached next to the fixtures (tests/csd_cases.py)."""
    from csd_pipeline.fixtures.names import tokenizer_path
    from tests.csd_cases import bundle, cached_table_file

    student, teacher = bundle(tokenizer_path, "llama-spm"), bundle(tokenizer_path, "smollm2")
    return [cached_table_file(student, teacher), cached_table_file(teacher, student)]


def align_args(output, *extra) -> list[str]:
    """`csd-pipeline align` of the devil slice (llama-spm student, smollm2 teacher, 3 shards), with the cached
    tables unless `extra` gives its own (a table build would add seconds to every process)."""
    tables = [] if "--tables" in extra else ["--tables", *pair_tables()]
    return ["cli.main", "align", "--corpus", "tests/data/devil-slice.txt", "--student-tokenizer", "llama-spm",
            "--teacher-tokenizer", "smollm2", "--output", str(output), "--split-on-blank-lines",
            "--shard-mb", str(2000 / (1 << 20)), "--max-student-tokens", "128", "--quiet", *tables,
            *map(str, extra)]


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The command failed with exactly one `error:` line on stderr holding every fragment; returns it."""
    err = result.stderr.strip()
    assert result.returncode not in (0, -9), (result.returncode, err)
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: "), err
    for fragment in fragments:
        assert fragment in err, err
    return err


def tree(directory: Path) -> dict[str, str]:
    """sha256 of every file of a stage output except per-rank stats (which say who ran)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.parent.name != "stats"}


def pages(size: int) -> int:
    """Bytes a file of `size` bytes takes on a tmpfs (whole pages)."""
    return -(-size // PAGE) * PAGE


@contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False):
    """A tmpfs of `size` mounted at `path` (read-only when asked), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} ({mounted.stderr.strip() or 'mount failed'}): the disk-full and "
                    "read-only tests need root and mount")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize(path: Path, size: str) -> None:
    """Grow (or shrink) a mounted tmpfs: frees space without touching its files."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def fill(path: Path, leave: int) -> Path:
    """Write a filler file so that about `leave` bytes stay free on the file system of `path`."""
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    filler = path / "filler.bin"
    with open(filler, "wb") as handle:
        handle.write(b"\0" * max(0, free - leave))
    return filler
