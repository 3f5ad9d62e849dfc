"""What the chaos soak (bench/soak.py) reads on disk: where a command was when it was killed, what a
finished run left, and whether the soak's run equals the uninterrupted one.

Stage outputs are compared file by file (sha256; the per-rank `stats/` say who ran, not what was
written), training runs by the values `metrics.jsonl` and `eval.jsonl` log at every step (without the
timings) and by the bytes of `export/`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECORDS = ("run.json", "manifest.json")
INPUT_TIME_KEYS = {"mtime_ns", "manifest_sha256"}
TIMING_KEYS = {"tokens_per_s", "step_time_s", "data_wait_s", "elapsed_s", "eval_time_s", "seconds"}


def file_tree(folder: Path, skip_parts: tuple[str, ...] = ("stats",)) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path (files under a `skip_parts` folder left out)."""
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))
            if p.is_file() and not set(p.relative_to(folder).parts[:-1]) & set(skip_parts)}


def _without_input_times(value):
    if isinstance(value, dict):
        return {k: _without_input_times(v) for k, v in value.items() if k not in INPUT_TIME_KEYS}
    if isinstance(value, list):
        return [_without_input_times(v) for v in value]
    return value


def stage_tree(folder: Path) -> dict[str, str]:
    """`file_tree` of a stage output, its run record and manifest without the inputs' modification times.

    A stage records each input file's mtime (to notice a changed corpus); the rounds' align reads files
    that the round's generate wrote a moment before, so two runs differ there, and the teacher manifest
    records the sha256 of that aligned manifest. Every other byte, every shard's included, must be equal."""
    tree = file_tree(folder)
    for name in RECORDS:
        if name in tree:
            record = json.loads((folder / name).read_text(encoding="utf-8"))
            text = json.dumps(_without_input_times(record), sort_keys=True)
            tree[name] = hashlib.sha256(text.encode()).hexdigest()
    return tree


def logged_values(path: Path) -> dict[int, dict]:
    """The values each step logged in a `metrics.jsonl` / `eval.jsonl` (timings left out), by step."""
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        rows[record.get("step")] = {k: v for k, v in record.items() if k not in TIMING_KEYS}
    return rows


def leftovers(work: Path) -> list[str]:
    """Partial objects a later run could take for complete: `*.tmp` files or folders, failed exports."""
    return sorted(str(p.relative_to(work)) for p in work.rglob("*")
                  if p.name.endswith(".tmp") or p.name.endswith(".failed"))


def _stage_state(folder: Path) -> str:
    if (folder / "manifest.json").is_file():
        return "manifest written"
    try:
        tasks = len(json.loads((folder / "run.json").read_text(encoding="utf-8"))["tasks"])
    except (OSError, ValueError, KeyError, TypeError):
        return "starting (no run record yet)"
    done = len(list((folder / "done").glob("*.done")))
    temporary = [p.name for p in folder.rglob("*.tmp")]
    if done == tasks:
        where = f"all {tasks} shards complete, manifest not yet written"
    else:
        where = f"shard {done + 1} of {tasks}"
    if any(name.startswith("manifest.json") for name in temporary):
        where += ", writing the manifest"
    elif any(Path(name).suffixes[:1] == [".done"] for name in temporary):
        where += ", writing a completion record"
    elif temporary:
        where += ", writing a shard"
    return where


def _train_state(folder: Path) -> str:
    steps = logged_values(folder / "metrics.jsonl")
    checkpoints = folder / "checkpoints"
    complete = sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*")
                      if p.is_dir() and (p / "complete.json").is_file() and not p.name.endswith(".tmp"))
    writing = [p.name for p in checkpoints.glob("step-*.tmp")]
    where = f"step {max(steps) if steps else 0} logged"
    where += f", checkpoints {complete}" if complete else ", no checkpoint"
    if writing:
        where += f", writing checkpoint {writing[0][:-4]}"
    if (folder / "export" / "config.json").is_file():
        where += ", export written"
    elif any(folder.glob("export*.tmp")):
        where += ", writing the export"
    return where


def describe(kind: str, folder: Path) -> str:
    """Where a command writing `folder` stands, in words (read after it was killed)."""
    if kind == "tables":
        names = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
        return "tables: " + (", ".join(names) if names else "nothing written")
    if kind == "stage":
        return _stage_state(folder)
    if kind == "train":
        return _train_state(folder)
    rounds = sorted(folder.glob("round-*"), key=lambda p: int(p.name.split("-")[1]))
    if not rounds:
        return "rounds: nothing written"
    last = rounds[-1]
    for part in ("generated", "aligned", "teacher"):
        if not (last / part / "manifest.json").is_file():
            return f"{last.name}/{part}: {_stage_state(last / part)}"
    return f"{last.name}/train: {_train_state(last / 'train')}"


def progress_seen(kind: str, folder: Path) -> bool:
    """Whether a command has made visible progress (a shard complete, a step logged, a table written)."""
    if kind == "tables":
        return any(folder.glob("*.safetensors"))
    if kind == "stage":
        return any((folder / "done").glob("*.done"))
    if kind == "train":
        path = folder / "metrics.jsonl"
        return path.is_file() and path.stat().st_size > 0
    return any(folder.glob("round-1/generated/done/*.done"))


def compare(kind: str, reference: Path, soaked: Path) -> list[str]:
    """What differs between the reference's folder and the soak's (empty: identical)."""
    problems = []
    if kind == "train":
        for name in ("metrics.jsonl", "eval.jsonl"):
            want, got = logged_values(reference / name), logged_values(soaked / name)
            if not want and name == "metrics.jsonl":
                problems.append(f"{reference / name}: the reference logged nothing")
            bad = [step for step in sorted(set(want) | set(got), key=str) if want.get(step) != got.get(step)]
            if bad:
                problems.append(f"{soaked / name}: steps {bad[:8]} differ from the uninterrupted run")
        trees = [(file_tree(reference / "export"), file_tree(soaked / "export"), "export")]
    else:
        trees = [(stage_tree(reference), stage_tree(soaked), "")]
    for want, got, part in trees:
        if not want:
            problems.append(f"{reference / part}: the reference wrote nothing")
        for name in sorted(set(want) | set(got)):
            if want.get(name) != got.get(name):
                state = "missing" if name not in got else "extra" if name not in want else "other bytes"
                problems.append(f"{soaked / part / name}: {state}")
    return problems
