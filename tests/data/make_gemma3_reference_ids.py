"""Write `csd_pipeline/fixtures/data/gemma3-reference-ids.json`: Gemma 3 token ids of real text, by transformers.

The project converts the Gemma 3 GGUF vocabulary itself (`csd_pipeline.fixtures.gguf_tokenizer`,
seconds); transformers' own GGUF tokenizer conversion is the independent reference but takes about
a minute here (transformers 5.24.0), so its ids are computed once, here, and stored with their
provenance. `csd-pipeline fixtures` refuses a converted Gemma 3 tokenizer that does not reproduce
them, and tests/test_fixtures.py checks them again.

    python tests/data/make_gemma3_reference_ids.py --gguf-dir DIR [--out FILE]

DIR holds `gemma-3-270m-q4_k_m.gguf` (the fixture cache keeps it under `gguf/`). Every case is
encoded with `add_special_tokens=False, split_special_tokens=True` (corpus text is never parsed
into special tokens, as in the pipeline); the ids with special tokens parsed are kept too where they
differ, and the ids with `add_special_tokens=True` for one case (BOS).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

# Strings that are special tokens or chat delimiters of Gemma 3 and others, written as plain text.
_SPECIAL_LOOKING = (
    "<start_of_turn>user\nWhat is <end_of_turn> for?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><unk><mask>[@BOS@]<unused0><unused99> <start_of_image><end_of_image>",
    "<|im_start|>assistant\n<|endoftext|> [INST] <s></s> <think>x</think>",
)


def _slice(relative: str, characters: int | None = None) -> str:
    text = (HERE / relative).read_text(encoding="utf-8")
    return text if characters is None else text[:characters]


def reference_cases() -> list[dict]:
    """(source, text) of every case, all from files in tests/data (see its README for provenance)."""
    cases = [{"source": "llamacpp-tokenizer-tests.json", "text": text}
             for text in json.loads(_slice("llamacpp-tokenizer-tests.json"))]
    for line in _slice("django-po-multilingual-slice.jsonl").splitlines():
        record = json.loads(line)
        cases.append({"source": f"django-po-multilingual-slice.jsonl ({record['lang']})", "text": record["text"]})
    for line in _slice("chat-awkward.jsonl").splitlines():
        record = json.loads(line)
        for message in record.get("messages", []):
            if isinstance(message.get("content"), str) and message["content"]:
                cases.append({"source": f"chat-awkward.jsonl ({record['case']})", "text": message["content"]})
    cases += [{"source": "written for this file (special tokens as text)", "text": t} for t in _SPECIAL_LOOKING]
    for relative, characters in (
        ("devil-slice.txt", 2000),
        ("botchan-slice.txt", 1000),
        ("kjv-genesis-slice.txt", None),
        ("python-docs-slice.txt", 2000),
        ("cpython-textwrap-slice.txt", None),
    ):
        source = relative if characters is None else f"{relative} (first {characters} characters)"
        cases.append({"source": source, "text": _slice(relative, characters)})
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-dir", required=True, type=Path)
    parser.add_argument("--out", type=Path,
                        default=HERE.parents[1] / "csd_pipeline" / "fixtures" / "data" / "gemma3-reference-ids.json")
    parser.add_argument("--save-tokenizer", type=Path, help="also save transformers' converted tokenizer here")
    args = parser.parse_args()

    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    gguf_file = args.gguf_dir / GGUF_NAME
    sha256 = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf_dir), gguf_file=GGUF_NAME)
    load_seconds = time.monotonic() - started
    if args.save_tokenizer:
        tokenizer.save_pretrained(str(args.save_tokenizer))
    cases = reference_cases()
    for case in cases:
        text = case["text"]
        case["ids"] = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        parsed = tokenizer(text, add_special_tokens=False)["input_ids"]
        if parsed != case["ids"]:
            case["ids_special_parsed"] = parsed
    with_bos = tokenizer("Hello world")["input_ids"]
    content = {
        "what": "Gemma 3 (gemma-3-270m Q4_K_M GGUF) token ids by transformers' own GGUF tokenizer conversion",
        "command": "python tests/data/make_gemma3_reference_ids.py --gguf-dir <fixtures>/gguf",
        "gguf": {"file": GGUF_NAME, "sha256": sha256},
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "python": platform.python_version()},
        "tokenizer_class": type(tokenizer).__name__,
        "conversion_seconds": round(load_seconds, 1),
        "encode": "tokenizer(text, add_special_tokens=False, split_special_tokens=True)['input_ids']",
        "with_special_tokens": {"text": "Hello world", "ids": with_bos},
    }
    # One case per line, so that the file diffs and reads line by line.
    head = json.dumps(content, ensure_ascii=False, indent=1)[:-2]
    lines = ",\n  ".join(json.dumps(case, ensure_ascii=False) for case in cases)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(f'{head},\n "cases": [\n  {lines}\n ]\n}}\n', encoding="utf-8")
    tmp.replace(args.out)
    print(f"{len(cases)} cases, {sum(len(c['ids']) for c in cases)} ids, conversion {load_seconds:.0f} s -> {args.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
