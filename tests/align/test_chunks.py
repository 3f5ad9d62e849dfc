"""The alignment core (csd_pipeline/align/chunks.py) against brute-force references.

- golden cases on hand-built vocabularies (`He|llo` vs `Hello` is 2:1, an emoji split into byte
  pieces differently on each side is one chunk, zero-width tokens, dummy prefix, mismatches);
- hypothesis: random byte strings cut into random tokens on both sides, compared with a pure-Python
  reference chunker; windows fit their limits, cover the text, and cut only at common boundaries;
- hypothesis on real tokenizer pairs (Llama 3 / Qwen2, Llama 2 / GPT-2, SmolLM2 / Llama 2) and
  awkward text: rows are checked by `check_rows`, an independent reference that re-tokenizes the
  text with the tokenizer (non-batched) and rebuilds the chunks from the vocabularies' token bytes.
"""

from __future__ import annotations

import bisect
import os
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from csd_pipeline.align.chunks import align, cut_windows, ragged_arange, segment_sums, token_spans
from csd_pipeline.align.corpus import Document
from csd_pipeline.vocab.families import FLAG_UNTRUSTED
from csd_pipeline.vocab.vocabulary import Vocabulary
from schemas.aligned import ChunkStatus

# ---------------------------------------------------------------------------------------------
# Hand-built vocabularies


def toy_vocab(pieces, *, dummy_prefix=False, untrusted=()) -> Vocabulary:
    token_bytes = [p if isinstance(p, bytes) else p.encode("utf-8") for p in pieces]
    flags = np.zeros(len(token_bytes), dtype=np.uint8)
    for i in untrusted:
        flags[i] = FLAG_UNTRUSTED
    return Vocabulary("toy", "byte_level", token_bytes, flags, {}, dummy_prefix, "fp")


def batch(texts):
    encoded = [t.encode("utf-8") if isinstance(t, str) else t for t in texts]
    doc_bytes = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=doc_bytes[1:])
    return np.frombuffer(b"".join(encoded), dtype=np.uint8), doc_bytes


def spans(vocab, token_lists, src, doc_bytes):
    ids = np.asarray([i for tokens in token_lists for i in tokens], dtype=np.int32)
    offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in token_lists], out=offsets[1:])
    return token_spans(vocab, ids, offsets, src, doc_bytes)


def chunks_of(table, doc=0):
    lo, hi = table.doc_chunks[doc], table.doc_chunks[doc + 1]
    return list(zip(table.student_len[lo:hi].tolist(), table.teacher_len[lo:hi].tolist(),
                    table.status[lo:hi].tolist(), strict=True))


# ---------------------------------------------------------------------------------------------
# Golden cases


def test_hello_split_against_whole_is_one_2_to_1_chunk():
    student = toy_vocab(["He", "llo", "Hello"])
    teacher = toy_vocab(["Hello", "He"])
    src, doc_bytes = batch(["Hello"])
    table = align(src, doc_bytes, spans(student, [[0, 1]], src, doc_bytes), spans(teacher, [[0]], src, doc_bytes))
    assert chunks_of(table) == [(2, 1, ChunkStatus.ACCEPTED)]


def test_emoji_split_into_different_byte_pieces_is_one_chunk():
    grin = "😀".encode()  # f0 9f 98 80
    student = toy_vocab([grin[:2], grin[2:], b" ok"])
    teacher = toy_vocab([grin[:1], grin[1:], b" ok"])
    src, doc_bytes = batch(["😀 ok"])
    table = align(src, doc_bytes, spans(student, [[0, 1, 2]], src, doc_bytes), spans(teacher, [[0, 1, 2]], src, doc_bytes))
    assert chunks_of(table) == [(2, 2, ChunkStatus.ACCEPTED), (1, 1, ChunkStatus.ACCEPTED)]


def test_shapes_and_zero_width_tokens_join_the_following_chunk():
    student = toy_vocab(["a", "b", "c", "ab", "", "bc"])
    teacher = toy_vocab(["a", "b", "c", "ab", "bc"])
    src, doc_bytes = batch(["abcabc"])
    # student: a | (zero-width) b c | ab | c ; teacher: ab | c | a | bc
    s = spans(student, [[0, 4, 1, 2, 3, 2]], src, doc_bytes)
    t = spans(teacher, [[3, 2, 0, 4]], src, doc_bytes)
    assert s.exact.all() and t.exact.all()
    table = align(src, doc_bytes, s, t)
    # "ab" = a + (zero-width) + b: 3 student tokens vs 1; "c" 1:1; "abc" = ab c vs a bc: 2:2.
    assert chunks_of(table) == [(3, 1, 0), (1, 1, 0), (2, 2, 0)]


