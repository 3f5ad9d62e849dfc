"""Byte-exact vocabularies on every fixture tokenizer (SPEC §2).

Token bytes are checked against an independent derivation (GPT-2's byte table written out here,
SentencePiece pieces decoded by the tokenizer itself), and on real and awkward text the tokens'
bytes must concatenate to the source bytes (SentencePiece: up to the dummy prefix).
"""

from __future__ import annotations

import json
import unicodedata
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csd_pipeline.fixtures.names import FIXTURE_TOKENIZERS, tokenizer_path
from csd_pipeline.vocab.vocabulary import load_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
# The brute-force checks of the two largest vocabularies (llama-bpe, qwen2) run in the full tier only.
LARGE = ("llama-bpe", "qwen2")
TIERED = [pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in FIXTURE_TOKENIZERS]

AWKWARD = [
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs",
    "漢字とかなカナ、中文字符，한국어 문장",
    "e\u0301 a\u0308 n\u0303 combining: Ame\u0301lie, Zo\u00eb, \u1e9b\u0323",
    "RTL: שלום עולם and مرحبا بالعالم \u200f mixed",
    "windows\r\nline\r\nends and a lone\rcarriage",
    " " * 300 + "x" + "\n" * 50 + "y\t\t\t \u00a0\u3000z",
    "<|endoftext|> <s> </s> <|im_start|>user\nhi<|im_end|> <|begin_of_text|> [INST] <unk>",
    "\ufeffBOM first, zero\u200bwidth\u200djoiner\u2060 and NUL \x00 byte",
    "numbers 1234567890 3.14159 and 2026-11-30",
    "",
    " ",
    "\n",
]


def _corpus_texts() -> list[str]:
    texts = [(DATA / "devil-slice.txt").read_text(encoding="utf-8")[:3000]]
    texts.append((DATA / "botchan-slice.txt").read_text(encoding="utf-8")[:3000])
    for line in (DATA / "django-po-multilingual-slice.jsonl").read_text(encoding="utf-8").splitlines():
        texts.append(json.loads(line)["text"])
    texts.extend(json.loads((DATA / "llamacpp-tokenizer-tests.json").read_text(encoding="utf-8")))
    return texts


@cache
def bundle(name: str):
    b = load_tokenizer(str(tokenizer_path(name)))
    b.source = name
    return b


def _reference_byte_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, written out independently of csd_pipeline.vocab.vocabulary."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return {ch: b for b, ch in mapping.items()}


def reference_token_bytes(name: str) -> list[bytes | None]:
    """Bytes of every non-special id derived from tokenizer.json alone (None for specials)."""
    spec = json.loads((tokenizer_path(name) / "tokenizer.json").read_text(encoding="utf-8"))
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    vocab = spec["model"]["vocab"]
    size = max(max(vocab.values()), max((t["id"] for t in spec["added_tokens"]), default=0)) + 1
    out: list[bytes | None] = [None] * size
    is_byte_level = "ByteLevel" in json.dumps(spec["pre_tokenizer"]) + json.dumps(spec["decoder"])
    table = _reference_byte_table()
    for piece, i in vocab.items():
        if i in specials:
            continue
        if is_byte_level:
            out[i] = bytes(table[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes.fromhex(piece[3:5])
        else:
            out[i] = piece.replace("\u2581", " ").encode("utf-8")
    return out


# gemma3's 262k ids too: its other checks below and in tests/fixtures stay in the fast tier
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in (*LARGE, "gemma3") else n
                                  for n in FIXTURE_TOKENIZERS])
def test_token_bytes_match_independent_derivation(name):
    vocab = bundle(name).vocab
    reference = reference_token_bytes(name)
    assert vocab.size == len(reference)
    special = vocab.is_special
    for i, ref in enumerate(reference):
        if ref is None or special[i]:
            assert vocab.token_bytes[i] == b""
        else:
            assert vocab.token_bytes[i] == ref, (name, i)


