"""How the multilingual slices beside this file were made (needs the team corpus; the benchmark does not).

The *Debian Reference* 2.100 in six languages (`debian-reference-{en,de,fr,es,ja,zh-cn}.txt`, sections
separated by a form-feed line). Each section is cut at blank lines into documents of at most 3,000
characters (a longer paragraph at 3,000 characters), in order, until `--bytes` UTF-8 bytes per language;
every tenth document (index 9, 19, ...) is held out. Train: de, fr, es, ja, zh (one file per language,
mixed by the trainer); held out: the same five and English (to watch forgetting).

    python bench/corpus/multilingual/make_slices.py --corpus ../shared/corpus --bytes 80000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LANGUAGES = ("de", "fr", "es", "ja", "zh-cn")
LIMIT = 3000


def documents(text: str) -> list[str]:
    out = []
    for section in text.split("\f"):
        section = section.strip("\n")
        piece = ""
        for paragraph in section.split("\n\n"):
            if piece and len(piece) + 2 + len(paragraph) > LIMIT:
                out.append(piece)
                piece = ""
            piece = paragraph if not piece else piece + "\n\n" + paragraph
            while len(piece) > LIMIT:
                out.append(piece[:LIMIT])
                piece = piece[LIMIT:]
        if piece.strip():
            out.append(piece)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--corpus", required=True, type=Path)
    parser.add_argument("--bytes", type=int, default=80000)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    for lang in (*LANGUAGES, "en"):
        text = (args.corpus / f"debian-reference-{lang}.txt").read_text(encoding="utf-8")
        used, parts = 0, {"train": [], "heldout": []}
        for i, doc in enumerate(documents(text)):
            if used >= args.bytes:
                break
            used += len(doc.encode())
            parts["heldout" if i % 10 == 9 else "train"].append(json.dumps({"text": doc}, ensure_ascii=False))
        for part, lines in parts.items():
            if part == "train" and lang == "en":
                continue
            (here / f"{part}-{lang}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
