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

import json
from pathlib import Path

from csd_pipeline.errors import ManifestError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1

# Which command produces each stage's output, so errors can say what to re-run.
STAGE_COMMANDS = {
    "align": "csd-pipeline align",
    "teacher-logits": "csd-pipeline teacher-logits",
}


def _rerun_hint(stage: str | None) -> str:
    command = STAGE_COMMANDS.get(stage or "", "the stage that produced it")
    return f"re-run {command}"


def read_manifest(directory, *, stage: str | None = None, schema_versions=None) -> dict:
    """Read and check `directory/manifest.json`.

    `stage`: the stage the caller expects (e.g. "align"); `schema_versions`: the schema versions
    the caller can read (an iterable of ints; None accepts any).
    Returns the manifest as a dict. Raises `ManifestError` (one sentence naming the directory and
    the stage to re-run) when the directory or manifest is missing, unreadable, from another stage
    or of an unknown version.
    """
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory; pass the output directory of {_rerun_hint(stage)[7:]}.")
    if not path.is_file():
        raise ManifestError(
            f"{directory} has no {MANIFEST_NAME}, so it is not a complete stage output; "
            f"run `csd-pipeline status {directory}` to see what is missing, or {_rerun_hint(stage)}."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
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
    if schema_versions is not None and manifest.get("schema_version") not in set(schema_versions):
        raise ManifestError(
            f"{directory} has {manifest.get('stage')} schema version {manifest.get('schema_version')!r}, "
            f"which this csd-pipeline cannot read (it reads {sorted(set(schema_versions))}); "
            f"{_rerun_hint(manifest.get('stage'))}."
        )
    return manifest


def shard_paths(manifest: dict, directory) -> list[Path]:
    """The shard files listed by `manifest`, in shard order, as paths inside `directory`."""
    directory = Path(directory)
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
