"""Byte-exact sub-token tables between two vocabularies (SPEC §3).

For an ordered pair (source tokenizer A, destination tokenizer B) a table holds:

- the bytes of every A and B token, their flags (special / untrusted) and special roles;
- common spellings: byte strings that both vocabularies can spell with one token;
- prefix-support entries (p, a, b): bytes(a) == p + bytes(b), p non-empty, a an A spelling and
  b a B spelling. Keyed by p they answer "B has emitted tokens spelling p; which single next B
  token completes exactly one A token?";
- canonical chains: B's own tokenization of each A token's text (what the original builder
  stores), reported next to the byte-exact entries;
- both tokenizers' fingerprints and the format version.

Tables are stored as safetensors (numpy arrays + a JSON metadata string): loading never executes
code. Entries are stored by spelling, each spelling represented by its smallest id.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import atomic_path, bytes_sha256
from csd_pipeline.runtime.storage import is_remote, local_file, location
from csd_pipeline.vocab.config import TableCheckConfig
from csd_pipeline.vocab.prefix_entries import prefix_entries, spelling_arrays
from csd_pipeline.vocab.vocabulary import TokenizerBundle, Vocabulary

TABLE_FORMAT_VERSION = 1
_META_KEY = "csd_table"
_META_HASH = "metadata_sha256"  # sha256 of the metadata's other keys (sorted JSON); absent in older tables
_VOCAB_META_FIELDS = ("name", "family", "roles", "dummy_prefix", "fingerprint", "adds_bos")


@dataclass
class SubtokenTable:
    """A sub-token table for (source, destination); see the module docstring."""

    source: Vocabulary
    destination: Vocabulary
    prefix_source: np.ndarray  # int32 [E] representative source id of spelling a
    prefix_destination: np.ndarray  # int32 [E] representative destination id of spelling b
    prefix_length: np.ndarray  # int32 [E] len(p)
    canonical: dict = field(default_factory=dict)  # counts about canonical chains
    _prefix_map: dict | None = field(default=None, repr=False)

    @property
    def source_fingerprint(self) -> str:
        return self.source.fingerprint

    @property
    def destination_fingerprint(self) -> str:
        return self.destination.fingerprint

    def common_spellings(self) -> list[bytes]:
        """Byte strings spelled by one token in both vocabularies, sorted."""
        return sorted(self.source.spellings().keys() & self.destination.spellings().keys())

    def common_spelling_count(self) -> int:
        """len(common_spellings()), without sorting them."""
        return sum(map(self.destination.spellings().__contains__, self.source.spellings()))

    def prefix_map(self) -> dict[bytes, list[tuple[bytes, bytes]]]:
        """p -> [(a spelling, b spelling), ...] for every prefix-support entry."""
        if self._prefix_map is None:
            src, dst = self.source.token_bytes, self.destination.token_bytes
            mapping: dict[bytes, list[tuple[bytes, bytes]]] = {}
            for a, b, n in zip(self.prefix_source.tolist(), self.prefix_destination.tolist(), self.prefix_length.tolist()):
                a_bytes = src[a]
                mapping.setdefault(a_bytes[:n], []).append((a_bytes, dst[b]))
            self._prefix_map = mapping
        return self._prefix_map

    def prefix_support(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        """Entries (a spelling, b spelling) with a == prefix + b; empty when there are none."""
        return self.prefix_map().get(prefix, [])

    def counts(self) -> dict:
        """The numbers `tables inspect` prints (see `inspect_table`)."""
        src_multi, dst_multi = (_multi_id_count(v.spellings()) for v in (self.source, self.destination))
        return {
            "format_version": TABLE_FORMAT_VERSION,
            "source": self.source.name,
            "destination": self.destination.name,
            "source_fingerprint": self.source.fingerprint,
            "destination_fingerprint": self.destination.fingerprint,
            "source_family": self.source.family,
            "destination_family": self.destination.family,
            "source_vocab_size": self.source.size,
            "destination_vocab_size": self.destination.size,
            "source_spellings": len(self.source.spellings()),
            "destination_spellings": len(self.destination.spellings()),
            "common_spellings": self.common_spelling_count(),
            "prefix_entries": int(self.prefix_length.size),
            "multi_id_spellings_source": src_multi,
            "multi_id_spellings_destination": dst_multi,
            "special_tokens": {"source": self.source.role_counts(), "destination": self.destination.role_counts()},
            **{f"canonical_{k}": v for k, v in self.canonical.items()},
        }

    # ------------------------------------------------------------------ storage

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as safetensors, atomically (`*.tmp`, then rename)."""
        from safetensors.numpy import save_file

        path = location(path)
        if not is_remote(path) and path.parent and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise CsdError(f"table output {path}: cannot create its folder ({err.strerror}); choose another --output") from None
        tensors = {}
        for side, vocab in (("source", self.source), ("destination", self.destination)):
            flat, starts = vocab.flat_bytes()
            tensors[f"{side}_bytes"] = np.ascontiguousarray(flat)
            tensors[f"{side}_offsets"] = np.append(starts, flat.size).astype(np.int64)
            tensors[f"{side}_flags"] = vocab.flags.astype(np.uint8)
        tensors["prefix_source"] = self.prefix_source.astype(np.int32)
        tensors["prefix_destination"] = self.prefix_destination.astype(np.int32)
        tensors["prefix_length"] = self.prefix_length.astype(np.int32)
        meta = {
            "format_version": TABLE_FORMAT_VERSION,
            "source": {k: getattr(self.source, k) for k in _VOCAB_META_FIELDS},
            "destination": {k: getattr(self.destination, k) for k in _VOCAB_META_FIELDS},
            "canonical": self.canonical,
            "payload_sha256": _payload_hash(tensors),
        }
        meta[_META_HASH] = _metadata_hash(meta)
        if not is_remote(path):  # a killed earlier write of this table left its temporary file: not ours to keep
            from csd_pipeline.runtime.leftovers import remove_dead_writers_tmp

            remove_dead_writers_tmp(path.parent, glob.escape(path.name), recursive=False)
        try:
            with atomic_path(path) as tmp:
                save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
        except Exception as err:  # OSError, or safetensors' own SafetensorError for the same I/O failures
            from csd_pipeline.runtime.io_errors import reason_and_advice

            reason, advice = reason_and_advice(err)
            raise CsdError(f"table output {path}: cannot write it ({reason}); {advice}, then run the command again") from None


