"""Load a causal LM (teacher or student) from a local HF folder, a GGUF file or a hub name.

Also: the device and dtype policy (CPU: float32; GPU: bfloat16 unless asked otherwise), and the
model fingerprint recorded in manifests (sha256 of config.json and every weight file; hashes of
big files are cached by path, size and modification time). Remote code is never trusted unless
the caller passes `trust_remote_code=True` (the `--trust-remote-code` flag).
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import atomic_write_text, bytes_sha256, file_sha256

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
TRAINING_DTYPES = ("auto", "float32", "bfloat16")  # csd-train's parameter dtypes (float16 would need loss scaling)
DEVICES = ("auto", "cpu", "cuda")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
CONFIG_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
HASH_CACHE_ENV = "CSD_HASH_CACHE"
# A hub repository id: "name" or "owner/name" (anything else that does not exist is a bad path).
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


@dataclass
class LoadedModel:
    """A loaded causal LM and what identifies it.

    - `model`: the transformers model, on `device`, in `dtype` (not switched to eval or train).
    - `source`: what the user passed; `path`: the local folder it was loaded from; `gguf_file`: the
      GGUF file name inside `path` when it came from one.
    - `fingerprint`: {"sha256": combined, "files": {name: sha256}} over config and weight files.
    - `output_size`: rows of the output layer (logits per position), padded rows included.
    """

    model: object
    source: str
    path: Path
    gguf_file: str | None
    fingerprint: dict
    dtype: object
    device: object
    output_size: int


def resolve_device(device: str = "auto"):
    """`auto` -> the CUDA device of this rank (LOCAL_RANK) when CUDA is available, else CPU.

    Raises CsdError for an unknown name or `cuda` without CUDA.
    """
    import torch

    name = (device or "auto").lower()
    base = name.split(":")[0]
    if base not in DEVICES:
        raise CsdError(f"unknown --device {device!r}; use one of {', '.join(DEVICES)} (or cuda:N).")
    if base == "auto":
        base = "cuda" if torch.cuda.is_available() else "cpu"
    if base == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CsdError(f"--device {device} was asked for but this torch has no CUDA device; use --device cpu.")
    if ":" in name:
        return torch.device(name)
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def resolve_dtype(dtype: str, device):
    """`auto` -> float32 on CPU, bfloat16 on GPU; otherwise the named torch dtype.

    Raises CsdError for an unknown name.
    """
    import torch

    name = (dtype or "auto").lower()
    if name not in DTYPES:
        raise CsdError(f"unknown --dtype {dtype!r}; use one of {', '.join(DTYPES)}.")
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


# ---------------------------------------------------------------------------------------------
# Fingerprints


def _hash_cache_dir() -> Path:
    configured = os.environ.get(HASH_CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "csd-pipeline" / "file-hashes"


def file_sha256_cached(path) -> str:
    """sha256 of a file; remembered by (absolute path, size, mtime) so a re-run does not re-hash.

    The cache lives in `~/.cache/csd-pipeline/file-hashes` (env CSD_HASH_CACHE); a cache that
    cannot be written is simply not used.
    """
    path = Path(path).resolve()
    stat = path.stat()
    key = bytes_sha256(str(path).encode("utf-8"))
    cache_file = _hash_cache_dir() / f"{key}.json"
    stamp = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        cached = json.loads(cache_file.read_text(encoding="utf-8"))
        if {k: cached.get(k) for k in stamp} == stamp and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    value = file_sha256(path)
    try:
        atomic_write_text(cache_file, json.dumps({**stamp, "sha256": value}))
    except OSError:
        pass
    return value


def model_files(path: Path, gguf_file: str | None = None) -> list[Path]:
    """The files that define a model: config/index JSON and weight files (sorted), or the GGUF file."""
    if gguf_file is not None:
        return [path / gguf_file]
    files = [path / name for name in CONFIG_FILES if (path / name).is_file()]
    files += sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return files


def model_fingerprint(path, gguf_file: str | None = None) -> dict:
    """{"sha256": combined hash, "files": {name: sha256}} of a model folder (or one GGUF file in it).

    Raises CsdError when the folder holds no weight file.
    """
    path = Path(path)
    files = model_files(path, gguf_file)
    if not any(f.suffix in WEIGHT_SUFFIXES for f in files):
        raise CsdError(f"model {path} holds no weight file ({', '.join(WEIGHT_SUFFIXES)}); pass a model folder, "
                       "a GGUF file or a hub name.")
    hashes = {f.name: file_sha256_cached(f) for f in files}
    combined = bytes_sha256("".join(f"{name}\0{value}\n" for name, value in hashes.items()).encode("utf-8"))
    return {"sha256": combined, "files": hashes}


# ---------------------------------------------------------------------------------------------
# Loading


def resolve_model_source(arg: str, *, trust_remote_code: bool = False) -> tuple[Path, str | None]:
    """(local folder, GGUF file name or None) for a model argument.

    `arg`: a fixture model name, a local HF folder, a `.gguf` file (or a folder holding exactly one
    and no config.json), or a hub name (downloaded with huggingface_hub; needs a network).
    Raises CsdError when nothing usable is found, or `arg` is an object-store URL (copy it locally).
    """
    from csd_pipeline.runtime.storage import refuse_url

    refuse_url(arg, "model")
    try:
        from csd_pipeline.fixtures.names import resolve_model_arg

        arg = resolve_model_arg(str(arg))
    except ImportError:  # fixtures module not present in a stripped install
        arg = str(arg)
    path = Path(arg).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CsdError(f"model {arg}: a file must be a .gguf model; pass a Hugging Face model folder or a GGUF file.")
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        raise CsdError(f"model {arg}: the folder has no config.json" + (f" and {len(ggufs)} GGUF files" if ggufs else "")
                       + "; pass a Hugging Face model folder or one GGUF file.")
    if not _HUB_NAME.fullmatch(arg) or arg.endswith(".gguf"):
        raise CsdError(f"model {arg}: no such file or folder; check the path.")
    return _from_hub(arg, trust_remote_code), None


def _from_hub(name: str, trust_remote_code: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CsdError(f"model {name}: not a local path, and huggingface_hub is not installed to fetch it.") from None
    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    if trust_remote_code:
        patterns.append("*.py")
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as err:  # hub errors come in many classes (offline, gated, missing repo)
        first = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise CsdError(f"model {name}: not a local path and it could not be fetched from the hub ({first}); "
                       "pass a local folder or GGUF file, or check the name and network.") from None


def output_size_of(model) -> int:
    """Number of logits per position: rows of the output embedding, else config.vocab_size."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    size = getattr(model.config, "vocab_size", None)
    if size is None:
        raise CsdError(f"model {getattr(model.config, '_name_or_path', '?')}: cannot tell its output size "
                       "(no output embedding, no vocab_size in its config).")
    return int(size)