def test_dummy_prefix_first_chunk_is_marked_and_excluded_from_the_source():
    spm = toy_vocab([" Hello", " world", "Hello", " "], dummy_prefix=True)
    plain = toy_vocab(["Hello", " world"])
    src, doc_bytes = batch(["Hello world", "Hello"])
    s = spans(spm, [[0, 1], [3, 2]], src, doc_bytes)  # doc 1: a lone dummy space, then "Hello"
    t = spans(plain, [[0, 1], [0]], src, doc_bytes)
    assert s.exact.all() and s.dummy.all()
    table = align(src, doc_bytes, s, t)
    assert chunks_of(table, 0) == [(1, 1, ChunkStatus.DUMMY_PREFIX), (1, 1, ChunkStatus.ACCEPTED)]
    assert chunks_of(table, 1) == [(2, 1, ChunkStatus.DUMMY_PREFIX)]


def test_untrusted_tokens_and_mismatches_are_counted_not_accepted():
    student = toy_vocab(["ab", "cd", "<weird>"], untrusted=[2])
    teacher = toy_vocab(["ab", "cd", "XY", "c d"])
    src, doc_bytes = batch(["abcd", "abcd", "ab<weird>"])
    s = spans(student, [[0, 1], [0, 1], [0, 2]], src, doc_bytes)
    t = spans(teacher, [[0, 1], [0, 3], [0, 2]], src, doc_bytes)
    # Document 1: the teacher spells "abc d" (a normalizer-like change): ends come from offsets.
    assert not t.exact[1]
    t.set_ends(1, np.array([2, 4]), doc_bytes)
    # Document 2: the teacher spells "abXY" where the source has "ab<weird>".
    t.set_ends(2, np.array([2, 9]), doc_bytes)
    table = align(src, doc_bytes, s, t)
    assert chunks_of(table, 0) == [(1, 1, 0), (1, 1, 0)]
    assert chunks_of(table, 1) == [(1, 1, 0), (1, 1, ChunkStatus.WHITESPACE_GAP_WITHOUT_SOURCE)]
    assert chunks_of(table, 2) == [(1, 1, 0), (1, 1, ChunkStatus.UNTRUSTED_TOKEN)]


def test_false_boundary_from_offsets_is_merged_when_the_union_spells_the_source():
    # The teacher spells "Hello " + "world" + " X" where the source says "Hello world é": the document is
    # not exact, so its ends come from (trimmed) offsets, which put a false boundary at 5.
    student = toy_vocab(["Hello", " world", " é"])
    teacher = toy_vocab(["Hello ", "world", " X"])
    src, doc_bytes = batch(["Hello world é", "Hello world"])
    s = spans(student, [[0, 1, 2], [0, 1]], src, doc_bytes)
    t = spans(teacher, [[0, 1, 2], [0, 2]], src, doc_bytes)
    assert s.exact.all() and not t.exact.any()
    t.set_ends(0, np.array([5, 11, 14]), doc_bytes)
    t.set_ends(1, np.array([5, 11]), doc_bytes)
    table = align(src, doc_bytes, s, t)
    # "Hello" / "Hello " and " world" / "world" fail alone but their union spells the source on both sides.
    assert chunks_of(table, 0) == [(2, 2, ChunkStatus.ACCEPTED), (1, 1, ChunkStatus.MISMATCH)]
    # Without a verifying union: a whitespace-only difference, then a real mismatch (" world" vs " X").
    assert chunks_of(table, 1) == [(1, 1, ChunkStatus.WHITESPACE_GAP_WITHOUT_SOURCE), (1, 1, ChunkStatus.MISMATCH)]


def test_windows_cut_at_common_boundaries_and_reject_overlong_regions():
    vocab = toy_vocab(["a", "b", "ab", "abab"])
    src, doc_bytes = batch(["abababab", "ab"])
    s = spans(vocab, [[0, 1] * 4, [2]], src, doc_bytes)  # a b a b a b a b
    t = spans(vocab, [[3, 3], [2]], src, doc_bytes)  # abab abab
    table = align(src, doc_bytes, s, t)
    assert chunks_of(table, 0) == [(4, 1, 0), (4, 1, 0)]
    windows = cut_windows(src, doc_bytes, [table], 5, [5], [True, True])
    assert windows.byte_range.tolist() == [[0, 4], [4, 8], [8, 10]]
    assert windows.window_index.tolist() == [0, 1, 0]
    assert windows.student_range.tolist() == [[0, 4], [4, 8], [8, 9]]
    assert windows.teacher_ranges[0].tolist() == [[0, 1], [1, 2], [2, 3]]
    # A 4-token chunk does not fit 4 tokens plus the context token: both regions are rejected.
    small = cut_windows(src, doc_bytes, [table], 4, [4], [True, True])
    assert small.byte_range.tolist() == [[8, 10]]
    assert small.rejected_regions == 2 and small.rejected_bytes == 8 and small.rejected_docs.tolist() == [0]


