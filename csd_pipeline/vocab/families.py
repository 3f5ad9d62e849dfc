"""Token strings -> exact bytes for the two supported tokenizer families, and special-token roles (SPEC §2).

- ByteLevel BPE (GPT-2, Llama 3, Qwen 2/2.5/3, SmolLM2, ...): each character of a token
  string maps back to one byte through the GPT-2 byte-to-unicode table.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral v1-v3, Phi-3, Gemma): `▁` is a
  space and `<0xNN>` is one byte; a leading space added by the tokenizer (the dummy prefix) is
  not source text.

Anything else is refused with one sentence naming the family (`tokenizer_family`). `token_bytes_of`
gives every id its bytes and flags; `special_roles` names the special tokens (bos, eos, eot,
separator, ...) from the tokenizer config and common spellings. `vocab.vocabulary.build_vocabulary`
puts these together into a `Vocabulary`.
"""

from __future__ import annotations

import itertools
import json
import re

import numpy as np

from csd_pipeline.errors import UnsupportedTokenizerError
from csd_pipeline.runtime.files import bytes_sha256

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


def tokenizer_family(spec: dict, name: str) -> tuple[str, bool]:
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


def token_bytes_of(spec: dict, family: str, name: str) -> tuple[list[bytes], np.ndarray, bool]:
    """(bytes of every id, uint8 flags per id, whether an added non-special token needs a round-trip check)
    of a parsed tokenizer.json of `family`. Raises `UnsupportedTokenizerError` without a vocabulary map."""
    model_vocab = spec["model"].get("vocab")
    if not isinstance(model_vocab, dict):
        raise UnsupportedTokenizerError(f"tokenizer {name}: its model has no vocabulary map; supported: BPE tokenizers")
    added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
    size = max(max(model_vocab.values(), default=-1), max(added, default=-1)) + 1
    pieces: list[str | None] = [None] * size
    for piece, i in model_vocab.items():
        pieces[i] = piece
    if family == "byte_level":
        token_bytes, untrusted = _byte_level_bytes(pieces)
    else:
        token_bytes, untrusted = _sentencepiece_bytes(pieces)
    flags = np.where(untrusted, FLAG_UNTRUSTED, 0).astype(np.uint8)
    needs_round_trip = False
    for i, token in added.items():
        if token.get("special"):
            token_bytes[i] = b""
            flags[i] = FLAG_SPECIAL
        else:
            # Checked against the real tokenizer (vocabulary.load_tokenizer).
            token_bytes[i] = token["content"].encode("utf-8")
            flags[i] = 0
            needs_round_trip = True
    return token_bytes, flags, needs_round_trip


def _byte_level_bytes(pieces: list[str | None]) -> tuple[list[bytes], np.ndarray]:
    """(bytes, untrusted) per id of ByteLevel pieces: each character is one byte through GPT-2's table;
    a piece with a character outside it (or no piece) is untrusted and has no bytes. One pass over
    all pieces at once (a look-up table over code points) instead of one translation per piece."""
    decoder = gpt2_byte_decoder()
    lookup = np.full(max(map(ord, decoder)) + 1, -1, dtype=np.int16)
    for ch, b in decoder.items():
        lookup[ord(ch)] = b
    known = [p or "" for p in pieces]
    bounds = [0]
    bounds += itertools.accumulate(map(len, known))  # the character offset where each piece starts, and the end
    codes = np.frombuffer("".join(known).encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    values = lookup[np.minimum(codes, lookup.size - 1)]
    values[codes >= lookup.size] = -1
    untrusted = np.fromiter((p is None for p in pieces), dtype=bool, count=len(pieces))
    outside = np.flatnonzero(values < 0)  # characters outside the table; the piece each one is in:
    untrusted[np.searchsorted(np.asarray(bounds, dtype=np.int64), outside, side="right") - 1] = True
    raw = values.astype(np.uint8).tobytes()
    token_bytes = [raw[s:e] for s, e in zip(bounds, bounds[1:])]
    for i in np.flatnonzero(untrusted).tolist():
        token_bytes[i] = b""
    return token_bytes, untrusted


def _sentencepiece_bytes(pieces: list[str | None]) -> tuple[list[bytes], np.ndarray]:
    """(bytes, untrusted) per id of SentencePiece pieces: `▁` is a space, `<0xNN>` one byte, the rest
    UTF-8; no piece: untrusted."""
    token_bytes: list[bytes] = [b""] * len(pieces)
    untrusted = np.zeros(len(pieces), dtype=bool)
    for i, piece in enumerate(pieces):
        if piece is None:
            untrusted[i] = True
            continue
        m = _BYTE_PIECE.match(piece) if piece.startswith("<0x") else None
        token_bytes[i] = bytes([int(m.group(1), 16)]) if m else piece.replace(SPM_SPACE, " ").encode("utf-8")
    return token_bytes, untrusted


def special_roles(spec: dict, config: dict, flags: np.ndarray, token_bytes: list) -> dict[str, int]:
    """Role -> id of the special tokens (bos, eos, pad, unk from the config; eot, separator, bos by spelling).

    A token with a role is never text: its flags become `FLAG_SPECIAL` and its bytes empty (in place).
    """
    model_vocab = spec["model"]["vocab"]
    added = {int(t["id"]): t for t in spec.get("added_tokens") or []}
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


def adds_bos(spec: dict, config: dict) -> bool:
    """Whether the tokenizer adds a BOS token to a document (config `add_bos_token`, else its post-processor)."""
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
    return bytes_sha256(raw_json.encode("utf-8"), json.dumps(roles, sort_keys=True).encode("utf-8"))
