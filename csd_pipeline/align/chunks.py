"""Chunk alignment of two token streams from token bytes (SPEC §4), vectorised over a batch.

A batch is several documents laid end to end: `src` holds their UTF-8 bytes back to back and
`doc_bytes[d]:doc_bytes[d+1]` is document d. Each side (a tokenizer) gives its content token ids
per document. Everything below works on whole-batch numpy arrays, so the cost per token is a few
array operations, whatever the number or size of documents.

1. `token_spans`: every token's byte length comes from a lookup array of the vocabulary, the
   byte ends from a cumulative sum, and each document's spelled bytes (a gather from the
   vocabulary's flat byte array) are compared with its source bytes. A document whose bytes match
   is *exact*; SentencePiece's dummy-prefix space is recognised and kept out of the source. A
   document that does not match (a normalizer changed the text) gets its ends from the caller
   (character offsets), and every chunk in it is verified byte by byte.
2. `align`: common boundaries are byte positions where both sides end a (non-empty) token;
   chunks are the runs between consecutive common boundaries, so they are minimal. Zero-width
   tokens belong to the chunk that follows them. Chunk statuses (schemas.aligned.ChunkStatus)
   say which chunks are CSD events. Where offsets put a false boundary (whitespace trimmed out of
   offsets, a character split by byte pieces), consecutive failing chunks are merged when their
   union spells the source exactly on both sides.
3. `cut_windows`: documents longer than the window limits are cut at boundaries common to every
   teacher's chunks and at UTF-8 character starts; a single chunk run longer than a limit is a
   rejected region, counted, never truncated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.aligned import ChunkStatus

# A run of failing chunks is merged at most this many chunks at a time (offset repair is local).
MAX_MERGE = 16
_WHITESPACE = b" \t\n\r\f\v"


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of `arange(s, s + n)` for every (s, n); int64."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    exclusive = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - exclusive, lengths)


def segment_sums(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Sums of `values[bounds[i]:bounds[i+1]]` (empty segments allowed)."""
    cum = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=cum[1:])
    return cum[bounds[1:]] - cum[bounds[:-1]]


@dataclass
class SideSpans:
    """One tokenizer's content tokens over a batch, with byte spans in batch coordinates.

    Token i covers source bytes `[ends[i-1], ends[i])` (the first token of a document starts at the
    document start). `lengths`/`byte_offsets` locate the bytes each token spells in the vocabulary's
    flat byte array (after removing a dummy-prefix space).
    """

    ids: np.ndarray  # int32 [n]
    doc_tokens: np.ndarray  # int64 [D+1] token offsets of each document
    ends: np.ndarray  # int64 [n] exclusive byte end of each token, batch coordinates
    exact: np.ndarray  # bool [D] the document's token bytes are its source bytes
    dummy: np.ndarray  # bool [D] the document's first token carries a dummy-prefix space
    flagged: np.ndarray  # bool [n] special or untrusted token (never a spelling)
    lengths: np.ndarray  # int64 [n] bytes each token spells
    byte_offsets: np.ndarray  # int64 [n] where those bytes start in `flat`
    flat: np.ndarray  # uint8, the vocabulary's bytes back to back

    def spelled(self, first: int, last: int) -> bytes:
        """The bytes spelled by tokens `[first, last)`."""
        idx = ragged_arange(self.byte_offsets[first:last], self.lengths[first:last])
        return self.flat[idx].tobytes()

    def set_ends(self, doc: int, local_ends: np.ndarray, doc_bytes: np.ndarray) -> None:
        """Replace document `doc`'s ends with `local_ends` (document coordinates, e.g. from offsets)."""
        lo, hi = self.doc_tokens[doc], self.doc_tokens[doc + 1]
        if len(local_ends) != hi - lo:
            raise ValueError(f"document {doc}: {len(local_ends)} ends for {hi - lo} tokens")
        size = doc_bytes[doc + 1] - doc_bytes[doc]
        local = np.maximum.accumulate(np.clip(np.asarray(local_ends, dtype=np.int64), 0, size)) if hi > lo else local_ends
        self.ends[lo:hi] = local + doc_bytes[doc]


