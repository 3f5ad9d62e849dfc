"""The project's next-sentence task: the committed JSONL is what the seeded builder makes, and each item
is what docs/EVALUATION.md says (the real next unit of the same document among four, chance 25%)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from csd_pipeline.evaluation import next_sentence as ns


def _items(source):
    path = ns.TASK_DIR / source.output
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_committed_files_are_what_the_builder_makes():
    assert ns.main(["--check"]) == 0


def test_a_headword_stays_with_its_definition_and_verses_lose_their_numbers():
    assert ns.sentences("ANOINT, v.t.  To grease a king.\nSee also OIL.\n\nAPHORISM, n.  Predigested wisdom.") == [
        "ANOINT, v.t. To grease a king.", "See also OIL.", "APHORISM, n. Predigested wisdom."]
    assert ns.verses("Job 30\n\n  1 But now they\nthat are younger.\n  2 Yea, whereto?\n") == [
        "But now they that are younger.", "Yea, whereto?"]


@pytest.mark.parametrize("source", ns.SOURCES, ids=[s.name for s in ns.SOURCES])
def test_each_item_holds_the_real_next_unit_among_three_from_other_documents(source):
    documents = [json.loads(line)["text"] for line in (ns.REPO / source.corpus).read_text().splitlines()]
    cut = [ns.units(doc, source.unit) for doc in documents]
    items = _items(source)
    assert len(items) >= 50
    for item in items:
        d, i = (int(part) for part in item["id"].split("-")[1:])
        choices, label = item["choices"], item["label"]
        assert len(choices) == 4 and len(set(choices)) == 4 and 0 <= label < 4
        assert choices[label] == cut[d][i]
        assert item["context"].endswith(cut[d][i - 1]) and len(item["context"]) <= max(ns.CONTEXT_CHARS, len(cut[d][i - 1]))
        elsewhere = {t for e, units in enumerate(cut) if e != d for t in units}
        assert all(c in elsewhere for k, c in enumerate(choices) if k != label)
    # the answer's position is uniform enough that always picking one position stays near chance (25%)
    positions = Counter(item["label"] for item in items)
    assert all(0.15 < positions[k] / len(items) < 0.35 for k in range(4)), positions