def load_causal_lm(arg: str, *, dtype: str = "auto", device: str = "auto",
                   trust_remote_code: bool = False) -> LoadedModel:
    """Load a causal LM with its fingerprint.

    arg: see `resolve_model_source`. dtype: auto|float32|bfloat16|float16|float64 (auto: float32 on
    CPU, bfloat16 on GPU). device: auto|cpu|cuda|cuda:N. Returns a `LoadedModel`.
    Raises CsdError when the model cannot be found or loaded, ImportError naming a missing package
    (`gguf` for GGUF files).
    """
    import torch  # noqa: F401  (transformers needs it; imported here so `--help` stays fast)

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    path, gguf_file = resolve_model_source(arg, trust_remote_code=trust_remote_code)
    fingerprint = model_fingerprint(path, gguf_file)
    if gguf_file is not None:
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise ImportError("loading a GGUF model needs the `gguf` package: pip install gguf") from None
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if torch_device.type == "cuda":
        kwargs["device_map"] = str(torch_device)
    try:
        with gguf_load_patched(gguf_file is not None):
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except ValueError as err:
        message = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        if "trust_remote_code" in str(err) or "custom code" in message:
            raise CsdError(f"model {arg} needs code from its repository; pass --trust-remote-code if you trust it.") from None
        raise CsdError(f"model {arg}: transformers cannot load it as a causal LM ({message}).") from None
    except OSError as err:
        message = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise CsdError(f"model {arg}: cannot read it ({message}); check the folder or file.") from None
    except pickle.UnpicklingError as err:  # torch.load(weights_only=True) refused a pickled weight file
        lines = [line for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        detail = (lines or [str(err).splitlines()[0] if str(err) else "not plain tensors"])[0].strip()
        raise CsdError(f"model {arg}: a pickled weight file (.bin/.pt) holds more than tensors, and loading it could "
                       f"run code, so it is refused ({detail[:200]}); use .safetensors weights, or convert the file "
                       "from a copy you trust.") from None
    if torch_device.type == "cpu":
        model.to(torch_device)
    return LoadedModel(model=model, source=str(arg), path=path, gguf_file=gguf_file, fingerprint=fingerprint,
                       dtype=torch_dtype, device=torch_device, output_size=output_size_of(model))


@contextmanager
def gguf_load_patched(active: bool):
    """While transformers loads a GGUF file: one `gguf.get_tensor_name_map` per (architecture, depth), as it asks for
    it again for every submodule of the model and only reads it (397 times for SmolLM2-135M: 6 s on 2 cores), and
    no progress bar (its tqdm reads TQDM_DISABLE only when tqdm is imported)."""
    if not active:
        yield
        return
    from unittest import mock

    import gguf
    import transformers.modeling_gguf_pytorch_utils as loader

    with ExitStack() as patches:  # each only where the installed version has it
        if hasattr(gguf, "get_tensor_name_map"):
            patches.enter_context(mock.patch.object(
                gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)))
        if hasattr(loader, "tqdm"):
            patches.enter_context(mock.patch.object(loader, "tqdm", functools.partial(loader.tqdm, disable=True)))
        yield
