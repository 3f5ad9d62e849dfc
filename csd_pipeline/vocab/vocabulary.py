"""Byte-exact vocabularies (SPEC §2).

Every token id gets the exact bytes it adds to the decoded text. Two families are supported:

- ByteLevel BPE (GPT-2, Llama 3, Qwen 2/2.5/3, SmolLM2, ...): each character of a token
  string maps back to one byte through the GPT-2 byte-to-unicode table.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral v1-v3, Phi-3, Gemma): `▁` is a
  space and `<0xNN>` is one byte; a leading space added by the tokenizer (the dummy prefix) is
  not source text.

Anything else is refused with one sentence naming the family. Special tokens (added tokens
flagged `special`) have no bytes and are matched by role, never by spelling. An added token
whose text does not round-trip byte-exactly is marked `untrusted` and never used as a spelling.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from csd_pipeline.errors import CsdError, UnsupportedTokenizerError

SPM_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# Spellings of end-of-turn markers in common chat formats; matched against special tokens only.
EOT_SPELLINGS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eot|>", "<|END_OF_TURN_TOKEN|>")
# Document separators used in pre-training, in order of preference.
SEPARATOR_SPELLINGS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end▁of▁sentence|>")
BOS_SPELLINGS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<｜begin▁of▁sentence｜>")

FLAG_SPECIAL = 1
FLAG_UNTRUSTED = 2


def gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: printable character -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


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
            self._lengths = np.fromiter((len(b) for b in self.token_bytes), dtype=np.int64, count=self.size)
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
    the JSON, which keeps table validation and manifest checks fast.
    """

    def __init__(self, raw_json: str, vocab: Vocabulary, config: dict, source: str):
        self.raw_json = raw_json
        self.vocab = vocab
        self.config = config
        self.source = source
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The `tokenizers.Tokenizer`; special tokens are never parsed from text."""
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
        return EncodedText(ids, _ends_from_offsets(text, enc.offsets), exact=False)


def _ends_from_offsets(text: str, offsets) -> np.ndarray:
    """Byte ends from character offsets (used only where a normalizer changed the text)."""
    char_bytes = np.fromiter((len(c.encode("utf-8", errors="surrogatepass")) for c in text), dtype=np.int64)
    cum = np.zeros(len(text) + 1, dtype=np.int64)
    np.cumsum(char_bytes, out=cum[1:])
    char_ends = np.asarray([end for _, end in offsets], dtype=np.int64)
    char_ends = np.clip(char_ends, 0, len(text))
    return np.maximum.accumulate(cum[char_ends]) if char_ends.size else char_ends


# --------------------------------------------------------------------------- loading


def load_tokenizer(arg: str, *, trust_remote_code: bool = False) -> TokenizerBundle:
    """Load a fast tokenizer from a tokenizer.json, a model/tokenizer directory or a hub name.

    Fixture names (`llama-bpe`, `qwen2`, `gpt-2`, `llama-spm`, `smollm2`) resolve to the
    cached fixtures. Raises CsdError for a missing/unreadable file, a slow-only tokenizer or an
    unsupported family.
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
    try:
        raw = tokenizer_file.read_text(encoding="utf-8")
        spec = json.loads(raw)
    except (OSError, UnicodeDecodeError) as err:
        raise CsdError(f"tokenizer {arg}: cannot read {tokenizer_file} ({err.__class__.__name__}); check the file") from None
    except ValueError as err:
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not valid JSON ({err}); re-export the tokenizer") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise CsdError(f"tokenizer {arg}: {tokenizer_file} is not a tokenizer.json (no `model` section)")
    vocab = build_vocabulary(spec, config, name=str(arg), raw_json=raw)
    bundle = TokenizerBundle(raw, vocab, config, str(arg))
    if vocab.needs_round_trip:
        _check_added_round_trips(bundle)
    return bundle


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


# --------------------------------------------------------------------------- families