@pytest.mark.parametrize("name", TIERED)
def test_decoded_tokens_agree_with_bytes(name):
    """Where a token's bytes are valid UTF-8, the tokenizer's own decode of a run agrees."""
    b = bundle(name)
    rng = np.random.default_rng(0)
    usable = np.flatnonzero(b.vocab.flags == 0)
    for _ in range(200):
        ids = rng.choice(usable, size=5).tolist()
        raw = b"".join(b.vocab.token_bytes[i] for i in ids)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        decoded = b.tokenizer.decode(ids, skip_special_tokens=False)
        if b.vocab.dummy_prefix:
            # SentencePiece decoders strip one leading space (the dummy prefix).
            assert decoded in (text, text[1:] if text.startswith(" ") else text)
        else:
            assert decoded == text


def _check_exact(b, texts):
    for text, enc in zip(texts, b.encode_spans(texts)):
        source = text.encode("utf-8")
        if not _normalizer_changes(b, text) and _spellable(b, source):
            assert enc.exact, (b.source, text[:80])
        if enc.exact:
            joined = b"".join(b.vocab.token_bytes[i] for i in enc.ids.tolist())
            if b.vocab.dummy_prefix and len(joined) == len(source) + 1:
                joined = joined[1:]
            assert joined == source
            assert (enc.ends[-1] if enc.ends.size else 0) == len(source)
            assert np.all(np.diff(enc.ends) >= 0)
            starts = np.concatenate([[0], enc.ends[:-1]])
            for i, s, e in zip(enc.ids.tolist(), starts.tolist(), enc.ends.tolist()):
                tb = b.vocab.token_bytes[i]
                # Every token spells its own span (a dummy-prefix space is the only allowed extra byte).
                assert source[s:e] == tb or (b.vocab.dummy_prefix and s == 0 and source[s:e] == tb[1:])


@cache
def _single_bytes(name: str) -> frozenset[int]:
    vocab = bundle(name).vocab
    return frozenset(b[0] for b in vocab.spellings() if len(b) == 1)


def _spellable(b, source: bytes) -> bool:
    """Whether every byte of `source` has a one-byte token (SmolLM2's vocabulary lacks a few
    control bytes, which its tokenizer then drops: such text is reported as not exact)."""
    return set(source) <= _single_bytes(b.source)


@cache
def _has_nfc(name: str) -> bool:
    return '"NFC"' in json.dumps(json.loads(bundle(name).raw_json).get("normalizer"))


def _normalizer_changes(b, text: str) -> bool:
    return _has_nfc(b.source) and unicodedata.normalize("NFC", text) != text


@pytest.mark.parametrize("name", TIERED)
def test_real_and_awkward_text_is_byte_exact(name):
    _check_exact(bundle(name), _corpus_texts() + AWKWARD)


@pytest.mark.parametrize("name", FIXTURE_TOKENIZERS)
def test_special_token_spellings_stay_text(name):
    b = bundle(name)
    text = "<|endoftext|><s></s><|im_start|><|im_end|><|begin_of_text|><|eot_id|><unk>"
    (enc,) = b.encode_spans([text])
    assert not b.vocab.is_special[enc.ids].any()
    assert enc.exact


text_alphabet = st.characters(blacklist_categories=("Cs",))  # lone surrogates cannot be UTF-8
awkward_text = st.lists(
    st.one_of(
        st.text(alphabet=text_alphabet, max_size=12),
        st.sampled_from(["👨‍👩‍👧", "漢字", "e\u0301", "\r\n", "\r", " " * 17, "\n" * 5, "<|endoftext|>", "<s>", "<|im_start|>", "\u200d", "12345"]),
    ),
    max_size=8,
).map("".join)


@pytest.mark.parametrize("name", FIXTURE_TOKENIZERS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=awkward_text)
def test_property_bytes_concatenate_to_source(name, text):
    _check_exact(bundle(name), [text])


def test_roles_and_context_tokens():
    spm = bundle("llama-spm").vocab
    assert spm.family == "sentencepiece" and spm.dummy_prefix
    assert spm.context_token() == spm.roles["bos"] == 1
    gpt2 = bundle("gpt-2").vocab
    assert gpt2.family == "byte_level" and not gpt2.dummy_prefix
    assert gpt2.token_bytes[gpt2.context_token()] == b"" and gpt2.is_special[gpt2.context_token()]
    llama3 = bundle("llama-bpe").vocab
    assert llama3.context_token() == llama3.roles["bos"]
    qwen = bundle("qwen2").vocab
    assert qwen.context_token() == qwen.roles["separator"]
    assert "eot" in qwen.roles


