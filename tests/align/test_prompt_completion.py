"""Prompt/completion records in text mode (align/prompt_completion.py): the loss-masked student tokens
spell exactly the completion's bytes, no KD chunk touches the prompt, with real tokenizers.

The reference is independent of the aligner: the completion's bytes from the record, and the
chunk byte ranges recomputed from the row's own token bytes and chunk lengths."""

from __future__ import annotations

import functools
import json

import pytest

from csd_pipeline.align.corpus import Document, ReadOptions
from csd_pipeline.align.corpus.documents import jsonl_document
from csd_pipeline.align.text_mode import TextAligner
from csd_pipeline.vocab.vocabulary import load_tokenizer
from schemas.aligned import ChunkStatus, teacher_columns

load_bundle = functools.cache(load_tokenizer)

# Boundaries that fall inside a word, after a space, before a space, inside a multi-byte character
# run, and at a newline: some have a whole-text token boundary, some do not.
CASES = [
    ("The Devil's Dictionary defines ABSURDITY as a statement or belief manifestly", " inconsistent with one's own opinion."),
    ("ACADEME, n.  An ancient school where morality and philoso", "phy were taught."),
    ("Café au lait, crème brûlée and naïve ", "résumés: ça va, «très» bien — 東京 and 🎉 too.\n"),
    ("def add(a, b):\n    return a +", " b\n\nprint(add(1, 2))\n"),
    ("  indented prompt with trailing spaces   ", "   and a completion that starts with spaces"),
    ("x", "y"),
]
# llama-bpe <- qwen2 (the two large vocabularies) runs in the full tier only
PAIRS = [("llama-spm", "smollm2"), ("smollm2", "llama-spm"), ("qwen2", "gpt-2"),
         pytest.param("llama-bpe", "qwen2", marks=pytest.mark.slow)]


def _documents():
    return [Document("pc.jsonl", i, p + c, prompt_bytes=len(p.encode("utf-8"))) for i, (p, c) in enumerate(CASES)]


@pytest.mark.parametrize("student,teacher", PAIRS)
def test_loss_mask_is_exactly_the_completion(student, teacher, tokenizer_path):
    s, t = load_bundle(str(tokenizer_path(student))), load_bundle(str(tokenizer_path(teacher)))
    aligner = TextAligner(s, [t], 4096, [4096], True)
    stats = aligner.new_stats()
    rows = aligner.align_documents(_documents(), stats).to_pylist()
    assert [r["record_index"] for r in rows] == list(range(len(CASES)))  # one window each, none dropped
    ids_col, len_s_col, len_t_col, status_col = teacher_columns(0)
    for row in rows:
        prompt, completion = CASES[row["record_index"]]
        text, prompt_end = row["text"].encode("utf-8"), len(prompt.encode("utf-8"))
        assert row["text"] == prompt + completion
        masked = [i for i, m in zip(row["student_ids"], row["student_loss_mask"], strict=True) if m]
        assert b"".join(s.vocab.token_bytes[i] for i in masked) == completion.encode("utf-8")
        s_pieces, t_pieces = _pieces(s, row["student_ids"][1:], text), _pieces(t, row[ids_col][1:], text)
        assert b"".join(s_pieces) == text and b"".join(t_pieces) == text  # each side spells prompt + completion
        s_pos, t_pos, start, seen_completion = 1, 1, 0, False
        for m, n, status in zip(row[len_s_col][1:], row[len_t_col][1:], row[status_col][1:], strict=True):
            s_run, t_run = b"".join(s_pieces[s_pos - 1:s_pos - 1 + m]), b"".join(t_pieces[t_pos - 1:t_pos - 1 + n])
            assert s_run == t_run  # chunks cover the same bytes on both sides
            end = start + len(s_run)
            if end <= prompt_end:
                assert status == ChunkStatus.OUTSIDE_LOSS_REGION, (row["text"], status)
            else:
                assert start >= prompt_end, f"a chunk straddles the prompt end: {row['text']!r} [{start}, {end})"
                assert status != ChunkStatus.OUTSIDE_LOSS_REGION
                seen_completion |= status == ChunkStatus.ACCEPTED
            s_pos, t_pos, start = s_pos + m, t_pos + n, end
        assert seen_completion and start == len(text)
    counts = stats["teacher0"]["chunk_status"]
    assert counts["OUTSIDE_LOSS_REGION"] > 0 and counts["ACCEPTED"] > 0


def test_prompt_only_windows_are_dropped_and_counted(tokenizer_path):
    s, t = load_bundle(str(tokenizer_path("llama-spm"))), load_bundle(str(tokenizer_path("smollm2")))
    prompt = "The Devil's Dictionary. " * 20
    document = Document("pc.jsonl", 0, prompt + "END of it.", prompt_bytes=len(prompt))
    aligner = TextAligner(s, [t], 32, [32], True)
    stats = aligner.new_stats()
    rows = aligner.align_documents([document], stats).to_pylist()
    assert stats["prompt_completion"]["prompt_only_windows"] > 0
    masked = b"".join(s.vocab.token_bytes[i] for r in rows
                      for i, m in zip(r["student_ids"], r["student_loss_mask"], strict=True) if m)
    assert masked == b"END of it."
    assert all(any(r["student_loss_mask"]) for r in rows)


def test_records_become_prompt_completion_documents():
    options = ReadOptions()
    line = json.dumps({"prompt": "Café ", "completion": "au lait", "source": "x"}).encode()
    document = jsonl_document("g.jsonl", 3, line, options)
    assert (document.text, document.prompt_bytes) == ("Café au lait", len("Café ".encode()))
    empty = jsonl_document("g.jsonl", 4, json.dumps({"prompt": "a", "completion": ""}).encode(), options)
    assert empty.reason == "empty_completion"
    plain = jsonl_document("g.jsonl", 5, json.dumps({"text": "t", "completion": "c"}).encode(), options)
    assert (plain.text, plain.prompt_bytes) == ("t", None)  # a text field wins: an ordinary document


def _pieces(bundle, ids, text: bytes) -> list[bytes]:
    """Each token's bytes, the first one without a SentencePiece dummy-prefix space."""
    pieces = [bundle.vocab.token_bytes[i] for i in ids]
    if bundle.vocab.dummy_prefix and b"".join(pieces) == b" " + text:
        pieces[0] = pieces[0][1:]
    return pieces
