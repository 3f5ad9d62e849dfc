"""A content-addressed cache of derived vocabularies, so a tokenizer is derived once, not once per process.

Every command and every worker process derives the vocabularies of the tokenizers it loads (the
two `tables build` calls and `tables validate`, align and its workers, the trainer); deriving a
`Vocabulary` (parsing the tokenizer.json, every token's bytes, the added tokens' round trips) is a
fifth of a CPU second at 150k ids and 0.4 s at 262k. The first load stores the result
here; the later ones read it back in a few milliseconds.

- Key: sha256 of this cache's format version, the bytes of the modules that derive a vocabulary
  (`families.py`, `tokenizer_files.py`, `vocabulary.py`, this file), the `tokenizers` version (the
  round trips depend on it), the tokenizer.json text and its configuration (`tokenizer_config.json`,
  `special_tokens_map.json`, chat template). A changed file, config or derivation code is a new key:
  a stale entry is never read, only left behind.
- Value: `<key>.safetensors` holding the token bytes, their offsets and flags, and a JSON header
  (family, roles, dummy prefix, fingerprint, adds_bos, the key) with the sha256 of all of it. An
  entry that is missing, unreadable, truncated or whose checksum or key does not match is ignored
  (the vocabulary is derived again and the entry rewritten); loading never executes code.
- Writes are atomic (`runtime/files.atomic_path`: a temporary name per host, process and thread, then rename), so
  concurrent runs never read a partial entry; two writers of one key write the same bytes. An
  entry that cannot be written is simply not stored.

Folder: env `CSD_VOCAB_CACHE`, else `~/.cache/csd-pipeline/vocabularies`; `CSD_VOCAB_CACHE=off`
turns the cache off. Entries are a few MB each; deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from csd_pipeline.vocab.vocabulary import Vocabulary

CACHE_ENV = "CSD_VOCAB_CACHE"
CACHE_FORMAT = 1
_META_KEY = "csd_vocabulary"
_FIELDS = ("family", "roles", "dummy_prefix", "fingerprint", "adds_bos", "needs_round_trip")
_DERIVATION_MODULES = ("families.py", "tokenizer_files.py", "vocabulary.py", "vocab_cache.py")


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is off (`CSD_VOCAB_CACHE=off`)."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.strip().lower() in ("off", "0", "none", "false"):
        return None
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "csd-pipeline" / "vocabularies"


def vocabulary_key(raw_json: str, config: dict) -> str | None:
    """The cache key of a tokenizer.json text with its configuration; None when the derivation code
    cannot be read (then nothing is cached)."""
    import tokenizers

    digest = hashlib.sha256(f"csd-vocabulary-cache {CACHE_FORMAT} tokenizers {tokenizers.__version__}\n".encode())
    here = Path(__file__).resolve().parent
    try:
        for name in _DERIVATION_MODULES:
            source = (here / name).read_bytes()
            digest.update(f"{name} {len(source)}\n".encode())
            digest.update(source)
    except OSError:
        return None
    text = raw_json.encode("utf-8", errors="surrogatepass")
    settings = json.dumps(config, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", errors="surrogatepass")
    for part in (text, settings):
        digest.update(f"{len(part)}\n".encode())
        digest.update(part)
    return digest.hexdigest()


def _entry_path(folder: Path, key: str) -> Path:
    return folder / f"{key}.safetensors"


def _checksum(tensors: dict[str, np.ndarray], header: str) -> str:
    digest = hashlib.sha256(header.encode("utf-8"))
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def load_cached_vocabulary(key: str | None, name: str) -> Vocabulary | None:
    """The cached vocabulary of `key` (named `name`), or None when there is no trustworthy entry."""
    folder = cache_dir()
    if key is None or folder is None:
        return None
    path = _entry_path(folder, key)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as handle:
            meta_text = (handle.metadata() or {})[_META_KEY]
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        entry = json.loads(meta_text)
        header = entry["header"]
        if entry["checksum"] != _checksum(tensors, header):
            return None
        meta = json.loads(header)
        if meta["key"] != key or meta["format"] != CACHE_FORMAT or set(tensors) != {"bytes", "offsets", "flags"}:
            return None
        flat, offsets, flags = tensors["bytes"], tensors["offsets"], tensors["flags"]
        if flat.dtype != np.uint8 or offsets.dtype != np.int64 or flags.dtype != np.uint8 or offsets.size != flags.size + 1:
            return None
        raw, cuts = flat.tobytes(), offsets.tolist()
        token_bytes = [raw[start:end] for start, end in zip(cuts, cuts[1:])]
        return Vocabulary(name=name, token_bytes=token_bytes, flags=flags.copy(),
                          roles={k: int(v) for k, v in meta["roles"].items()},
                          **{k: meta[k] for k in _FIELDS if k != "roles"})
    except Exception:  # missing, unreadable, truncated, foreign: derive the vocabulary again
        return None


def store_vocabulary(key: str | None, vocab: Vocabulary) -> None:
    """Store `vocab` under `key`, atomically; a cache that cannot be written is not used."""
    folder = cache_dir()
    if key is None or folder is None:
        return
    from safetensors.numpy import save_file

    from csd_pipeline.runtime.files import atomic_path

    flat, starts = vocab.flat_bytes()
    tensors = {"bytes": np.ascontiguousarray(flat), "offsets": np.append(starts, flat.size).astype(np.int64),
               "flags": np.ascontiguousarray(vocab.flags, dtype=np.uint8)}
    header = json.dumps({"key": key, "format": CACHE_FORMAT, **{k: getattr(vocab, k) for k in _FIELDS}}, sort_keys=True)
    metadata = {_META_KEY: json.dumps({"header": header, "checksum": _checksum(tensors, header)})}
    try:
        with atomic_path(_entry_path(folder, key)) as tmp:  # a temporary name per host, process and thread
            save_file(tensors, str(tmp), metadata=metadata)
    except Exception:  # OSError, or safetensors' own error for the same I/O failures: not stored
        pass