def test_windows_never_cut_inside_a_character():
    e_acute = "é".encode()  # c3 a9: both sides split it the same way, so 1 is a common boundary
    vocab = toy_vocab([e_acute[:1], e_acute[1:], "x"])
    src, doc_bytes = batch(["éx"])
    s = spans(vocab, [[0, 1, 2]], src, doc_bytes)
    table = align(src, doc_bytes, s, s)
    assert table.bounds.tolist() == [0, 1, 2, 3]
    windows = cut_windows(src, doc_bytes, [table], 2, [2], [True, True])
    # A cut at byte 1 would split the character: the first region (2 chunks, 2 tokens) cannot fit 1.
    assert windows.byte_range.tolist() == [[2, 3]] and windows.rejected_bytes == 2


# ---------------------------------------------------------------------------------------------
# Brute-force reference on random token streams


def reference_chunks(s_pieces: list[bytes], t_pieces: list[bytes]) -> list[tuple[int, int]]:
    """(M, N) per chunk, pure Python: chunk boundaries are the positions where both sides end a
    non-empty token; a zero-width token belongs to the chunk after its position."""
    def ends(pieces):
        out, pos = [], 0
        for p in pieces:
            pos += len(p)
            out.append(pos)
        return out

    s_ends, t_ends = ends(s_pieces), ends(t_pieces)
    common = sorted({e for e, p in zip(s_ends, s_pieces) if p} & {e for e, p in zip(t_ends, t_pieces) if p})
    counts = [[0, 0] for _ in common]

    def assign(pieces, ends_, side):
        for piece, end in zip(pieces, ends_):
            start = end - len(piece)
            c = bisect.bisect_left(common, end) if piece else bisect.bisect_right(common, start)
            counts[min(c, len(common) - 1)][side] += 1

    assign(s_pieces, s_ends, 0)
    assign(t_pieces, t_ends, 1)
    return [tuple(c) for c in counts]


@st.composite
def segmented_docs(draw):
    docs = []
    for _ in range(draw(st.integers(1, 4))):
        text = draw(st.binary(min_size=1, max_size=24))
        sides = []
        for _side in range(2):
            cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 3)))
            points = [0, *cuts, len(text)]
            sides.append([text[a:b] for a, b in zip(points, points[1:])])
        docs.append((text, sides[0], sides[1]))
    return docs


