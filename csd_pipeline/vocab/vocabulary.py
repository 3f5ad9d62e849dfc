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
from dataclasses import dataclass, field

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
from csd_pipeline.vocab.tokenizer_files import (  # noqa: F401  (read_json_text, parse_tokenizer_json: part of this module's API)
    TokenizerSource,
    open_tokenizer,
    parse_tokenizer_json,
    read_json_text,
    tokenizer_from_json,
    tokenizer_in_thread,
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
    in a background thread instead (`tokenizer_files.tokenizer_in_thread`).
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
            self._building = tokenizer_in_thread(self.raw_json, self.source)

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
            self._tokenizer = tokenizer_from_json(self.raw_json, self.source)
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


def load_tokenizer(arg: str, *, trust_remote_code: bool = False, start_tokenizer: bool = False,
                   opened: TokenizerSource | None = None) -> TokenizerBundle:
    """Load a fast tokenizer from a tokenizer.json, a model/tokenizer directory or a hub name.

    Fixture names (`llama-bpe`, `qwen2`, `gpt-2`, `llama-spm`, `smollm2`) resolve to the
    cached fixtures. Raises CsdError for a missing/unreadable file, a slow-only tokenizer or an
    unsupported family. `start_tokenizer`: build the `tokenizers.Tokenizer` in a thread from the
    moment the file is read (see `TokenizerBundle.start_tokenizer`), not on first use. `opened`: the
    file as `vocab.tokenizer_files.open_tokenizer(arg, ...)` already read it (and maybe began its tokenizer).
    The vocabulary is read from the cache of derived vocabularies when an earlier run stored it
    (`vocab.vocab_cache`), else derived and stored.
    """
    from csd_pipeline.vocab.vocab_cache import load_cached_vocabulary, store_vocabulary, vocabulary_key

    source = opened or open_tokenizer(arg, trust_remote_code=trust_remote_code, start_tokenizer=start_tokenizer)
    raw, config, tokenizer_file, building = source.raw_json, source.config, source.file, source.building
    key = vocabulary_key(raw, config)
    vocab = load_cached_vocabulary(key, str(arg))  # derived by an earlier run from the same file and code
    if vocab is not None:
        bundle = TokenizerBundle(raw, vocab, config, str(arg))
        bundle._building = building
        return bundle
    try:
        spec = parse_tokenizer_json(raw)
    except (ValueError, RecursionError) as err:
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not valid JSON ({err}); re-export the tokenizer") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not a tokenizer.json (no `model` section)")
    try:
        vocab = build_vocabulary(spec, config, name=str(arg), raw_json=raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:  # a field missing or of another type
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is malformed ({type(err).__name__}: {err}); re-export the "
                       "tokenizer") from None
    bundle = TokenizerBundle(raw, vocab, config, str(arg))
    bundle._building = building
    if vocab.needs_round_trip:
        _check_added_round_trips(bundle, spec)
    store_vocabulary(key, vocab)
    return bundle


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
