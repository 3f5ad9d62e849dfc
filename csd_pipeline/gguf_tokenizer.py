"""Hugging Face `tokenizer.json` files built directly from the vocabulary fields of a GGUF file.

llama.cpp stores a tokenizer as flat arrays (`tokenizer.ggml.tokens`, `token_type`, `merges` or
`scores`) plus a pre-tokenizer name (`tokenizer.ggml.pre`). This module rebuilds the original
Hugging Face pipeline for the families the fixtures need, and checks the result against the
test vectors llama.cpp ships next to its vocabularies (`ggml-vocab-<name>.gguf.inp/.out`, made
with the original Hugging Face tokenizer and `add_special_tokens=False`).

Two families:
- `gpt2` models (byte-level BPE): the pre-tokenizer comes from a table keyed by
  `tokenizer.ggml.pre`; an unknown name is refused rather than guessed.
- `llama` models (SentencePiece BPE with byte fallback): a normalizer that prepends `▁` and
  replaces spaces by `▁`, no pre-tokenizer, and merges derived from the piece scores.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from csd_pipeline.errors import CsdError

# GGUF token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"

# Split patterns of the original tokenizers (copied from their tokenizer.json files).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": use_regex}


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


@dataclass(frozen=True)
class _ByteLevelRecipe:
    normalizer: dict | None
    pre_tokenizer: dict
    ignore_merges: bool = False


# `tokenizer.ggml.pre` -> the original Hugging Face pipeline of that family.
BYTE_LEVEL_RECIPES = {
    "gpt-2": _ByteLevelRecipe(None, _byte_level(use_regex=True)),
    "llama-bpe": _ByteLevelRecipe(
        None,
        {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_PATTERN), _byte_level(use_regex=False)]},
        ignore_merges=True,
    ),
    "qwen2": _ByteLevelRecipe(
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN2_PATTERN), _byte_level(use_regex=False)]},
    ),
    "smollm": _ByteLevelRecipe(
        None,
        {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)],
        },
    ),
}

# llama.cpp's default `add_bos` for a pre-tokenizer when the GGUF has no
# `tokenizer.ggml.add_bos_token` (src/llama-vocab.cpp): Llama 3 adds BOS, the others do not.
_DEFAULT_ADD_BOS = {"llama-bpe": True}

_ROLE_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass
class GgufVocabulary:
    """The tokenizer fields of one GGUF file."""

    path: Path
    model: str                      # tokenizer.ggml.model: "gpt2" | "llama"
    pre: str                        # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)   # scalar tokenizer.* / context-length fields


def read_gguf_vocabulary(path: str | Path) -> GgufVocabulary:
    """Read the tokenizer fields of a GGUF file (no tensors are loaded).

    Raises CsdError when the file is not a GGUF file or has no tokenizer.
    """
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as err:
        raise CsdError(f"{path} is not a readable GGUF file ({err}); check the path.") from err
    fields = reader.fields

    def value(key, default=None):
        found = fields.get(key)
        return default if found is None else found.contents()

    if "tokenizer.ggml.tokens" not in fields:
        raise CsdError(f"{path} has no tokenizer (no tokenizer.ggml.tokens field); use a GGUF with a vocabulary.")
    architecture = value("general.architecture", "")
    metadata = {
        key: value(key)
        for key in (
            *_ROLE_KEYS.values(),
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token",
            "tokenizer.ggml.add_space_prefix",
            "tokenizer.chat_template",
        )
        if key in fields
    }
    metadata["context_length"] = value(f"{architecture}.context_length")
    return GgufVocabulary(
        path=path,
        model=value("tokenizer.ggml.model", ""),
        pre=value("tokenizer.ggml.pre", "default"),
        tokens=list(value("tokenizer.ggml.tokens")),
        token_types=[int(t) for t in value("tokenizer.ggml.token_type")],
        merges=list(value("tokenizer.ggml.merges", [])),
        scores=[float(s) for s in value("tokenizer.ggml.scores", [])],
        metadata=metadata,
    )


def _is_placeholder(token: str, token_id: int) -> bool:
    # llama.cpp's converter fills ids the HF tokenizer lacks (Qwen pads its embedding to 151,936)
    # with "[PAD<id>]": no text may ever produce them.
    return token == f"[PAD{token_id}]"


def _added_tokens(vocab: GgufVocabulary) -> list[dict]:
    added = []
    for token_id, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            special = kind != USER_DEFINED or _is_placeholder(token, token_id)
            added.append(
                {
                    "id": token_id,
                    "content": token,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": not special,
                    "special": special,
                }
            )
    return added


def add_bos_token(vocab: GgufVocabulary) -> bool:
    """Whether the original tokenizer adds BOS (the GGUF field, else llama.cpp's default)."""
    if "tokenizer.ggml.add_bos_token" in vocab.metadata:
        return bool(vocab.metadata["tokenizer.ggml.add_bos_token"])
    if vocab.model == "llama":
        return True
    return _DEFAULT_ADD_BOS.get(vocab.pre, False)


def _role_token(vocab: GgufVocabulary, role: str) -> str | None:
    token_id = vocab.metadata.get(_ROLE_KEYS[role])
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(vocab.tokens):
        raise CsdError(f"{vocab.path}: {role} id {token_id} is outside the vocabulary; the GGUF is corrupt.")
    return vocab.tokens[int(token_id)]


def _bos_template(bos: str, bos_id: int) -> dict:
    def special(type_id):
        return {"SpecialToken": {"id": bos, "type_id": type_id}}

    def sequence(name, type_id):
        return {"Sequence": {"id": name, "type_id": type_id}}

    return {
        "type": "TemplateProcessing",
        "single": [special(0), sequence("A", 0)],
        "pair": [special(0), sequence("A", 0), special(1), sequence("B", 1)],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def _sentencepiece_merges(vocab: GgufVocabulary) -> list[list[str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging.

    Every normal piece that splits into two normal pieces gives a merge; merges are ranked by the
    score of the merged piece (highest first), then by ids, so the BPE model merges the same pairs
    in the same order as SentencePiece.
    """
    if len(vocab.scores) != len(vocab.tokens):
        raise CsdError(f"{vocab.path}: a SentencePiece vocabulary needs one score per piece; the GGUF is corrupt.")
    ids = {tok: i for i, (tok, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True)) if kind == NORMAL}
    ranked = []
    for piece, piece_id in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[piece_id], piece_id, ids[left], ids[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def build_tokenizer_json(vocab: GgufVocabulary) -> dict:
    """The `tokenizer.json` content of the original Hugging Face tokenizer of `vocab`.

    Raises CsdError for a tokenizer family or pre-tokenizer this module does not know.
    """
    model_vocab = {}
    for token_id, token in enumerate(vocab.tokens):
        if token in model_vocab:
            raise CsdError(
                f"{vocab.path}: token {token!r} appears twice (ids {model_vocab[token]} and {token_id}); "
                "a tokenizer.json vocabulary cannot hold it."
            )
        model_vocab[token] = token_id
    bos = _role_token(vocab, "bos_token")
    post_processors = []
    if vocab.model == "gpt2":
        recipe = BYTE_LEVEL_RECIPES.get(vocab.pre)
        if recipe is None:
            raise CsdError(
                f"{vocab.path}: pre-tokenizer {vocab.pre!r} is not supported; known: "
                f"{', '.join(sorted(BYTE_LEVEL_RECIPES))}."
            )
        normalizer, pre_tokenizer = recipe.normalizer, recipe.pre_tokenizer
        decoder = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        post_processors.append(_byte_level(use_regex=True))
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": recipe.ignore_merges,
            "vocab": model_vocab,
            "merges": [merge.split(" ") for merge in vocab.merges],
        }
    elif vocab.model == "llama":
        normalizer = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        }
        pre_tokenizer = None
        decoder = {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        }
        model = {
            "type": "BPE",
            "dropout": None,
            "unk_token": _role_token(vocab, "unk_token"),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": model_vocab,
            "merges": _sentencepiece_merges(vocab),
        }
    else:
        raise CsdError(
            f"{vocab.path}: tokenizer model {vocab.model!r} is not supported; use a gpt2 (byte-level BPE) "
            "or llama (SentencePiece BPE) vocabulary."
        )
    if add_bos_token(vocab) and bos is not None:
        post_processors.append(_bos_template(bos, vocab.tokens.index(bos)))
    if not post_processors:
        post_processor = None
    elif len(post_processors) == 1:
        post_processor = post_processors[0]
    else:
        post_processor = {"type": "Sequence", "processors": post_processors}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocab),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor,
        "decoder": decoder,
        "model": model,
    }


def build_tokenizer_config(vocab: GgufVocabulary) -> dict:
    """The `tokenizer_config.json` content: special-token names, `add_bos_token`, chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos_token(vocab),
        "add_eos_token": bool(vocab.metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(vocab.metadata.get("context_length") or 0) or None,
    }
    for role in _ROLE_KEYS:
        token = _role_token(vocab, role)
        if token is not None:
            config[role] = token
    if vocab.metadata.get("tokenizer.chat_template"):
        config["chat_template"] = vocab.metadata["tokenizer.chat_template"]
    return config


def save_tokenizer_folder(vocab: GgufVocabulary, folder: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for `vocab` into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / "tokenizer.json", build_tokenizer_json(vocab), indent=None)
    _write_json(folder / "tokenizer_config.json", build_tokenizer_config(vocab), indent=2)


def _write_json(path: Path, content: dict, indent: int | None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, ensure_ascii=False, indent=indent), encoding="utf-8")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------
# llama.cpp test vectors


@dataclass(frozen=True)
class VectorReport:
    """How a tokenizer did on one vector file."""

    total: int
    encode_passed: int
    decode_passed: int
    first_failure: str | None       # the first input whose ids differ, or None

    @property
    def ok(self) -> bool:
        return self.encode_passed == self.total


def read_vectors(inp_path: str | Path, out_path: str | Path) -> list[tuple[str, list[int]]]:
    """Pairs (text, expected ids) from llama.cpp's `.inp` / `.out` vector files.

    Inputs are separated by a line `__ggml_vocab_test__`; each `.out` line holds the ids, separated
    by spaces, that the original tokenizer produced for one input. Raises CsdError when the two
    files disagree in length.
    """
    # Bytes, not text mode: the inputs contain "\r"-free but newline-significant text.
    raw = Path(inp_path).read_bytes().decode("utf-8")
    texts = raw.split(VECTOR_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = Path(out_path).read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise CsdError(
            f"{inp_path} has {len(texts)} inputs but {out_path} has {len(lines)} lines; the vector files are corrupt."
        )
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines, strict=True)]


def _expected_decoding(tokenizer_json: dict, text: str) -> str:
    # A normalizer changes the text for good (Qwen 2 applies NFC); decoding gives the normalized text.
    normalizer = tokenizer_json.get("normalizer") or {}
    return unicodedata.normalize("NFC", text) if normalizer.get("type") == "NFC" else text


def check_vectors(tokenizer_file: str | Path, vectors: list[tuple[str, list[int]]]) -> VectorReport:
    """Encode every vector input (no special tokens added) and compare with the expected ids.

    Also decodes the expected ids and compares with the input text (after the tokenizer's own
    normalization). Returns the counts; the caller decides what a failure means.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    content = json.loads(Path(tokenizer_file).read_text(encoding="utf-8"))
    encode_passed = decode_passed = 0
    first_failure = None
    for text, expected in vectors:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids == expected:
            encode_passed += 1
        elif first_failure is None:
            first_failure = text
        if tokenizer.decode(expected, skip_special_tokens=False) == _expected_decoding(content, text):
            decode_passed += 1
    return VectorReport(len(vectors), encode_passed, decode_passed, first_failure)
