"""Stage manifests: the one file that says a stage output directory is complete.

A stage writes `DIR/manifest.json` last (see `csd_pipeline.runtime.executor`). Readers start here and
never glob the directory: the manifest lists the shards in order with their rows, bytes and
sha256, the stage name and schema version, the resolved config, the inputs and their
fingerprints, and the totals (rows, stats such as rejections by reason).

Layout of a manifest (JSON object, keys sorted when written):

    manifest_version   int, this module's format (MANIFEST_VERSION)
    stage              "align", "teacher-logits", ...
    schema_version     the version of the stage's Arrow schema (schemas/)
    <identity keys>    stage-defined, e.g. "config", "inputs", "tokenizers": what a re-run must match
    <extra keys>       stage-defined, e.g. "tables"
    shards             [{"name", "file", "rows", "bytes", "sha256"}], in shard-index order
    totals             {"shards", "rows", "bytes", "stats"}
"""

from __future__ import annotations

from pathlib import Path

from csd_pipeline.errors import ManifestError
from csd_pipeline.runtime.files import strict_json
from csd_pipeline.runtime.storage import location

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

# Which command produces each stage's output, so errors can say what to re-run.
STAGE_COMMANDS = {
    "align": "csd-pipeline align",
    "teacher-logits": "csd-pipeline teacher-logits",
}


def _rerun_hint(stage: str | None) -> str:
    command = STAGE_COMMANDS.get(stage if isinstance(stage, str) else "", "the stage that produced it")
    return f"re-run {command}"


def read_manifest(directory, *, stage: str | None = None, schema_versions=None) -> dict:
    """Read and check `directory/manifest.json`.

    `stage`: the stage the caller expects (e.g. "align"); `schema_versions`: the schema versions
    the caller can read (an iterable of ints; None accepts any).
    Returns the manifest as a dict. Raises `ManifestError` (one sentence naming the directory and
    the stage to re-run) when the directory or manifest is missing, unreadable, from another stage
    or of an unknown version, and `CsdError` when a file it names lies outside the directory.
    """
    directory = location(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory; pass the output directory of {_rerun_hint(stage)[7:]}.")
    if not path.is_file():
        raise ManifestError(
            f"{directory} has no {MANIFEST_NAME}, so it is not a complete stage output; "
            f"run `csd-pipeline status {directory}` to see what is missing, or {_rerun_hint(stage)}."
        )
    try:
        manifest = strict_json(path.read_bytes())
    except (OSError, ValueError) as err:
        raise ManifestError(f"{path} is not a readable JSON manifest ({err}); {_rerun_hint(stage)}.") from None
    if not isinstance(manifest, dict) or "manifest_version" not in manifest:
        raise ManifestError(f"{path} is not a csd-pipeline manifest; {_rerun_hint(stage)}.")
    if manifest["manifest_version"] != MANIFEST_VERSION:
        raise ManifestError(
            f"{path} has manifest version {manifest['manifest_version']!r} but this csd-pipeline reads "
            f"version {MANIFEST_VERSION}; {_rerun_hint(manifest.get('stage'))} with this version."
        )
    if stage is not None and manifest.get("stage") != stage:
        raise ManifestError(
            f"{directory} is the output of stage {manifest.get('stage')!r}, not {stage!r}; "
            f"pass the output directory of {STAGE_COMMANDS.get(stage, stage)}."
        )
    if schema_versions is not None and manifest.get("schema_version") not in list(schema_versions):
        raise ManifestError(
            f"{directory} has {manifest.get('stage')} schema version {manifest.get('schema_version')!r}, "
            f"which this csd-pipeline cannot read (it reads {sorted(set(schema_versions))}); "
            f"{_rerun_hint(manifest.get('stage'))}."
        )
    from csd_pipeline.runtime.safe_paths import check_manifest_paths

    _check_shape(manifest, path)
    check_manifest_paths(manifest, directory, f"{_rerun_hint(manifest.get('stage'))} into a new --output")
    for index, shard in enumerate(manifest["shards"]):  # after the paths: an edited path is named as such
        if Path(shard["file"]).stem != shard["name"]:
            raise ManifestError(f"{path} is malformed (shard {index} is named {shard['name']!r} but its file is "
                                f"{shard['file']!r}); {_rerun_hint(manifest.get('stage'))}.")
    return manifest


_SHARD_KEYS = {"name": str, "file": str, "rows": int, "bytes": int, "sha256": str}


def _check_shape(manifest: dict, path: Path) -> None:
    """Raise `ManifestError` unless the keys every reader takes from a manifest have their types."""
    def refuse(what: str):
        raise ManifestError(f"{path} is malformed ({what}); {_rerun_hint(manifest.get('stage'))}.")

    shards = manifest.get("shards")
    if not isinstance(shards, list):
        refuse("its shards are not a list")
    for index, shard in enumerate(shards):
        if not isinstance(shard, dict):
            refuse(f"shard {index} is not an object")
        for key, kind in _SHARD_KEYS.items():
            value = shard.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
                refuse(f"shard {index} has {key} {value!r}, not a {'count' if kind is int else 'string'}")
    for key in ("config", "totals"):
        if not isinstance(manifest.get(key, {}), dict):
            refuse(f"its {key} is not an object")
    if not isinstance(manifest.get("tables", []), list):
        refuse("its tables are not a list")


def shard_paths(manifest: dict, directory) -> list[Path]:
    """The shard files listed by `manifest`, in shard order, as paths inside `directory`."""
    directory = location(directory)
    return [directory / shard["file"] for shard in manifest["shards"]]


def require_fingerprint(manifest: dict, directory, what: str, recorded: str | None, expected: str) -> None:
    """Raise `ManifestError` when a fingerprint recorded in a manifest differs from the expected one.

    `what` names the thing in the error ("teacher tokenizer 0", "student tokenizer", ...);
    `recorded` is the value found in the manifest, `expected` the fingerprint of what the caller was
    given.
    """
    if recorded != expected:
        raise ManifestError(
            f"the {what} given does not match the one {directory} was made with "
            f"(fingerprint {str(recorded)[:12]} in its manifest, {expected[:12]} given); pass the same "
            f"{what} or {_rerun_hint(manifest.get('stage'))} with this one."
        )


def verify_shards(manifest: dict, directory, *, check_hash: bool = False) -> list[str]:
    """Check that every shard listed in `manifest` exists with its recorded size (and sha256).

    Returns a list of problems, one sentence each (empty when all is well).
    """
    from csd_pipeline.runtime.files import file_sha256

    problems = []
    for shard, path in zip(manifest["shards"], shard_paths(manifest, directory), strict=True):
        if not path.is_file():
            problems.append(f"shard {shard['file']} is missing")
            continue
        size = path.stat().st_size
        if size != shard["bytes"]:
            problems.append(f"shard {shard['file']} has {size} bytes, the manifest says {shard['bytes']}")
            continue
        if check_hash and file_sha256(path) != shard["sha256"]:
            problems.append(f"shard {shard['file']} does not have the sha256 the manifest records")
    return problems