def test_gemma3_has_no_dummy_prefix_and_spells_whitespace_runs():
    """Gemma 3: SentencePiece without a dummy prefix; runs of spaces, newlines and tabs are whole tokens."""
    gemma = bundle("gemma3")
    vocab = gemma.vocab
    assert vocab.family == "sentencepiece" and not vocab.dummy_prefix and vocab.adds_bos
    assert vocab.context_token() == vocab.roles["bos"]
    assert gemma.tokenizer.id_to_token(vocab.roles["eot"]) == "<end_of_turn>"
    (enc,) = gemma.encode_spans(["    return x\n\n\tdone"])
    assert enc.exact
    assert [vocab.token_bytes[i] for i in enc.ids.tolist()] == [b"    ", b"return", b" x", b"\n\n", b"\t", b"done"]
    assert enc.ends.tolist() == [4, 10, 12, 14, 15, 19]


def test_spelling_classes_sum_sentencepiece_byte_pieces():
    """SentencePiece `A` and `<0x41>` spell the same bytes: one spelling class of two ids."""
    vocab = bundle("llama-spm").vocab
    spellings = vocab.spellings()
    assert len(spellings[b"A"]) == 2
    multi = [b for b, ids in spellings.items() if len(ids) > 1]
    assert all(len(b) == 1 for b in multi)
    assert len(multi) > 50


def test_fingerprint_is_stable_and_distinct():
    a = bundle("qwen2").vocab.fingerprint
    assert load_tokenizer(str(tokenizer_path("qwen2"))).vocab.fingerprint == a
    assert len({bundle(n).vocab.fingerprint for n in FIXTURE_TOKENIZERS}) == len(FIXTURE_TOKENIZERS)


def _round_trip_flags_directly(loaded) -> np.ndarray:
    """Whether each non-special added token fails to round-trip through the whole tokenizer (the reference)."""
    tokenizer = loaded.tokenizer
    failed = np.zeros(loaded.vocab.size, dtype=bool)
    for i, token in tokenizer.get_added_tokens_decoder().items():
        if not token.special:
            ok = tokenizer.encode(token.content, add_special_tokens=False).ids == [i]
            failed[i] = not (ok and tokenizer.decode([i], skip_special_tokens=False) == token.content)
    return failed


@pytest.mark.parametrize("name", ["gemma3", "gemma3+added"])
def test_added_token_round_trips_match_the_whole_tokenizer(name, tmp_path):
    """`load_tokenizer` checks added tokens on a small twin of the tokenizer (no merges); the untrusted
    flags must be those of the whole tokenizer. gemma3+added: two more non-special added tokens, one
    that round-trips and one that does not ("x\u2581y" decodes to "x y")."""
    from csd_pipeline.vocab.families import FLAG_UNTRUSTED

    if name == "gemma3":
        loaded = load_tokenizer("gemma3")
        extra = []
    else:
        spec = json.loads((tokenizer_path("gemma3") / "tokenizer.json").read_text(encoding="utf-8"))
        size = 1 + max(max(spec["model"]["vocab"].values()), max(t["id"] for t in spec["added_tokens"]))
        extra = [size, size + 1]
        for i, content in zip(extra, ["<my_tag>", "x\u2581y"]):
            spec["added_tokens"].append({"id": i, "content": content, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": False})
            spec["model"]["vocab"][content] = i
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
        loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.vocab.needs_round_trip
    untrusted = loaded.vocab.flags & FLAG_UNTRUSTED != 0
    added = sorted(i for i, t in loaded.tokenizer.get_added_tokens_decoder().items() if not t.special)
    assert len(added) >= 100
    assert untrusted[added].tolist() == _round_trip_flags_directly(loaded)[added].tolist()
    if extra:
        assert untrusted[extra].tolist() == [False, True]