def _components(node) -> list[dict]:
    """Flatten a normalizer / pre-tokenizer / decoder description into its parts."""
    if not node:
        return []
    parts = []
    for key in ("normalizers", "pretokenizers", "decoders", "processors"):
        if key in node:
            for child in node[key]:
                parts.extend(_components(child))
            return parts
    return [node]


def _family(spec: dict, name: str) -> tuple[str, bool]:
    """(family, dummy_prefix) of a tokenizer.json, or raise UnsupportedTokenizerError."""
    model = spec.get("model", {})
    model_type = model.get("type")
    normalizers = _components(spec.get("normalizer"))
    pre = _components(spec.get("pre_tokenizer"))
    decoders = _components(spec.get("decoder"))
    norm_types = [n.get("type") for n in normalizers]
    pre_types = [p.get("type") for p in pre]
    dec_types = [d.get("type") for d in decoders]
    supported = (
        "supported: ByteLevel BPE (GPT-2, Llama 3, Qwen2, SmolLM2) and SentencePiece BPE with byte "
        "fallback (Llama 2, Mistral, Gemma)"
    )
    described = f"model {model_type}, normalizer {norm_types or None}, pre-tokenizer {pre_types or None}, decoder {dec_types or None}"
    if model_type == "BPE" and "ByteLevel" in pre_types + dec_types:
        if any(t not in ("NFC",) for t in norm_types):
            raise UnsupportedTokenizerError(
                f"tokenizer {name}: its normalizer {norm_types} changes the text, so token bytes are not source bytes "
                f"({described}); {supported}"
            )
        return "byte_level", False
    if model_type == "BPE" and model.get("byte_fallback") and "ByteFallback" in dec_types:
        dummy = False
        for n in normalizers:
            t = n.get("type")
            if t == "Prepend" and n.get("prepend") == SPM_SPACE:
                dummy = True
            elif t == "Replace" and _replace_pair(n) == (" ", SPM_SPACE):
                continue
            else:
                raise UnsupportedTokenizerError(
                    f"tokenizer {name}: its normalizer step {t} changes the text ({described}); {supported}"
                )
        for p in pre:
            if p.get("type") == "Metaspace":
                scheme = p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never")
                dummy = dummy or scheme in ("always", "first")
            elif p.get("type") == "Split" and p.get("behavior") != "Removed":
                continue   # cuts the text but keeps every character (Gemma splits on spaces)
            else:
                raise UnsupportedTokenizerError(
                    f"tokenizer {name}: pre-tokenizer {p.get('type')} is not supported with SentencePiece BPE "
                    f"({described}); {supported}"
                )
        return "sentencepiece", dummy
    raise UnsupportedTokenizerError(f"tokenizer {name}: unsupported family ({described}); {supported}")


def _replace_pair(node: dict) -> tuple[str, str]:
    pattern = node.get("pattern", {})
    return pattern.get("String", pattern.get("Regex", "")), node.get("content", "")