def token_spans(vocab, ids: np.ndarray, doc_tokens: np.ndarray, src: np.ndarray, doc_bytes: np.ndarray) -> SideSpans:
    """Byte spans of a batch of documents' tokens from the vocabulary's token bytes.

    `vocab` is a `csd_pipeline.vocab.vocabulary.Vocabulary` (needs `byte_lengths()`, `flat_bytes()`, `flags`,
    `dummy_prefix`); `ids` the concatenated content token ids, `doc_tokens` [D+1] their offsets per
    document; `src` the batch's bytes (uint8) and `doc_bytes` [D+1] the documents' byte offsets.
    Returns a `SideSpans` whose ends are exact for documents with `exact` True; the caller replaces
    the others' ends (`SideSpans.set_ends`) with ends from character offsets.
    """
    ids = np.asarray(ids, dtype=np.int32)
    doc_tokens = np.asarray(doc_tokens, dtype=np.int64)
    num_docs = len(doc_tokens) - 1
    flat, starts = vocab.flat_bytes()
    lengths = vocab.byte_lengths()[ids]
    offsets = starts[ids]
    counts = np.diff(doc_tokens)
    doc_len = np.diff(doc_bytes)
    spelled_total = segment_sums(lengths, doc_tokens)
    has_tokens = counts > 0
    dummy = np.zeros(num_docs, dtype=bool)
    if vocab.dummy_prefix and len(ids):
        first = doc_tokens[:-1][has_tokens]
        first_byte = np.where(lengths[first] > 0, flat[np.minimum(offsets[first], max(len(flat) - 1, 0))], 0)
        dummy[has_tokens] = (spelled_total[has_tokens] == doc_len[has_tokens] + 1) & (first_byte == 0x20)
        skip_at = doc_tokens[:-1][dummy]
        lengths = lengths.copy()
        lengths[skip_at] -= 1
        offsets = offsets + 0
        offsets[skip_at] += 1
        spelled_total = spelled_total - dummy
    # Byte-derived ends: cumulative lengths restarted at each document start.
    cum = np.cumsum(lengths)
    doc_of_token = np.repeat(np.arange(num_docs), counts)
    base = np.zeros(num_docs, dtype=np.int64)
    base[has_tokens] = (cum - lengths)[doc_tokens[:-1][has_tokens]]
    ends = cum - base[doc_of_token] + np.asarray(doc_bytes[:-1], dtype=np.int64)[doc_of_token]
    exact = spelled_total == doc_len
    if exact.any():
        token_ok = exact[doc_of_token]
        byte_ok = np.repeat(exact, doc_len)
        all_ok = bool(token_ok.all())
        spelled = flat[ragged_arange(offsets if all_ok else offsets[token_ok], lengths if all_ok else lengths[token_ok])]
        source = src if all_ok else src[byte_ok]
        differ = np.flatnonzero(spelled != source)
        if differ.size:
            ok_docs = np.flatnonzero(exact)
            ok_ends = np.cumsum(doc_len[ok_docs])
            exact[ok_docs[np.unique(np.searchsorted(ok_ends, differ, side="right"))]] = False
    flagged = vocab.flags[ids] != 0
    return SideSpans(ids, doc_tokens, ends, exact, dummy, flagged, lengths, offsets, flat)