@settings(max_examples=300, deadline=None)
@given(segmented_docs())
def test_random_segmentations_match_the_reference(docs):
    s_vocab = sorted({p for _, s, _ in docs for p in s})
    t_vocab = sorted({p for _, _, t in docs for p in t})
    src, doc_bytes = batch([text for text, _, _ in docs])
    s = spans(toy_vocab(s_vocab), [[s_vocab.index(p) for p in s_] for _, s_, _ in docs], src, doc_bytes)
    t = spans(toy_vocab(t_vocab), [[t_vocab.index(p) for p in t_] for _, _, t_ in docs], src, doc_bytes)
    assert s.exact.all() and t.exact.all()
    table = align(src, doc_bytes, s, t)
    for d, (_, s_pieces, t_pieces) in enumerate(docs):
        want = reference_chunks(s_pieces, t_pieces)
        assert [(m, n) for m, n, _ in chunks_of(table, d)] == want
        assert all(status == ChunkStatus.ACCEPTED for _, _, status in chunks_of(table, d))
    # Windows: within limits, in order, at common boundaries, covering what is not rejected.
    limit = 4
    windows = cut_windows(src, doc_bytes, [table], limit, [limit], [True, True])
    spans_ = windows.student_range[:, 1] - windows.student_range[:, 0]
    assert (spans_ + 1 <= limit).all()
    assert (windows.teacher_ranges[0][:, 1] - windows.teacher_ranges[0][:, 0] + 1 <= limit).all()
    covered = int((windows.byte_range[:, 1] - windows.byte_range[:, 0]).sum())
    assert covered + windows.rejected_bytes == len(src)
    assert set(windows.byte_range.ravel().tolist()) <= set(table.bounds.tolist())
    assert (np.diff(windows.byte_range[:, 0]) > 0).all()


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=20))
def test_ragged_arange_and_segment_sums(pairs):
    starts = np.array([p[0] for p in pairs], dtype=np.int64)
    lengths = np.array([p[1] for p in pairs], dtype=np.int64)
    want = [i for s, n in pairs for i in range(s, s + n)]
    assert ragged_arange(starts, lengths).tolist() == want
    values = np.arange(60)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if bounds[-1] <= 60:
        assert segment_sums(values, bounds).tolist() == [int(values[a:b].sum()) for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------------------------------------
# Real tokenizer pairs, awkward text

# More examples for a long local run: CSD_ALIGN_EXAMPLES=1000 pytest tests/align/test_chunks.py
EXAMPLES = int(os.environ.get("CSD_ALIGN_EXAMPLES", "40"))
PAIRS = [("llama-bpe", "qwen2"), ("llama-spm", "gpt-2"), ("smollm2", "llama-spm")]

FRAGMENTS = [
    "Hello", " world", "the quick brown fox", "Äpfel", "😀", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👍🏽", "🦙.cpp", "漢字", "我想在apple工作",
    "中文字符，", "한국어", "e\u0301", "a\u0308", "Ame\u0301lie", "שלום", "مرحبا", "\u200f", "\r\n", "\r", "\n", "\n\n\n",
    " " * 7, " " * 40, "\t\t", "<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>", "\ufeff",
    "\u200b", "\u200d", "\x00", "3333", "2026-11-30", "' era", "!!!!!!", "Cửa Việt", " (", "\n =", "ied 4 ½ months",
]


def awkward_texts():
    return st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=12).map("".join)


@cache
def aligner(student: str, teacher: str, max_tokens: int = 4096):
    from csd_pipeline.align.text_mode import TextAligner
    from csd_pipeline.fixtures.names import tokenizer_path
    from csd_pipeline.vocab.vocabulary import load_tokenizer

    s = load_tokenizer(str(tokenizer_path(student)))
    t = load_tokenizer(str(tokenizer_path(teacher)))
    return TextAligner(s, [t], max_tokens, [max_tokens], True)


def _pieces(vocab, ids, text_bytes):
    """Token bytes of `ids`, with a SentencePiece dummy-prefix space removed from the first token."""
    pieces = [vocab.token_bytes[i] for i in ids]
    dummy = vocab.dummy_prefix and pieces and b"".join(pieces) == b" " + text_bytes and pieces[0][:1] == b" "
    if dummy:
        pieces[0] = pieces[0][1:]
    return pieces, bool(dummy)