def _token_name(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def build_vocabulary(spec: dict, config: dict, *, name: str, raw_json: str) -> Vocabulary:
    """Exact bytes, flags and roles of every id of a parsed tokenizer.json (`spec`)."""
    family, dummy = _family(spec, name)
    model_vocab = spec["model"].get("vocab")
    if not isinstance(model_vocab, dict):
        raise UnsupportedTokenizerError(f"tokenizer {name}: its model has no vocabulary map; supported: BPE tokenizers")
    added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
    size = max(max(model_vocab.values(), default=-1), max(added, default=-1)) + 1
    pieces: list[str | None] = [None] * size
    for piece, i in model_vocab.items():
        pieces[i] = piece
    token_bytes: list[bytes] = [b""] * size
    flags = np.zeros(size, dtype=np.uint8)
    if family == "byte_level":
        decoder = gpt2_byte_decoder()
        table = {ord(ch): chr(b) for ch, b in decoder.items()}
        outside = re.compile("[^" + re.escape("".join(decoder)) + "]")
        for i, piece in enumerate(pieces):
            if piece is None:
                flags[i] |= FLAG_UNTRUSTED
            elif outside.search(piece):
                flags[i] |= FLAG_UNTRUSTED  # a character outside the byte table: not byte-exact
            else:
                token_bytes[i] = piece.translate(table).encode("latin-1")
    else:
        for i, piece in enumerate(pieces):
            if piece is None:
                flags[i] |= FLAG_UNTRUSTED
                continue
            m = _BYTE_PIECE.match(piece) if piece.startswith("<0x") else None
            token_bytes[i] = bytes([int(m.group(1), 16)]) if m else piece.replace(SPM_SPACE, " ").encode("utf-8")
    needs_round_trip = False
    for i, token in added.items():
        if token.get("special"):
            token_bytes[i] = b""
            flags[i] = FLAG_SPECIAL
        else:
            # Checked against the real tokenizer in _check_added_round_trips.
            token_bytes[i] = token["content"].encode("utf-8")
            flags[i] = 0
            needs_round_trip = True
    roles = _roles(model_vocab, added, config, flags, token_bytes)
    vocab = Vocabulary(
        name=name,
        family=family,
        token_bytes=token_bytes,
        flags=flags,
        roles=roles,
        dummy_prefix=dummy,
        fingerprint=tokenizer_fingerprint(raw_json, roles),
        adds_bos=_adds_bos(spec, config),
    )
    vocab.needs_round_trip = needs_round_trip
    return vocab


def _check_added_round_trips(bundle: TokenizerBundle) -> None:
    """Mark every non-special added token whose text does not round-trip as untrusted."""
    vocab = bundle.vocab
    tokenizer = bundle.tokenizer
    for i, token in tokenizer.get_added_tokens_decoder().items():
        if token.special:
            continue
        try:
            ok = tokenizer.encode(token.content, add_special_tokens=False).ids == [i]
            ok = ok and tokenizer.decode([i], skip_special_tokens=False) == token.content
        except Exception:
            ok = False
        if not ok:
            vocab.flags[i] |= FLAG_UNTRUSTED
    vocab._spellings = None


def _roles(model_vocab: dict, added: dict, config: dict, flags: np.ndarray, token_bytes: list) -> dict[str, int]:
    by_text = {t["content"]: i for i, t in added.items()}
    special_by_text = {t["content"]: i for i, t in added.items() if t.get("special")}
    roles: dict[str, int] = {}
    for role in ("bos", "eos", "pad", "unk"):
        token = _token_name(config.get(f"{role}_token"))
        if token is None:
            continue
        i = by_text.get(token, model_vocab.get(token))
        if i is not None:
            roles[role] = i
    for role, spellings in (("eot", EOT_SPELLINGS), ("separator", SEPARATOR_SPELLINGS), ("bos", BOS_SPELLINGS)):
        if role in roles:
            continue
        for text in spellings:
            if text in special_by_text:
                roles[role] = special_by_text[text]
                break
    for i in roles.values():
        # A token with a role is never text (e.g. SentencePiece <unk>, <s>, </s> in the model vocab).
        flags[i] = FLAG_SPECIAL
        token_bytes[i] = b""
    return roles


def _adds_bos(spec: dict, config: dict) -> bool:
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    post = spec.get("post_processor") or {}
    for part in _components(post):
        single = part.get("single") or []
        if single and "SpecialToken" in single[0]:
            return True
    return False


def tokenizer_fingerprint(raw_json: str, roles: dict[str, int]) -> str:
    """sha256 of the serialized tokenizer and its special-token map."""
    h = hashlib.sha256()
    h.update(raw_json.encode("utf-8"))
    h.update(json.dumps(roles, sort_keys=True).encode("utf-8"))
    return h.hexdigest()