def _multi_id_count(spellings: dict[bytes, tuple[int, ...]]) -> int:
    """Number of spellings with two or more ids."""
    return len(spellings) - list(map(len, spellings.values())).count(1)


def _metadata_hash(meta: dict) -> str:
    return bytes_sha256(json.dumps({k: v for k, v in meta.items() if k != _META_HASH}, sort_keys=True).encode())


def _read_metadata(path: Path, meta_text: str, tensors: dict) -> dict:
    """The table's metadata, checked: readable JSON, this format version, the checksums of the tensors and
    (in tables written since it was recorded) of the metadata itself. Raises CsdError."""
    from csd_pipeline.runtime.files import strict_json

    try:
        meta = strict_json(meta_text)
    except ValueError as err:
        raise CsdError(f"table {path}: its metadata is not readable JSON ({err}); rebuild it with "
                       "`csd-pipeline tables build`") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != TABLE_FORMAT_VERSION:
        raise CsdError(
            f"table {path}: format version {version}, this csd-pipeline reads version {TABLE_FORMAT_VERSION}; "
            "rebuild it with `csd-pipeline tables build`"
        )
    if _payload_hash(tensors) != meta.get("payload_sha256"):
        raise CsdError(f"table {path}: its content does not match its checksum (corrupted); rebuild it")
    if _META_HASH in meta and _metadata_hash(meta) != meta[_META_HASH]:
        raise CsdError(f"table {path}: its metadata does not match its checksum (corrupted); rebuild it")
    return meta


def _payload_hash(tensors: dict[str, np.ndarray]) -> str:
    return bytes_sha256(*(part for key in sorted(tensors)
                          for part in (key.encode(), np.ascontiguousarray(tensors[key]).tobytes())))


def load_table(path: str | os.PathLike) -> SubtokenTable:
    """Read a table written by `SubtokenTable.save`; raise CsdError if missing, foreign or corrupted."""
    from safetensors import safe_open

    path = location(path)
    if not path.is_file():
        raise CsdError(f"table {path}: no such file; build it with `csd-pipeline tables build` (or `make tables`)")
    try:
        tensors = {}
        with safe_open(str(local_file(path)), framework="numpy") as f:
            meta_text = (f.metadata() or {}).get(_META_KEY)
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise CsdError(
            f"table {path}: unreadable or truncated ({err.__class__.__name__}); rebuild it with `csd-pipeline tables build`"
        ) from None
    if meta_text is None:
        raise CsdError(f"table {path}: not a csd-pipeline sub-token table (no {_META_KEY} metadata); rebuild it")
    meta = _read_metadata(path, meta_text, tensors)
    try:
        return _table_from(meta, tensors)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise CsdError(f"table {path}: its metadata or tensors are malformed ({type(err).__name__}: {err}); "
                       "rebuild it with `csd-pipeline tables build`") from None


def _table_from(meta: dict, tensors: dict) -> SubtokenTable:
    sides = {}
    for side in ("source", "destination"):
        flat, offsets = tensors[f"{side}_bytes"], tensors[f"{side}_offsets"]
        raw, cuts = flat.tobytes(), offsets.tolist()
        token_bytes = [raw[start:end] for start, end in zip(cuts, cuts[1:])]
        info = meta[side]
        sides[side] = Vocabulary(
            name=info["name"],
            family=info["family"],
            token_bytes=token_bytes,
            flags=tensors[f"{side}_flags"].copy(),
            roles={k: int(v) for k, v in info["roles"].items()},
            dummy_prefix=bool(info["dummy_prefix"]),
            fingerprint=info["fingerprint"],
            adds_bos=bool(info["adds_bos"]),
        )
    return SubtokenTable(
        source=sides["source"],
        destination=sides["destination"],
        prefix_source=tensors["prefix_source"],
        prefix_destination=tensors["prefix_destination"],
        prefix_length=tensors["prefix_length"],
        canonical=meta.get("canonical", {}),
    )


# ---------------------------------------------------------------------- building


def encode_spellings(source: TokenizerBundle, destination: TokenizerBundle, advance=None) -> tuple[list[bytes], list]:
    """(every source spelling, [(its index, destination ids) for each spelling encoded with 2+ tokens]).

    Reads only the source's spelling classes and the destination tokenizer (`encode_batch` runs
    without the GIL), so another thread can work on the destination vocabulary meanwhile.
    """
    from csd_pipeline.vocab.chain_encoder import multi_token_chains

    texts_bytes, texts = spelling_texts(source.vocab)
    return texts_bytes, multi_token_chains(destination.tokenizer, texts, advance)


def spelling_texts(vocab: Vocabulary) -> tuple[list[bytes], list[str]]:
    """(every spelling of `vocab`, its text as a tokenizer reads it: UTF-8, invalid bytes replaced)."""
    texts_bytes = list(vocab.spellings().keys())
    return texts_bytes, [b.decode("utf-8", errors="replace") for b in texts_bytes]


def count_chains(destination: TokenizerBundle, encoded: tuple[list[bytes], list]) -> dict:
    """The original builder's canonical chains, counted from `encode_spellings`' result (every source
    spelling encoded with the destination tokenizer): how many chains there are, how many have 2+
    tokens (each gives one (p, a, b) entry) and how many of those are byte-exact prefix-support entries."""
    texts_bytes, multi = encoded
    dst_spellings = destination.vocab.spellings()
    dst_bytes = destination.vocab.token_bytes
    skip = 1 if destination.vocab.dummy_prefix else 0
    covered = 0
    for k, ids in multi:
        a_bytes = texts_bytes[k]
        chain = b"".join([dst_bytes[i] for i in ids])
        if skip and chain[:1] == b" " and len(chain) == len(a_bytes) + 1:
            chain = chain[1:]
        last = dst_bytes[ids[-1]]
        if chain == a_bytes and last in dst_spellings and len(last) < len(a_bytes):
            covered += 1
    return {"chains": len(texts_bytes), "multi_token_chains": len(multi), "chains_in_prefix_entries": covered}


def build_table(source: TokenizerBundle, destination: TokenizerBundle) -> SubtokenTable:
    """Build the (source -> destination) table from two loaded tokenizers (a progress bar on a terminal).

    The destination tokenizer is built (unless `start_tokenizer` began it already), then encodes
    every source spelling (`encode_spellings`) in a second thread while this one reads the
    destination's spelling classes and finds the prefix-support entries: `encode_batch` releases
    the GIL. (`Tokenizer.from_str` does not, so nothing else runs while the tokenizer is built.)
    """
    from concurrent.futures import ThreadPoolExecutor

    from csd_pipeline.runtime import progress

    destination.start_tokenizer()
    source.vocab.spellings()  # both threads read the source's spelling classes: computed here, once
    with progress.bar(2 * len(source.vocab.spellings()), "tables build", "spelling", unit_scale=True) as shown:
        with ThreadPoolExecutor(1) as pool:
            encoded = pool.submit(encode_spellings, source, destination, shown.update)
            a, b, n = prefix_entries(source.vocab, destination.vocab, shown.update)
            canonical = count_chains(destination, encoded.result())
    return SubtokenTable(
        source=source.vocab,
        destination=destination.vocab,
        prefix_source=a,
        prefix_destination=b,
        prefix_length=n,
        canonical=canonical,
    )


# -------------------------------------------------------------------- validation