@dataclass
class ChunkTable:
    """The chunks of one (student, teacher) pair over a batch.

    Chunk c covers bytes `[bounds[c], bounds[c+1])`, student tokens
    `[student_cut[c], student_cut[c+1])` and teacher tokens `[teacher_cut[c], teacher_cut[c+1])`.
    """

    bounds: np.ndarray  # int64 [C+1]
    student_cut: np.ndarray  # int64 [C+1]
    teacher_cut: np.ndarray  # int64 [C+1]
    status: np.ndarray  # uint8 [C]
    doc_chunks: np.ndarray  # int64 [D+1] chunk offsets of each document

    @property
    def student_len(self) -> np.ndarray:
        return np.diff(self.student_cut)

    @property
    def teacher_len(self) -> np.ndarray:
        return np.diff(self.teacher_cut)


def _positive_ends(side: SideSpans, doc_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, ends) of the tokens of non-zero width; their ends are strictly increasing per document."""
    starts = np.empty_like(side.ends)
    starts[1:] = side.ends[:-1]
    has = np.diff(side.doc_tokens) > 0
    starts[side.doc_tokens[:-1][has]] = doc_bytes[:-1][has]
    index = np.flatnonzero(side.ends > starts)
    return index, side.ends[index]


def _cuts_at(side: SideSpans, bounds: np.ndarray, boundary_docs: np.ndarray, doc_starts_at: np.ndarray,
             doc_bytes: np.ndarray, total: int) -> np.ndarray:
    """Token index where each boundary splits this side: after the non-empty token ending there."""
    index, ends = _positive_ends(side, doc_bytes)
    token_at_end = np.full(total + 1, -1, dtype=np.int64)
    token_at_end[ends] = index
    cuts = token_at_end[bounds] + 1
    # At a document start the cut is the document's first token (trailing zero-width tokens stay
    # with the previous document, leading ones go to the new document's first chunk).
    cuts[doc_starts_at] = side.doc_tokens[boundary_docs]
    cuts[-1] = len(side.ids)
    return cuts


def align(src: np.ndarray, doc_bytes: np.ndarray, student: SideSpans, teacher: SideSpans) -> ChunkTable:
    """Chunk a batch: minimal runs of student and teacher tokens that start and end at common byte
    boundaries, with a `ChunkStatus` per chunk (SPEC §4). Documents must be non-empty."""
    doc_bytes = np.asarray(doc_bytes, dtype=np.int64)
    total = int(doc_bytes[-1])
    num_docs = len(doc_bytes) - 1
    marks = np.zeros(total + 1, dtype=bool)
    _, student_ends = _positive_ends(student, doc_bytes)
    _, teacher_ends = _positive_ends(teacher, doc_bytes)
    marks[student_ends] = True
    common = teacher_ends[marks[teacher_ends]]
    marks[:] = False
    marks[common] = True
    marks[doc_bytes] = True
    bounds = np.flatnonzero(marks)
    doc_starts_at = np.searchsorted(bounds, doc_bytes[:-1])
    student_cut = _cuts_at(student, bounds, np.arange(num_docs), doc_starts_at, doc_bytes, total)
    teacher_cut = _cuts_at(teacher, bounds, np.arange(num_docs), doc_starts_at, doc_bytes, total)
    doc_chunks = np.append(doc_starts_at, len(bounds) - 1).astype(np.int64)
    table = ChunkTable(bounds, student_cut, teacher_cut, np.zeros(len(bounds) - 1, dtype=np.uint8), doc_chunks)
    _verify_and_repair(src, doc_bytes, table, student, teacher)
    _mark_flags_and_prefix(table, student, teacher)
    return table


def _failing_chunks(src: np.ndarray, table: ChunkTable, side: SideSpans, cut: np.ndarray) -> np.ndarray:
    """Indices of chunks (in the side's non-exact documents) whose tokens do not spell their source bytes."""
    docs = np.flatnonzero(~side.exact)
    if docs.size == 0:
        return np.zeros(0, dtype=np.int64)
    chunks = ragged_arange(table.doc_chunks[docs], np.diff(table.doc_chunks)[docs])
    first, last = cut[chunks], cut[chunks + 1]
    b0, b1 = table.bounds[chunks], table.bounds[chunks + 1]
    cum = np.zeros(len(side.lengths) + 1, dtype=np.int64)
    np.cumsum(side.lengths, out=cum[1:])
    spelled_len = cum[last] - cum[first]
    same_len = spelled_len == b1 - b0
    bad = [chunks[~same_len]]
    ok = np.flatnonzero(same_len)
    if ok.size:
        tokens = ragged_arange(first[ok], last[ok] - first[ok])
        spelled = side.flat[ragged_arange(side.byte_offsets[tokens], side.lengths[tokens])]
        source = src[ragged_arange(b0[ok], b1[ok] - b0[ok])]
        differ = np.flatnonzero(spelled != source)
        if differ.size:
            chunk_of_byte = np.searchsorted(np.cumsum(b1[ok] - b0[ok]), differ, side="right")
            bad.append(chunks[ok][np.unique(chunk_of_byte)])
    return np.unique(np.concatenate(bad))


def _verify_and_repair(src: np.ndarray, doc_bytes: np.ndarray, table: ChunkTable, student: SideSpans,
                       teacher: SideSpans) -> None:
    """Verify the chunks of non-exact documents; merge runs of failing chunks whose union spells the
    source on both sides (then re-chunk that union from token bytes, which are exact there), and
    classify the rest as whitespace gaps or mismatches."""
    failing = np.union1d(_failing_chunks(src, table, student, table.student_cut),
                         _failing_chunks(src, table, teacher, table.teacher_cut))
    if failing.size == 0:
        return
    failing_set = set(failing.tolist())
    doc_first_chunks = set(table.doc_chunks.tolist())
    source = src.tobytes()

    def verifies(c0: int, c1: int) -> bool:
        want = source[table.bounds[c0]:table.bounds[c1]]
        return (student.spelled(table.student_cut[c0], table.student_cut[c1]) == want
                and teacher.spelled(table.teacher_cut[c0], table.teacher_cut[c1]) == want)

    edits = []  # (first chunk, end chunk, bounds, student cuts, teacher cuts) of re-chunked unions
    ordered = failing.tolist()
    position = 0
    while position < len(ordered):
        c = ordered[position]
        last, merged_to = c, None
        # Extend over the following failing chunks of the same document; take the shortest union that verifies.
        while last + 1 in failing_set and last + 1 not in doc_first_chunks and last + 1 - c < MAX_MERGE:
            last += 1
            if verifies(c, last + 1):
                merged_to = last
                break
        if merged_to is not None:
            edits.append((c, merged_to + 1, *_rechunk_exact(table, student, teacher, c, merged_to + 1)))
            position += merged_to - c + 1
            continue
        want = source[table.bounds[c]:table.bounds[c + 1]]
        spelled = (student.spelled(table.student_cut[c], table.student_cut[c + 1]),
                   teacher.spelled(table.teacher_cut[c], table.teacher_cut[c + 1]))
        same_text = all(s.translate(None, _WHITESPACE) == want.translate(None, _WHITESPACE) for s in spelled)
        table.status[c] = ChunkStatus.WHITESPACE_GAP_WITHOUT_SOURCE if same_text else ChunkStatus.MISMATCH
        position += 1
    if edits:
        _apply_edits(table, edits, doc_bytes)


def _rechunk_exact(table: ChunkTable, student: SideSpans, teacher: SideSpans, c0: int, c1: int):
    """Minimal chunks of chunks [c0, c1), whose tokens spell their source bytes exactly on both sides."""
    lo = int(table.bounds[c0])
    positions = []
    for side, cut in ((student, table.student_cut), (teacher, table.teacher_cut)):
        first, end = int(cut[c0]), int(cut[c1])
        ends = lo + np.cumsum(side.lengths[first:end])
        positive = side.lengths[first:end] > 0
        positions.append((first, end, ends, positive))
    (s_first, s_end, s_ends, s_pos), (t_first, t_end, t_ends, t_pos) = positions
    common = np.intersect1d(s_ends[s_pos], t_ends[t_pos])
    bounds = np.concatenate([[lo], common]).astype(np.int64)

    def cuts(first, end, ends, positive):
        index = np.flatnonzero(positive)
        at = index[np.searchsorted(ends[index], bounds[1:])] + 1 + first
        return np.concatenate([[first], at]).astype(np.int64)

    # The union's end bound is the start of the chunk after it: leave it out.
    return bounds[:-1], cuts(s_first, s_end, s_ends, s_pos)[:-1], cuts(t_first, t_end, t_ends, t_pos)[:-1]


def _apply_edits(table: ChunkTable, edits, doc_bytes: np.ndarray) -> None:
    bounds, student_cut, teacher_cut, status = [], [], [], []
    previous = 0
    for c0, c1, new_bounds, new_s, new_t in edits:
        bounds += [table.bounds[previous:c0], new_bounds]
        student_cut += [table.student_cut[previous:c0], new_s]
        teacher_cut += [table.teacher_cut[previous:c0], new_t]
        status += [table.status[previous:c0], np.full(len(new_bounds), ChunkStatus.ACCEPTED, dtype=np.uint8)]
        previous = c1
    bounds.append(table.bounds[previous:])
    student_cut.append(table.student_cut[previous:])
    teacher_cut.append(table.teacher_cut[previous:])
    status.append(table.status[previous:])
    table.bounds = np.concatenate(bounds)
    table.student_cut = np.concatenate(student_cut)
    table.teacher_cut = np.concatenate(teacher_cut)
    table.status = np.concatenate(status)[:len(table.bounds) - 1]
    table.doc_chunks = np.append(np.searchsorted(table.bounds, doc_bytes[:-1]), len(table.bounds) - 1).astype(np.int64)


def _mark_flags_and_prefix(table: ChunkTable, student: SideSpans, teacher: SideSpans) -> None:
    status = table.status
    first_chunks = table.doc_chunks[:-1]
    dummy = student.dummy | teacher.dummy
    prefix_chunks = first_chunks[dummy]
    ok = status[prefix_chunks] == ChunkStatus.ACCEPTED
    status[prefix_chunks[ok]] = ChunkStatus.DUMMY_PREFIX
    flagged = (segment_sums(student.flagged, table.student_cut) + segment_sums(teacher.flagged, table.teacher_cut)) > 0
    status[flagged] = ChunkStatus.UNTRUSTED_TOKEN


# ---------------------------------------------------------------------------------------------
# Windows


@dataclass
class Windows:
    """Windows of a batch: each is a run of whole chunks of one document that fits every limit."""

    doc: np.ndarray  # int64 [W]
    window_index: np.ndarray  # int32 [W] index within its document
    byte_range: np.ndarray  # int64 [W, 2] batch coordinates
    student_range: np.ndarray  # int64 [W, 2] student token range
    teacher_ranges: list[np.ndarray]  # per teacher int64 [W, 2]
    chunk_ranges: list[np.ndarray]  # per teacher int64 [W, 2]
    rejected_regions: int = 0
    rejected_bytes: int = 0
    rejected_docs: np.ndarray | None = None  # documents with at least one rejected region


def cut_windows(src: np.ndarray, doc_bytes: np.ndarray, tables: list[ChunkTable],
                max_student: int, max_teachers: list[int], context: list[bool]) -> Windows:
    """Cut each document into windows of whole chunks.

    A window fits `max_student` student tokens and `max_teachers[i]` tokens of teacher i, counting
    each side's context token (`context[0]` for the student, `context[1 + i]` for teacher i). Cuts
    lie on boundaries common to every teacher's chunks and at UTF-8 character starts. A run between
    two consecutive cuts that does not fit is a rejected region (counted, never truncated).
    Returns `Windows` in (document, position) order.
    """
    doc_bytes = np.asarray(doc_bytes, dtype=np.int64)
    budgets = [max_student - int(context[0])] + [m - int(c) for m, c in zip(max_teachers, context[1:], strict=True)]
    first = tables[0]
    fits = np.diff(first.student_cut[first.doc_chunks]) <= budgets[0]
    for i, table in enumerate(tables):
        fits &= np.diff(table.teacher_cut[table.doc_chunks]) <= budgets[1 + i]
    whole = np.flatnonzero(fits)
    rows_doc, rows_window, rows_lo, rows_hi = [], [], [], []
    rejected_regions = rejected_bytes = 0
    rejected_docs = []
    for d in np.flatnonzero(~fits).tolist():
        candidates = _common_cuts(src, tables, d, int(doc_bytes[d]), int(doc_bytes[d + 1]))
        side_cuts = [first.student_cut[np.searchsorted(first.bounds, candidates)]]
        side_cuts += [table.teacher_cut[np.searchsorted(table.bounds, candidates)] for table in tables]
        window, cur, last = 0, 0, len(candidates) - 1
        while cur < last:
            reach = last
            for cuts, budget in zip(side_cuts, budgets, strict=True):
                reach = min(reach, int(np.searchsorted(cuts, cuts[cur] + budget, side="right")) - 1)
            if reach <= cur:  # even the shortest run from here is longer than a limit
                rejected_regions += 1
                rejected_bytes += int(candidates[cur + 1] - candidates[cur])
                if not rejected_docs or rejected_docs[-1] != d:
                    rejected_docs.append(d)
                cur += 1
                continue
            rows_doc.append(d)
            rows_window.append(window)
            rows_lo.append(int(candidates[cur]))
            rows_hi.append(int(candidates[reach]))
            window += 1
            cur = reach
    doc = np.concatenate([whole, np.asarray(rows_doc, dtype=np.int64)])
    window_index = np.concatenate([np.zeros(len(whole), dtype=np.int64), np.asarray(rows_window, dtype=np.int64)])
    lo = np.concatenate([doc_bytes[:-1][whole], np.asarray(rows_lo, dtype=np.int64)])
    hi = np.concatenate([doc_bytes[1:][whole], np.asarray(rows_hi, dtype=np.int64)])
    order = np.argsort(lo, kind="stable")  # windows never overlap, so byte order is (document, position) order
    doc, window_index, lo, hi = doc[order], window_index[order], lo[order], hi[order]
    chunk_ranges, teacher_ranges = [], []
    for table in tables:
        c0, c1 = np.searchsorted(table.bounds, lo), np.searchsorted(table.bounds, hi)
        chunk_ranges.append(np.stack([c0, c1], axis=1))
        teacher_ranges.append(np.stack([table.teacher_cut[c0], table.teacher_cut[c1]], axis=1))
    c0, c1 = chunk_ranges[0][:, 0], chunk_ranges[0][:, 1]
    student_range = np.stack([first.student_cut[c0], first.student_cut[c1]], axis=1)
    return Windows(doc, window_index.astype(np.int32), np.stack([lo, hi], axis=1), student_range, teacher_ranges,
                   chunk_ranges, rejected_regions, rejected_bytes, np.asarray(rejected_docs, dtype=np.int64))


def _common_cuts(src: np.ndarray, tables: list[ChunkTable], d: int, lo: int, hi: int) -> np.ndarray:
    """Byte positions in document d where every teacher has a chunk boundary and a character starts."""
    cuts = None
    for table in tables:
        bounds = table.bounds[table.doc_chunks[d]:table.doc_chunks[d + 1] + 1]
        cuts = bounds if cuts is None else np.intersect1d(cuts, bounds, assume_unique=True)
    inner = cuts[(cuts > lo) & (cuts < hi)]
    inner = inner[(src[inner] & 0xC0) != 0x80]
    return np.concatenate([[lo], inner, [hi]]).astype(np.int64)