def check_rows(aligner_, documents, table) -> None:
    """Reference check of aligned rows (one window per document expected)."""
    rows = table.to_pylist()
    assert [r["row_id"] for r in rows] == [f"{d.source}:{d.record_index}:0" for d in documents]
    for document, row in zip(documents, rows, strict=True):
        text_bytes = document.text.encode("utf-8")
        assert row["text"] == document.text and row["byte_start"] == 0
        sides = []
        for bundle, ids, ctx in ((aligner_.student, row["student_ids"], aligner_.context[0]),
                                 (aligner_.teachers[0], row["teacher0_ids"], aligner_.context[1])):
            assert ids[0] == ctx
            # No special token is ever parsed from the text (it may spell `<|endoftext|>`, `<s>`, ...).
            assert not bundle.vocab.is_special[np.asarray(ids[1:], dtype=np.int64)].any()
            # The batch tokenization equals a plain, single-text tokenization.
            assert ids[1:] == bundle.tokenizer.encode(document.text, add_special_tokens=False).ids
            sides.append(_pieces(bundle.vocab, ids[1:], text_bytes))
        (s_pieces, s_dummy), (t_pieces, t_dummy) = sides
        m, n, status = row["teacher0_chunk_student_len"], row["teacher0_chunk_teacher_len"], row["teacher0_chunk_status"]
        assert (m[0], n[0], status[0]) == (1, 1, ChunkStatus.SPECIAL)
        assert sum(m) == len(row["student_ids"]) and sum(n) == len(row["teacher0_ids"])
        assert row["student_loss_mask"] == [False] + [True] * len(s_pieces)
        exact = b"".join(s_pieces) == text_bytes and b"".join(t_pieces) == text_bytes
        flagged_s = [bool(aligner_.student.vocab.flags[i]) for i in row["student_ids"][1:]]
        flagged_t = [bool(aligner_.teachers[0].vocab.flags[i]) for i in row["teacher0_ids"][1:]]
        s_pos = t_pos = 0
        for k, (mm, nn, code) in enumerate(zip(m[1:], n[1:], status[1:], strict=True)):
            s_run, t_run = s_pieces[s_pos:s_pos + mm], t_pieces[t_pos:t_pos + nn]
            if code in (ChunkStatus.ACCEPTED, ChunkStatus.DUMMY_PREFIX):
                assert b"".join(s_run) == b"".join(t_run)
                assert not any(flagged_s[s_pos:s_pos + mm]) and not any(flagged_t[t_pos:t_pos + nn])
                # Minimality: no common boundary strictly inside the chunk.
                s_cum = {sum(len(p) for p in s_run[:i]) for i in range(1, mm) if s_run[i - 1]}
                t_cum = {sum(len(p) for p in t_run[:j]) for j in range(1, nn) if t_run[j - 1]}
                total = len(b"".join(s_run))
                assert not {c for c in s_cum & t_cum if 0 < c < total}
            if code == ChunkStatus.DUMMY_PREFIX:
                assert k == 0 and (s_dummy or t_dummy)
            s_pos, t_pos = s_pos + mm, t_pos + nn
        if exact:
            # Both sides spell the text: the chunks must be exactly the reference chunks.
            assert list(zip(m[1:], n[1:])) == reference_chunks(s_pieces, t_pieces)
            want = [ChunkStatus.ACCEPTED] * (len(m) - 1)
            if s_dummy or t_dummy:
                want[0] = ChunkStatus.DUMMY_PREFIX
            s_pos = t_pos = 0
            for k, (mm, nn) in enumerate(zip(m[1:], n[1:])):
                if any(flagged_s[s_pos:s_pos + mm]) or any(flagged_t[t_pos:t_pos + nn]):
                    want[k] = ChunkStatus.UNTRUSTED_TOKEN
                s_pos, t_pos = s_pos + mm, t_pos + nn
            assert status[1:] == want


@pytest.mark.parametrize("pair", [pytest.param(PAIRS[0], marks=pytest.mark.slow), *PAIRS[1:]],
                         ids=lambda p: f"{p[0]}~{p[1]}")
def test_real_pairs_on_awkward_text(pair, tokenizer_path):
    aligner_ = aligner(*pair)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(awkward_texts(), min_size=1, max_size=4))
    def run(texts):
        documents = [Document("awkward", i, text) for i, text in enumerate(texts)]
        table = aligner_.align_documents(documents, aligner_.new_stats())
        check_rows(aligner_, documents, table)

    run()


def test_real_pairs_on_golden_and_corpus_text(tokenizer_path):
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    texts = [
        (data / "devil-slice.txt").read_text(encoding="utf-8")[:2000],
        (data / "botchan-slice.txt").read_text(encoding="utf-8")[:2000],
        "Hello", "e\u0301t\u00e9 na\u0308ive", " leading space", "  two", "\ufeffBOM", "x" + " " * 300 + "y" + "\n" * 50,
    ]
    documents = [Document("golden", i, text) for i, text in enumerate(texts)]
    for pair in PAIRS:
        aligner_ = aligner(*pair)
        stats = aligner_.new_stats()
        table = aligner_.align_documents(documents, stats)
        check_rows(aligner_, documents, table)
        assert stats["teacher0"]["chunk_status"]["ACCEPTED"] > 500
        # Batching never changes a row: one batch equals one document at a time.
        import pyarrow as pa

        alone = pa.concat_tables([aligner_.align_documents([d], aligner_.new_stats()) for d in documents])
        assert alone.equals(table)
    # Qwen2 normalizes to NFC: decomposed accents cannot be spelled by it and are counted as mismatches,
    # while the rest of the document still aligns.
    aligner_ = aligner("llama-bpe", "qwen2")
    stats = aligner_.new_stats()
    table = aligner_.align_documents([Document("nfc", 0, "caf" + "e\u0301" + " is open today")], stats)
    status = table.column("teacher0_chunk_status")[0].as_py()
    assert ChunkStatus.MISMATCH in status and status.count(ChunkStatus.ACCEPTED) >= 3
    # Llama 2 adds a dummy prefix: the first chunk says so.
    aligner_ = aligner("llama-spm", "gpt-2")
    table = aligner_.align_documents([Document("spm", 0, "Hello world")], aligner_.new_stats())
    assert table.column("teacher0_chunk_status")[0].as_py()[:2] == [ChunkStatus.SPECIAL, ChunkStatus.DUMMY_PREFIX]
