"""Prefix-support entries of a sub-token table (SPEC §3): every (a, b, len p) with
bytes(a) == p + bytes(b), p non-empty, a a source spelling and b a destination spelling.

Found by hashing every proper suffix of every source spelling and looking the hashes up among the
destination spellings' hashes, each hit then compared byte for byte (`prefix_entries`);
`vocab.tables.build_table` stores them.
"""

from __future__ import annotations

import operator

import numpy as np

from csd_pipeline.vocab.vocabulary import Vocabulary

_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: byte strings hash as polynomials mod 2**64


def spelling_arrays(vocab: Vocabulary) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(representative id, start, length) of every spelling, and the uint8 bytes they point into."""
    spellings = vocab.spellings()
    reps = np.fromiter(map(operator.itemgetter(0), spellings.values()), dtype=np.int64, count=len(spellings))
    flat, starts = vocab.flat_bytes()
    return reps, starts[reps], vocab.byte_lengths()[reps], flat


def _suffix_hashes(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64 hash of every suffix of every spelling: h[i] = hash(bytes[i:end of its spelling]), for
    each byte i of the spellings (laid out as `starts`/`lengths` in `flat`), from the end backwards.
    The spellings go longest first, so the ones with a byte at `distance` from their end are a prefix."""
    hashes = np.zeros(flat.size + 1, dtype=np.uint64)  # the extra slot: the empty suffix after a spelling
    by_length = np.argsort(-lengths, kind="stable")
    ends = (starts + lengths)[by_length]
    longest = int(lengths.max(initial=0))
    reach = np.searchsorted(-lengths[by_length], -np.arange(1, longest + 1), side="right").tolist()
    for distance, count in enumerate(reach, 1):
        at = ends[:count] - distance
        after = at + 1 if distance > 1 else flat.size  # the empty suffix hashes to 0
        hashes[at] = (flat[at].astype(np.uint64) + np.uint64(1)) + _HASH_BASE * hashes[after]
    return hashes


def _hash_positions(keys: np.ndarray, order: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Index in `keys` (distinct uint64, sorted by `order`) of each query, -1 where it is none.

    A direct-address table of about 4x as many buckets as keys (the bucket: the top bits of the
    hash times an odd constant) answers most queries with one look-up; queries whose bucket holds
    two or more keys are found by binary search."""
    bits = max(int(keys.size).bit_length() + 2, 1)
    shift = np.uint64(64 - bits)
    key_bucket = ((keys * _HASH_BASE) >> shift).astype(np.intp)
    query_bucket = ((queries * _HASH_BASE) >> shift).astype(np.intp)
    owner = np.full(1 << bits, -1, dtype=np.int64)
    owner[key_bucket] = np.arange(keys.size)
    found = owner[query_bucket]
    found = np.where(keys[found] == queries, found, -1)  # an empty bucket gathers the last key: no match
    crowded = np.flatnonzero((np.bincount(key_bucket, minlength=1 << bits) > 1)[query_bucket])
    if crowded.size:
        ranked = keys[order]
        slot = np.minimum(np.searchsorted(ranked, queries[crowded]), keys.size - 1)
        found[crowded] = np.where(ranked[slot] == queries[crowded], order[slot], -1)
    return found


def prefix_entries(source: Vocabulary, destination: Vocabulary, advance=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (a, b, len p) with bytes(a) == p + bytes(b), p non-empty, by representative ids, sorted.
    `advance(n)`, when given, is told of the source spellings done (a progress bar).

    Vectorised: every proper suffix of every source spelling is hashed (a polynomial mod 2**64) and
    looked up among the destination spellings' hashes; each hit is then compared byte for byte, so
    the result is exact whatever the hash does. Two destination spellings with one hash (never seen)
    fall back to dictionary look-ups.
    """
    s_reps, s_starts, s_lengths, s_flat = spelling_arrays(source)
    d_reps, d_starts, d_lengths, d_flat = spelling_arrays(destination)
    d_hashes = _suffix_hashes(d_flat, d_starts, d_lengths)[d_starts]
    order = np.argsort(d_hashes, kind="stable")
    if order.size > 1 and np.any(d_hashes[order[1:]] == d_hashes[order[:-1]]):
        return _prefix_entries_by_lookup(source, destination, advance)
    # every (spelling, n) with 1 <= n < its length: the suffix starting n bytes in
    counts = np.maximum(s_lengths - 1, 0)
    spelling = np.repeat(np.arange(s_reps.size), counts)
    n = np.arange(spelling.size) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    suffix_start = s_starts[spelling] + n
    suffix_hash = _suffix_hashes(s_flat, s_starts, s_lengths)[suffix_start]
    match = _hash_positions(d_hashes, order, suffix_hash) if d_hashes.size else np.full(suffix_hash.size, -1)
    hit = np.flatnonzero(match >= 0)
    spelling, n, suffix_start, match = spelling[hit], n[hit], suffix_start[hit], match[hit]
    size = s_lengths[spelling] - n
    same = size == d_lengths[match]
    spelling, n, suffix_start, match, size = spelling[same], n[same], suffix_start[same], match[same], size[same]
    equal = _equal_runs(s_flat, suffix_start, d_flat, d_starts[match], size)
    a = s_reps[spelling[equal]].astype(np.int32)
    b = d_reps[match[equal]].astype(np.int32)
    n = n[equal].astype(np.int32)
    if advance is not None:
        advance(s_reps.size)
    if np.all(s_reps[1:] > s_reps[:-1]):  # spellings by id: (a, n) ascending already, one b each
        return a, b, n
    order = np.lexsort((b, n, a))
    return a[order], b[order], n[order]


def _equal_runs(left: np.ndarray, left_starts, right: np.ndarray, right_starts, sizes) -> np.ndarray:
    """bool per run: left[left_starts[i]:+sizes[i]] == right[right_starts[i]:+sizes[i]] (sizes >= 1)."""
    if sizes.size == 0:
        return np.zeros(0, dtype=bool)
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    differs = left[np.repeat(left_starts, sizes) + offsets] != right[np.repeat(right_starts, sizes) + offsets]
    return np.add.reduceat(differs, np.cumsum(sizes) - sizes) == 0


def _prefix_entries_by_lookup(source: Vocabulary, destination: Vocabulary, advance=None):
    """`prefix_entries` by one dictionary look-up per suffix (the exact, slower way)."""
    dst = destination.spelling_representatives()
    entries = []
    add = entries.append
    spellings = source.spellings()
    for done, (a_bytes, a_class) in enumerate(spellings.items(), 1):
        if advance is not None and done % 8192 == 0:
            advance(8192)
        a_rep = a_class[0]
        for n in range(1, len(a_bytes)):
            b_rep = dst.get(a_bytes[n:])
            if b_rep is not None:
                add((a_rep, b_rep, n))
    if advance is not None:
        advance(len(spellings) % 8192)
    table = np.asarray(entries, dtype=np.int32).reshape(-1, 3)
    a, b, n = table[:, 0], table[:, 1], table[:, 2]
    order = np.lexsort((b, n, a))
    return a[order], b[order], n[order]
