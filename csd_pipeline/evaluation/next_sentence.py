"""Build the project's own lm-evaluation-harness task: pick the real next sentence among four.

For each held-out passage of a public-domain text the repository already carries, the context is
the preceding sentences of the same document (whole sentences, at most `CONTEXT_CHARS` characters)
and the choices are the real next sentence plus three sentences drawn, with a fixed seed, from the
*other* held-out documents of the same text, of similar length (0.5x to 2x the real one's
characters, so length alone gives little away). The answer's position is drawn with the same seed.
Chance is 25%. The output is JSONL, one `{"id", "context", "choices", "label"}` per line, read by
`csd_pipeline/evaluation/tasks/next_sentence/loader.py`.

    python -m csd_pipeline.evaluation.next_sentence            # rewrites the committed JSONL files
    python -m csd_pipeline.evaluation.next_sentence --check    # exit 1 when they differ

Units: *The Devil's Dictionary* is cut into sentences inside paragraphs (a headword such as
`AMBITION, n.` stays with its definition); the King James Bible into verses (numbers dropped).
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from csd_pipeline.errors import CsdError

SEED = 34
CONTEXT_CHARS = 400
MIN_CHARS, MAX_CHARS = 20, 300          # the sentences that may be an answer or a distractor
DISTRACTORS = 3
REPO = Path(__file__).resolve().parents[2]
TASK_DIR = Path(__file__).resolve().parent / "tasks" / "next_sentence"


@dataclass(frozen=True)
class Source:
    """One held-out text: the corpus file, how it is cut into units, and the JSONL it becomes."""

    name: str
    corpus: str          # relative to the repository root
    unit: str            # "sentence" or "verse"
    output: str          # file name inside TASK_DIR


SOURCES = (
    Source("devil", "demo/corpus/devil-heldout.jsonl", "sentence", "devil.jsonl"),
    Source("kjv", "bench/corpus/kjv-heldout.jsonl", "verse", "kjv.jsonl"),
)

# A sentence ends at . ! or ? (a closing quote may follow) before whitespace and a capital or a quote,
# except after a headword's part of speech (`AMBITION, n.`, `ANOINT, v.t.`) or a common abbreviation.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')]?\s+(?=[A-Z\"'(])")
_NOT_AN_END = re.compile(r"^[A-Z][A-Z0-9'\- ]*, (?:[a-z]{1,5}\.\s?)+$|(?:^|\s)(?:e\.g|i\.e|etc|viz|cf|Mr|Mrs|Dr|St)\.$")
_VERSE = re.compile(r"^\s*\d+\s+", re.MULTILINE)


def sentences(document: str) -> list[str]:
    """The sentences of a document, paragraph by paragraph (blank lines), whitespace collapsed."""
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", document):
        text = " ".join(paragraph.split())
        start = 0
        for match in _SENTENCE_END.finditer(text):
            head = text[start:match.start()] + match.group(0).strip()
            if _NOT_AN_END.search(head):
                continue
            out.append(head)
            start = match.end()
        if text[start:]:
            out.append(text[start:])
    return out


def verses(document: str) -> list[str]:
    """The verses of a chapter (`  N text` lines, continued on the following lines), numbers dropped."""
    parts = _VERSE.split(document)
    return [" ".join(part.split()) for part in parts[1:] if part.strip()]


def units(document: str, unit: str) -> list[str]:
    if unit == "sentence":
        return sentences(document)
    if unit == "verse":
        return verses(document)
    raise CsdError(f"unknown unit {unit!r}; use `sentence` or `verse`")


def _eligible(text: str) -> bool:
    return MIN_CHARS <= len(text) <= MAX_CHARS


def _context(previous: list[str]) -> str:
    """The last whole units of `previous` that fit in CONTEXT_CHARS (at least one)."""
    kept: list[str] = []
    for text in reversed(previous):
        if kept and sum(len(t) + 1 for t in kept) + len(text) > CONTEXT_CHARS:
            break
        kept.insert(0, text)
    return " ".join(kept)


def build_items(documents: list[str], unit: str, name: str, seed: int = SEED) -> list[dict]:
    """The multiple-choice items of one text (see the module docstring). Raises CsdError when a real
    sentence has fewer than DISTRACTORS candidates of similar length in the other documents."""
    rng = random.Random(f"{seed}:{name}")
    cut = [units(doc, unit) for doc in documents]
    items = []
    for d, doc_units in enumerate(cut):
        others = sorted({t for e, other in enumerate(cut) if e != d for t in other if _eligible(t)})
        for i in range(1, len(doc_units)):
            answer = doc_units[i]
            if not _eligible(answer):
                continue
            similar = [t for t in others if len(answer) / 2 <= len(t) <= 2 * len(answer) and t != answer]
            if len(similar) < DISTRACTORS:
                raise CsdError(f"{name} document {d} sentence {i}: only {len(similar)} distractors of similar "
                               "length; lower MIN_CHARS or widen the length band")
            choices = rng.sample(similar, DISTRACTORS)
            label = rng.randrange(DISTRACTORS + 1)
            choices.insert(label, answer)
            items.append({"id": f"{name}-{d:02d}-{i:03d}", "context": _context(doc_units[:i]),
                          "choices": choices, "label": label})
    return items


def render(source: Source, repo: Path = REPO) -> str:
    """The JSONL text of one source (one item per line, keys in a fixed order)."""
    path = repo / source.corpus
    if not path.is_file():
        raise CsdError(f"{path} is missing; the task is built from the repository's held-out corpus")
    documents = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    items = build_items(documents, source.unit, source.name)
    return "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale = []
    for source in SOURCES:
        text = render(source)
        target = TASK_DIR / source.output
        if check:
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                stale.append(str(target))
        else:
            target.write_text(text, encoding="utf-8")
            print(f"{target}: {text.count(chr(10))} items")
    if stale:
        print("out of date (run python -m csd_pipeline.evaluation.next_sentence): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
