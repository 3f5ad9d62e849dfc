"""What a stage output directory records about its run, and the manifest written from it.

    DIR/run.json                  the run: stage, schema version, identity, extra manifest keys and
                                  every shard's task; written before any shard, checked on re-runs
    DIR/done/<name>.done          one shard's completion marker (rows, bytes, sha256, stats),
                                  written after the shard file
    DIR/stats/rank-RRRRR.json     one rank's stats, summed over its shards
    DIR/manifest.json             written last, once every shard of every rank is complete

`check_identity` refuses a directory that holds another run; `stage_status` says what is missing;
`finalize` writes the manifest (any rank may, with the same bytes). The executor
(`runtime/executor.py`) is the only writer of these files.
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import atomic_path, atomic_write_json, json_bytes, strict_json
from csd_pipeline.runtime.manifest import MANIFEST_NAME, MANIFEST_VERSION
from csd_pipeline.runtime.storage import location

RUN_NAME = "run.json"
RUN_VERSION = 1
RESERVED_KEYS = {"manifest_version", "stage", "schema_version", "shards", "totals"}


# ---------------------------------------------------------------------------------------------
# run.json


def run_record(stage: str, schema_version: int, identity: dict, extra: dict, suffix: str, tasks: list) -> dict:
    """The `run.json` content of a run (`tasks`: `ShardTask`s in index order)."""
    for key in [*identity, *extra]:
        if key in RESERVED_KEYS:
            raise ValueError(f"manifest key {key!r} of stage {stage} is reserved by the manifest format")
    return {
        "run_version": RUN_VERSION,
        "stage": stage,
        "schema_version": schema_version,
        "identity": identity,
        "extra": extra,
        "suffix": suffix,
        "tasks": [task.to_json() for task in tasks],
    }


def _differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Keys whose values differ, one level into nested dicts (`config.max_student_tokens`)."""
    keys = []
    for key in sorted(set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if left == right:
            continue
        if isinstance(left, dict) and isinstance(right, dict) and not prefix:
            keys += _differing_keys(left, right, f"{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def check_identity(directory, stage: str, identity: dict) -> None:
    """Raise `CsdError` when `directory` holds the output (manifest) or the run record of another run:
    a different stage, or identity values (config, inputs, fingerprints) that differ from `identity`."""
    out = location(directory)
    for path, kind in ((out / MANIFEST_NAME, "manifest"), (out / RUN_NAME, "run")):
        if not path.is_file():
            continue
        try:
            found = strict_json(path.read_bytes())
        except (OSError, ValueError):
            found = None
        if not isinstance(found, dict):
            raise CsdError(f"{path} is unreadable; delete {out} (or pass a new --output) and run the stage again.")
        recorded = found.get("identity", {}) if kind == "run" else {key: found.get(key) for key in identity}
        differ = _differing_keys(recorded, identity)
        if found.get("stage") != stage or differ:
            raise CsdError(
                f"{out} already holds the output of another {found.get('stage', 'unknown')} run "
                f"(its {', '.join(differ) or 'stage'} differ from this run's); pass a new --output or delete {out}."
            )


def read_run_record(directory) -> dict:
    """Read `DIR/run.json`. Raises `CsdError` when the directory holds no run."""
    path = location(directory) / RUN_NAME
    if not path.is_file():
        raise CsdError(f"{directory} holds no stage run ({RUN_NAME} is missing); check the path or start the stage.")
    try:
        record = strict_json(path.read_bytes())
    except (OSError, ValueError) as err:
        raise CsdError(f"{path} is unreadable ({err}); delete {directory} and run the stage again.") from None
    tasks = record.get("tasks") if isinstance(record, dict) else None
    if not isinstance(tasks, list) or not all(
            isinstance(t, dict) and type(t.get("index")) is int and isinstance(t.get("name"), str)
            and isinstance(t.get("spec"), dict) for t in tasks):
        raise CsdError(f"{path} is malformed (not a run record with a task list); delete {directory} and run the "
                       "stage again.")
    return record


def recorded_tasks(directory) -> list[dict] | None:
    """The task list (JSON) of the run recorded in `directory`, or None when none is recorded."""
    if not (location(directory) / RUN_NAME).is_file():
        return None
    return read_run_record(directory)["tasks"]


def record_run(directory, record: dict) -> None:
    """Write `record` as `DIR/run.json`, or check that the recorded run is the same one.

    Raises `CsdError` when the recorded run came from another version or setting of the stage.
    """
    out = location(directory)
    if not (out / RUN_NAME).is_file():
        atomic_write_json(out / RUN_NAME, record)
        return
    existing = read_run_record(out)
    differ = [key for key in record if existing.get(key) != record[key]]
    if differ:
        raise CsdError(
            f"{out} was started by another version or setting of the {record['stage']} stage (its {', '.join(differ)} "
            f"differ); use a new --output or delete {out}."
        )


# ---------------------------------------------------------------------------------------------
# Markers and stats


def marker_path(directory, name: str) -> Path:
    """Where the completion marker of shard `name` lives."""
    return location(directory) / "done" / f"{name}.done"


def read_marker(directory, name: str, suffix: str) -> dict | None:
    """The completion marker of shard `name` if it exists and its shard file has the recorded size."""
    path = marker_path(directory, name)
    if not path.is_file():
        return None
    try:
        marker = strict_json(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not _well_formed_marker(marker, name, suffix):
        return None  # a damaged record: the shard is written again, as if it had none
    shard = location(directory) / f"{name}{suffix}"
    if not shard.is_file() or shard.stat().st_size != marker.get("bytes"):
        return None
    return marker


def _counts(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(key, str) and _counts(part) for key, part in value.items())
    return type(value) in (int, float) and value == value and abs(value) != float("inf")


def _well_formed_marker(marker, name: str, suffix: str) -> bool:
    """A completion record names its shard and has its counts: what `build_manifest` and `merge_stats` read."""
    return (isinstance(marker, dict) and marker.get("name") == name and marker.get("file") == f"{name}{suffix}"
            and all(type(marker.get(key)) is int and marker[key] >= 0 for key in ("index", "rows", "bytes"))
            and isinstance(marker.get("sha256"), str) and isinstance(marker.get("stats"), dict)
            and _counts(marker["stats"]))


def merge_stats(total: dict, part: dict) -> dict:
    """Add the nested counters of `part` into `total` (in place) and return `total`."""
    for key, value in part.items():
        if isinstance(value, dict):
            merge_stats(total.setdefault(key, {}), value)
        else:
            total[key] = total.get(key, 0) + value
    return total


def sorted_stats(stats: dict) -> dict:
    """`stats` with its keys sorted at every level (so its JSON does not depend on insertion order)."""
    return {k: sorted_stats(v) if isinstance(v, dict) else v for k, v in sorted(stats.items())}


def write_rank_stats(directory, record: dict, rank: int, world_size: int) -> None:
    """Write `DIR/stats/rank-RRRRR.json` if every shard of this rank is complete."""
    mine = record["tasks"][rank::world_size]
    markers = [read_marker(directory, t["name"], record["suffix"]) for t in mine]
    if any(m is None for m in markers):
        return
    stats: dict = {}
    for marker in markers:
        merge_stats(stats, marker["stats"])
    atomic_write_json(location(directory) / "stats" / f"rank-{rank:05d}.json", {
        "rank": rank,
        "world_size": world_size,
        "shards": [m["name"] for m in markers],
        "rows": sum(m["rows"] for m in markers),
        "bytes": sum(m["bytes"] for m in markers),
        "stats": sorted_stats(stats),
    })


# ---------------------------------------------------------------------------------------------
# Status and manifest


def stage_status(directory) -> dict:
    """Which shards of the run in `directory` are complete.

    Returns {"stage", "complete" (manifest present), "shards_total", "shards_done", "missing"
    (names), "tasks": [{"name", "done", "rows"}]}. Raises `CsdError` when `directory` holds no run.
    """
    out = location(directory)
    record = read_run_record(out)
    tasks = []
    for task in record["tasks"]:
        marker = read_marker(out, task["name"], record["suffix"])
        tasks.append({"name": task["name"], "done": marker is not None, "rows": marker["rows"] if marker else None})
    missing = [t["name"] for t in tasks if not t["done"]]
    return {
        "directory": str(out),
        "stage": record["stage"],
        "complete": (out / MANIFEST_NAME).is_file(),
        "shards_total": len(tasks),
        "shards_done": len(tasks) - len(missing),
        "missing": missing,
        "tasks": tasks,
    }


def build_manifest(record: dict, markers: list[dict]) -> dict:
    """The manifest of a run record whose shards are all complete (`markers` in task order)."""
    stats: dict = {}
    for marker in markers:
        merge_stats(stats, marker["stats"])
    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "stage": record["stage"],
        "schema_version": record["schema_version"],
        "shards": [{key: m[key] for key in ("name", "file", "rows", "bytes", "sha256")} for m in markers],
        "totals": {
            "shards": len(markers),
            "rows": sum(m["rows"] for m in markers),
            "bytes": sum(m["bytes"] for m in markers),
            "stats": sorted_stats(stats),
        },
    }
    manifest.update(record["identity"])
    manifest.update(record["extra"])
    return manifest


def finalize(directory, log=None) -> dict | None:
    """Write `DIR/manifest.json` if every shard of the recorded run is complete.

    Returns the manifest, or None (and logs what is missing) when shards are missing.
    Safe to call from several ranks at once: they write the same bytes through atomic renames.
    """
    log = log or (lambda message: None)
    out = location(directory)
    record = read_run_record(out)
    markers = [read_marker(out, t["name"], record["suffix"]) for t in record["tasks"]]
    missing = [t["name"] for t, m in zip(record["tasks"], markers, strict=True) if m is None]
    if missing:
        log(f"{out}: {len(missing)} of {len(markers)} shards not complete yet (first: {missing[0]}); "
            "no manifest written.")
        return None
    manifest = build_manifest(record, markers)
    data = json_bytes(manifest)
    path = out / MANIFEST_NAME
    if not path.is_file() or path.read_bytes() != data:
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
            _maybe_crash_manifest()
        log(f"{out}: all {len(markers)} shards complete; wrote {MANIFEST_NAME}.")
    return manifest


def _maybe_crash_manifest() -> None:
    # Test hook (bench/soak.py): CSD_TEST_CRASH="manifest_written" SIGKILLs this process once the manifest's
    # temporary file is written, before its rename.
    import os

    if os.environ.get("CSD_TEST_CRASH") == "manifest_written":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
