"""Temporary files left by a killed writer, removed when the stage runs again.

Atomic writes go through `<name>.<host>.<pid>.tmp` and a rename (csd_pipeline/runtime/executor.py).
A `kill -9` between the two leaves the temporary file behind: a shard, a marker in `done/`, a
table, `stats/`, the manifest. A re-run removes those written on this host by a process that no
longer exists; a file of another host, or of a live process (another rank finishing its manifest),
is left alone.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    try:  # Linux: the state is the field after the parenthesised command name
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def remove_dead_writers_tmp(directory, name: str = "*", recursive: bool = True) -> list[Path]:
    """Remove every `<name>.<this host>.<pid>.tmp` file of a dead process under `directory` (`recursive`) or in
    it; returns them. `name`: a glob of the committed file's name (default: any)."""
    host = socket.gethostname()
    removed = []
    found = Path(directory).rglob if recursive else Path(directory).glob
    for path in found(f"{name}.{host}.*.tmp"):
        stem, _, pid = path.name[: -len(".tmp")].rpartition(".")
        if not (stem.endswith(f".{host}") and pid.isdigit() and path.is_file()) or _alive(int(pid)):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed
