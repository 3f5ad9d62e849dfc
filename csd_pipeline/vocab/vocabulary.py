"""Byte-exact vocabularies (SPEC §2) and the tokenizers they come from.

Every token id gets the exact bytes it adds to the decoded text (`Vocabulary`); the two supported
tokenizer families and how their token strings map to bytes are in `vocab.families`.
`load_tokenizer` loads a fast tokenizer with its vocabulary (`TokenizerBundle`), and
`TokenizerBundle.encode_spans` gives each token the source byte it ends at. Special tokens (added tokens
flagged `special`) have no bytes and are matched by role, never by spelling. An added token
whose text does not round-trip byte-exactly is marked `untrusted` and never used as a spelling.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError
from csd_pipeline.vocab.families import (
    FLAG_SPECIAL,
    FLAG_UNTRUSTED,
    adds_bos,
    special_roles,
    token_bytes_of,
    tokenizer_family,
    tokenizer_fingerprint,
)


@dataclass
class Vocabulary:
    """Exact bytes and special-token roles of every id of one tokenizer."""

    name: str
    family: str  # "byte_level" | "sentencepiece"
    token_bytes: list[bytes]
    flags: np.ndarray  # uint8 per id: FLAG_SPECIAL | FLAG_UNTRUSTED
    roles: dict[str, int]
    dummy_prefix: bool
    fingerprint: str
    adds_bos: bool = False
    needs_round_trip: bool = False
    _spellings: dict[bytes, tuple[int, ...]] | None = field(default=None, repr=False)
    _lengths: np.ndarray | None = field(default=None, repr=False)
    _flat: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    @property
    def is_special(self) -> np.ndarray:
        return (self.flags & FLAG_SPECIAL) != 0

    @property
    def untrusted(self) -> np.ndarray:
        return (self.flags & FLAG_UNTRUSTED) != 0

    def spellings(self) -> dict[bytes, tuple[int, ...]]:
        """Spelling -> sorted ids: non-empty bytes of every non-special, trusted token."""
        if self._spellings is None:
            usable = (self.flags == 0).tolist()
            rep: dict[bytes, int] = {}
            extra: dict[bytes, list[int]] = {}
            for i, b in enumerate(self.token_bytes):
                if b and usable[i]:
                    first = rep.setdefault(b, i)
                    if first != i:
                        extra.setdefault(b, [first]).append(i)
            spellings: dict[bytes, tuple[int, ...]] = {b: (i,) for b, i in rep.items()}
            for b, ids in extra.items():
                spellings[b] = tuple(ids)
            self._spellings = spellings
        return self._spellings

    def spelling_representatives(self) -> dict[bytes, int]:
        """Spelling -> its smallest id (the id tables store for the spelling)."""
        return {b: ids[0] for b, ids in self.spellings().items()}

    def byte_lengths(self) -> np.ndarray:
        """int64 [size]: number of bytes of each token (0 for specials)."""
        if self._lengths is None:
            self._lengths = np.fromiter(map(len, self.token_bytes), dtype=np.int64, count=self.size)
        return self._lengths

    def flat_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 array of all token bytes concatenated, int64 start offset of each id)."""
        if self._flat is None:
            lengths = self.byte_lengths()
            starts = np.zeros(self.size, dtype=np.int64)
            np.cumsum(lengths[:-1], out=starts[1:])
            flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
            self._flat = (flat, starts)
        return self._flat

    def role_counts(self) -> dict[str, int]:
        """Number of special ids per role; specials without a named role count as `special`."""
        counts: dict[str, int] = {}
        named = set()
        for role, i in sorted(self.roles.items()):
            counts[role] = counts.get(role, 0) + 1
            named.add(i)
        unnamed = int(np.count_nonzero(self.is_special)) - len(named & set(np.flatnonzero(self.is_special).tolist()))
        if unnamed:
            counts["special"] = unnamed
        return counts

    def context_token(self) -> int | None:
        """The zero-width token a document starts with: BOS if the tokenizer adds one, else the separator."""
        if self.adds_bos and "bos" in self.roles:
            return self.roles["bos"]
        if "separator" in self.roles:
            return self.roles["separator"]
        return self.roles.get("eos")


@dataclass
class EncodedText:
    """One document's content tokens and the source byte position each one ends at."""

    ids: np.ndarray  # int32 [n]
    ends: np.ndarray  # int64 [n], exclusive byte end of each token, non-decreasing
    exact: bool  # token bytes concatenate exactly to the source bytes (dummy prefix excluded)


class TokenizerBundle:
    """A fast tokenizer with its byte-exact vocabulary and configuration.

    The `tokenizers.Tokenizer` itself is built on first use: reading the vocabulary needs only
    the JSON, which keeps table validation and manifest checks fast. `start_tokenizer` builds it
    in a background thread instead, while this one does other work.
    """

    def __init__(self, raw_json: str, vocab: Vocabulary, config: dict, source: str):
        self.raw_json = raw_json
        self.vocab = vocab
        self.config = config
        self.source = source
        self._tokenizer = None
        self._building = None  # (thread, [tokenizer or error]) while `start_tokenizer` builds it

    def start_tokenizer(self) -> None:
        """Start building the `tokenizers.Tokenizer` in a thread; `tokenizer` then waits for it."""
        if self._tokenizer is None and self._building is None:
            self._building = _tokenizer_in_thread(self.raw_json, self.source)

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer`; special tokens are never parsed from text."""
        building = self._building
        if self._tokenizer is None and building is not None:
            building[0].join()
            if isinstance(building[1][0], Exception):
                raise building[1][0]
            self._tokenizer, self._building = building[1][0], None
        if self._tokenizer is None:
            self._tokenizer = _tokenizer_from_json(self.raw_json, self.source)
        return self._tokenizer

    def encode_spans(self, texts: list[str]) -> list[EncodedText]:
        """Tokenize `texts` (no special tokens added or parsed) and give each token its byte end."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [self._spans(text, enc) for text, enc in zip(texts, encodings)]

    def _spans(self, text: str, enc) -> EncodedText:
        vocab = self.vocab
        ids = np.asarray(enc.ids, dtype=np.int32)
        source = text.encode("utf-8", errors="surrogatepass")
        if ids.size == 0:
            return EncodedText(ids, np.zeros(0, dtype=np.int64), exact=not source)
        lengths = vocab.byte_lengths()[ids]
        ends = np.cumsum(lengths)
        flat, starts = vocab.flat_bytes()
        # The dummy prefix is one extra leading space; some tokenizers omit it when the text
        # already starts with a space, so decide by length and verify the bytes below.
        skip = 0
        if vocab.dummy_prefix and ends[-1] == len(source) + 1 and flat[starts[ids[0]]] == 0x20:
            skip = 1
        exact = bool(ends[-1] - skip == len(source)) and not vocab.flags[ids].any()
        if exact:
            gather = np.arange(ends[-1], dtype=np.int64) + np.repeat(starts[ids] - (ends - lengths), lengths)
            exact = bool(np.array_equal(flat[gather[skip:]], np.frombuffer(source, dtype=np.uint8)))
        if exact:
            ends = np.maximum(ends - skip, 0)
            return EncodedText(ids, ends, exact=True)
        return EncodedText(ids, byte_ends_from_offsets(text, enc.offsets), exact=False)


def byte_ends_from_offsets(text: str, offsets) -> np.ndarray:
    """Byte ends from character offsets (used only where a normalizer changed the text)."""
    char_bytes = np.fromiter((len(c.encode("utf-8", errors="surrogatepass")) for c in text), dtype=np.int64)
    cum = np.zeros(len(text) + 1, dtype=np.int64)
    np.cumsum(char_bytes, out=cum[1:])
    char_ends = np.asarray([end for _, end in offsets], dtype=np.int64)
    char_ends = np.clip(char_ends, 0, len(text))
    return np.maximum.accumulate(cum[char_ends]) if char_ends.size else char_ends


# --------------------------------------------------------------------------- loading


def load_tokenizer(arg: str, *, trust_remote_code: bool = False, start_tokenizer: bool = False) -> TokenizerBundle:
    """Load a fast tokenizer from a tokenizer.json, a model/tokenizer directory or a hub name.

    Fixture names (`llama-bpe`, `qwen2`, `gpt-2`, `llama-spm`, `smollm2`) resolve to the
    cached fixtures. Raises CsdError for a missing/unreadable file, a slow-only tokenizer or an
    unsupported family. `start_tokenizer`: build the `tokenizers.Tokenizer` in a thread from the
    moment the file is read (see `TokenizerBundle.start_tokenizer`), not on first use.
    """
    from csd_pipeline.fixtures.names import resolve_tokenizer_arg

    resolved = resolve_tokenizer_arg(str(arg))
    path = Path(resolved)
    if path.is_file():
        tokenizer_file, config = path, _read_config(path.parent, only_if_sibling=path)
    elif path.is_dir():
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            if any((path / name).exists() for name in ("tokenizer.model", "vocab.json", "vocab.txt")):
                raise CsdError(
                    f"tokenizer {arg}: the folder has no tokenizer.json, only a slow (non-fast) tokenizer; "
                    "convert it once with transformers (AutoTokenizer.from_pretrained(...).save_pretrained(...)) "
                    "and pass the saved folder"
                )
            raise CsdError(f"tokenizer {arg}: no tokenizer.json in this folder; pass a tokenizer.json file or a model folder")
        config = _read_config(path)
    elif os.sep in arg or arg.endswith(".json") or arg.startswith("."):
        raise CsdError(f"tokenizer {arg}: no such file or folder; check the path (or run `make fixtures` for fixture names)")
    else:
        tokenizer_file, config = _from_hub(arg, trust_remote_code)
    from csd_pipeline.vocab.vocab_cache import load_cached_vocabulary, store_vocabulary, vocabulary_key

    try:
        raw = read_json_text(tokenizer_file)
    except (OSError, UnicodeDecodeError) as err:
        raise CsdError(f"tokenizer {arg}: cannot read {tokenizer_file} ({err.__class__.__name__}); check the file") from None
    building = _tokenizer_in_thread(raw, str(arg)) if start_tokenizer else None
    key = vocabulary_key(raw, config)
    vocab = load_cached_vocabulary(key, str(arg))  # derived by an earlier run from the same file and code
    if vocab is not None:
        bundle = TokenizerBundle(raw, vocab, config, str(arg))
        bundle._building = building
        return bundle
    try:
        spec = parse_tokenizer_json(raw)
    except ValueError as err:
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not valid JSON ({err}); re-export the tokenizer") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not a tokenizer.json (no `model` section)")
    vocab = build_vocabulary(spec, config, name=str(arg), raw_json=raw)
    bundle = TokenizerBundle(raw, vocab, config, str(arg))
    bundle._building = building
    if vocab.needs_round_trip:
        _check_added_round_trips(bundle, spec)
    store_vocabulary(key, vocab)
    return bundle


def read_json_text(path: Path) -> str:
    """`path.read_text(encoding="utf-8")`, read and decoded in one piece (a 16 MB tokenizer.json
    three times faster than through `read_text`'s incremental decoder), newlines translated the same
    way (`\r\n` and a lone `\r` become `\n`), so fingerprints do not change."""
    text = path.read_bytes().decode("utf-8")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def parse_tokenizer_json(raw: str) -> dict:
    """`json.loads` of a tokenizer.json, leaving a BPE model's merges out when they can be cut cleanly.

    The vocabulary never reads the merges (the `tokenizers` library parses its own copy), and they
    are most of the parse: a third of the time for Llama 3's tokenizer. They are the file's last
    array (serialised last in `model`, itself the last key); the result keeps `"merges": []` then.
    Anything unexpected falls back to parsing everything. Raises ValueError on invalid JSON.
    """
    key, close = raw.rfind('"merges"'), raw.rfind("]")
    if 0 < key < close and "".join(raw[close + 1:].split()) == "}}":
        try:
            spec = json.loads(raw[:key] + '"merges": []' + raw[close + 1:])
        except ValueError:
            spec = None
        if isinstance(spec, dict) and isinstance(spec.get("model"), dict) and spec["model"].get("merges") == []:
            return spec
    return json.loads(raw)


def _tokenizer_in_thread(raw_json: str, name: str):
    """(thread, outcome): a thread building the tokenizer of `raw_json`; `outcome` then holds the
    tokenizer or the error. `Tokenizer.from_str` runs without the GIL (a third of a second for a
    128k vocabulary), so reading vocabularies or finding prefix entries proceeds meanwhile."""
    import threading

    outcome: list = []

    def build():
        try:
            outcome.append(_tokenizer_from_json(raw_json, name))
        except Exception as err:  # raised in the thread that asks for the tokenizer
            outcome.append(err)

    thread = threading.Thread(target=build, name=f"tokenizer {name}", daemon=True)
    thread.start()
    return thread, outcome


def _tokenizer_from_json(raw_json: str, name: str):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(raw_json)
    except Exception as err:  # tokenizers raises a plain Exception on a malformed description
        first = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise CsdError(f"tokenizer {name}: the tokenizers library cannot load it ({first})") from None
    # Corpus text is never parsed into special tokens.
    tokenizer.encode_special_tokens = True
    return tokenizer


def _read_config(folder: Path, only_if_sibling: Path | None = None) -> dict:
    config: dict = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / name
        if f.is_file():
            try:
                data = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as err:
                raise CsdError(f"tokenizer config {f}: unreadable JSON ({err.__class__.__name__}); fix or remove it") from None
            for key, value in data.items():
                config.setdefault(key, value)
    template = folder / "chat_template.jinja"
    if "chat_template" not in config and template.is_file():
        config["chat_template"] = template.read_text(encoding="utf-8")
    return config


def _from_hub(name: str, trust_remote_code: bool) -> tuple[Path, dict]:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise CsdError(f"tokenizer {name}: not a local path, and huggingface_hub is not installed to fetch it") from None
    try:
        tokenizer_file = Path(hf_hub_download(name, "tokenizer.json"))
    except Exception as err:
        raise CsdError(
            f"tokenizer {name}: not a local path and not fetchable from the hub ({err.__class__.__name__}); "
            "pass a local tokenizer.json or folder"
        ) from None
    config: dict = {}
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            extra_path = Path(hf_hub_download(name, extra))
            for key, value in json.loads(extra_path.read_text(encoding="utf-8")).items():
                config.setdefault(key, value)
        except Exception:
            continue
    return tokenizer_file, config


def build_vocabulary(spec: dict, config: dict, *, name: str, raw_json: str) -> Vocabulary:
    """Exact bytes, flags and roles of every id of a parsed tokenizer.json (`spec`).

    Raises `UnsupportedTokenizerError` for a tokenizer outside the supported families.
    """
    family, dummy = tokenizer_family(spec, name)
    token_bytes, flags, needs_round_trip = token_bytes_of(spec, family, name)
    roles = special_roles(spec, config, flags, token_bytes)
    return Vocabulary(
        name=name,
        family=family,
        token_bytes=token_bytes,
        flags=flags,
        roles=roles,
        dummy_prefix=dummy,
        fingerprint=tokenizer_fingerprint(raw_json, roles),
        adds_bos=adds_bos(spec, config),
        needs_round_trip=needs_round_trip,
    )


def _check_added_round_trips(bundle: TokenizerBundle, spec: dict | None = None) -> None:
    """Mark every non-special added token whose text does not round-trip as untrusted.

    The check runs first on a small twin of the tokenizer (`_round_trip_twin`: the same added tokens,
    normalizer, pre-tokenizer and decoder, a BPE model with only the one-symbol pieces and no merges),
    which loads in milliseconds where the whole tokenizer takes a second at 262k ids. A token that
    round-trips in the twin round-trips in the tokenizer (its text ends as one symbol, which no merge
    changes); the others, if any, are checked against the tokenizer itself.
    """
    vocab = bundle.vocab
    added = [(int(t["id"]), t["content"]) for t in (spec or {}).get("added_tokens") or [] if not t.get("special")]
    twin = _round_trip_twin(spec) if spec is not None else None
    if twin is None:
        tokenizer = bundle.tokenizer
        added = [(i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if not t.special]
    for i, content in added:
        if twin is not None and _round_trips(twin, i, content):
            continue
        if not _round_trips(bundle.tokenizer, i, content):
            vocab.flags[i] |= FLAG_UNTRUSTED
    vocab._spellings = None


def _round_trips(tokenizer, i: int, content: str) -> bool:
    try:
        return (tokenizer.encode(content, add_special_tokens=False).ids == [i]
                and tokenizer.decode([i], skip_special_tokens=False) == content)
    except Exception:
        return False


def _round_trip_twin(spec: dict):
    """The tokenizer of `spec` with a BPE model cut to its one-symbol pieces (single characters,
    <0xNN> bytes, unk) and every added token, without merges; None when that is not a BPE model or
    an added token would not keep its id."""
    from tokenizers import Tokenizer

    model = spec.get("model") or {}
    added = spec.get("added_tokens") or []
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    added_ids = {int(t["id"]) for t in added}
    unk = model.get("unk_token")
    kept = {piece: i for piece, i in model["vocab"].items()
            if len(piece) == 1 or piece.startswith("<0x") or i in added_ids or piece == unk}
    try:
        twin = Tokenizer.from_str(json.dumps({**spec, "model": {**model, "vocab": kept, "merges": []}}))
    except Exception:
        return None
    twin.encode_special_tokens = True
    if any(twin.token_to_id(t["content"]) != int(t["id"]) for t in added):
        return None
    return twin