def validate_tables(
    student: TokenizerBundle,
    teacher: TokenizerBundle,
    student_to_teacher: SubtokenTable,
    teacher_to_student: SubtokenTable,
    *,
    names: tuple[str, str] = ("student-to-teacher", "teacher-to-student"),
    sample: int = TableCheckConfig.sample,
    seed: int = 0,
) -> dict:
    """Check both tables against the tokenizers; raise CsdError on the first mismatch.

    Checks fingerprints and direction, then re-derives a random sample of token bytes and of
    prefix-support entries (complete for the sampled source spellings) from the tokenizers.
    """
    rng = np.random.default_rng(seed)
    report = {}
    for label, table, src, dst in (
        (names[0], student_to_teacher, student, teacher),
        (names[1], teacher_to_student, teacher, student),
    ):
        if table.source.fingerprint == dst.vocab.fingerprint and table.destination.fingerprint == src.vocab.fingerprint and (
            src.vocab.fingerprint != dst.vocab.fingerprint
        ):
            raise CsdError(f"table {label}: it is built in the other direction ({table.source.name} -> {table.destination.name}); swap the two table arguments")
        for side, vocab, bundle in (("source", table.source, src), ("destination", table.destination, dst)):
            if vocab.fingerprint != bundle.vocab.fingerprint:
                raise CsdError(
                    f"table {label}: its {side} tokenizer ({vocab.name}) is not {bundle.source} (fingerprint mismatch); "
                    f"rebuild it with `csd-pipeline tables build`"
                )
            ids = rng.choice(vocab.size, size=min(sample, vocab.size), replace=False)
            for i in ids.tolist():
                if vocab.token_bytes[i] != bundle.vocab.token_bytes[i] or vocab.flags[i] != bundle.vocab.flags[i]:
                    raise CsdError(f"table {label}: the bytes of {side} token {i} differ from the tokenizer's; rebuild the table")
            if vocab._spellings is None and vocab.token_bytes == bundle.vocab.token_bytes and np.array_equal(
                vocab.flags, bundle.vocab.flags
            ):  # the same bytes and flags: the same spelling classes, computed once per tokenizer
                vocab._spellings = bundle.vocab.spellings()
        _check_prefix_sample(label, table, src.vocab, dst.vocab, rng, sample)
        report[label] = table.counts()
    return report


def _check_prefix_sample(label, table, src: Vocabulary, dst: Vocabulary, rng, sample: int) -> None:
    """Re-derive all entries of a sample of source spellings and compare with the stored ones."""
    n = table.prefix_length.size
    for k in rng.choice(n, size=min(sample, n), replace=False).tolist() if n else []:
        a = src.token_bytes[table.prefix_source[k]]
        b = dst.token_bytes[table.prefix_destination[k]]
        if a[table.prefix_length[k] :] != b or table.prefix_length[k] < 1:
            raise CsdError(f"table {label}: prefix entry {k} is not byte-exact (corrupted); rebuild the table")
    reps = spelling_arrays(src)[0]
    picks = rng.choice(reps.size, size=min(sample, reps.size), replace=False)
    picked_reps = set(reps[picks].tolist())
    picked = np.zeros(src.size, dtype=bool)
    picked[list(picked_reps)] = True
    chosen = np.flatnonzero(picked[table.prefix_source])
    stored: dict[int, set] = {}
    for k in chosen.tolist():
        stored.setdefault(int(table.prefix_source[k]), set()).add((int(table.prefix_length[k]), int(table.prefix_destination[k])))
    dst_spellings = dst.spellings()
    for rep in picked_reps:
        a_bytes = src.token_bytes[rep]
        expected = {(k, dst_spellings[a_bytes[k:]][0]) for k in range(1, len(a_bytes)) if a_bytes[k:] in dst_spellings}
        if expected != stored.get(rep, set()):
            raise CsdError(f"table {label}: the prefix entries of source token {rep} differ from the tokenizers'; rebuild the table")


def read_table_fingerprints(path: str | os.PathLike) -> tuple[str, str]:
    """(source, destination) tokenizer fingerprints of a stored table, from its header only.

    Cheap (no tensor is read); raises CsdError like `load_table` when the file is not a table.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(local_file(path)), framework="numpy") as handle:
            meta = json.loads((handle.metadata() or {})[_META_KEY])
        return meta["source"]["fingerprint"], meta["destination"]["fingerprint"]
    except Exception:
        table = load_table(path)  # raises the one-sentence error for a missing/foreign/corrupted file
        return table.source_fingerprint, table.destination_fingerprint


def inspect_table(path: str | os.PathLike) -> dict:
    """Counts of a stored table (see `SubtokenTable.counts`)."""
    return load_table(path).counts()
