"""Compact encoding of teacher top-k log-probabilities, one block of positions at a time.

A *block* holds consecutive teacher positions (several rows of one shard). Per position it keeps
the n most likely token ids, their log-probabilities and, where the position has a next token,
the log-probability of that observed token (SPEC §6). n is the same k everywhere for a fixed
top-k; with a mass-adaptive top-k (`teacher-logits --top-p P`) it is chosen per position: the most
likely entries until their probabilities sum to P, at most k. The layout is documented, byte by
byte, in `csd_pipeline/teacher/store/schema.py`; in short:

- log-probabilities are quantized on one absolute grid, q = round(-logprob * 51), so every decoded
  value is within 1/102 nat (0.0098) of the float32 value (down to -1285 nat, where q saturates at
  65535; no log-probability in a real top-k comes near that);
- each position's entries are put in a canonical order, q ascending (log-prob descending), ties by
  id, so the quantized values are non-decreasing: the first is stored whole, the rest as gaps
  between neighbours (quantize first, then take differences, so rounding never accumulates);
- the number of entries of each position is stored only when it varies within the block;
- ids are stored big-endian (the high byte first, which gives the low byte a useful context);
- the observed log-prob is an index into the position's entries when the observed token is one of
  them, else the gap below the position's last stored value;
- each stream is compressed on its own with raw LZMA (the adaptive range coder of LZMA models
  these streams better than zstd's Huffman stage: about 61 B/position instead of 68 on SmolLM2
  for a fixed top-32).

`decode_block` also reads blocks of the first encoding (`csd-topk-lzma-v1`, schema version 1: a
fixed k, no entry counts), so outputs written before the mass-adaptive top-k stay readable.

Everything here is numpy and the standard library (`lzma`, `struct`); no torch.
"""

from __future__ import annotations

import lzma
import struct
from typing import NamedTuple

import numpy as np

from csd_pipeline.errors import CsdError

ENCODING = "csd-topk-lzma-v2"
"""Name of the encoding written, recorded in the teacher manifest and the shard schema metadata."""

ENCODINGS = {1: "csd-topk-lzma-v1", 2: ENCODING}
"""The encoding of each teacher top-k schema version this module decodes."""

STEPS_PER_NAT = 51
"""The quantization grid: a log-probability is stored as round(-logprob * 51) (step 1/51 nat)."""

MAX_ABS_ERROR = 0.5 / STEPS_PER_NAT
"""Worst-case absolute error of a decoded log-probability above the saturation floor (~0.0098 nat)."""

Q_MAX = 0xFFFF
"""Largest quantized value: log-probabilities below -Q_MAX/51 (about -1285 nat) decode as that floor."""

LOGPROB_FLOOR = -Q_MAX / STEPS_PER_NAT

MAX_K = 255
PAD_ID = -1
"""The id of a padding entry in decoded arrays (beyond a position's entry count); its log-prob is -inf."""

MAGIC = b"CTK2"
MAGIC_V1 = b"CTK1"
STREAMS = ("lens", "top", "ids_lo", "ids_hi", "gaps", "gaps_x", "obs", "obs_x")
STREAMS_V1 = STREAMS[1:]
# magic, positions, k, id_width, observed positions, stored entries, then each stream's byte length
_HEADER = struct.Struct("<4sIIIII" + "I" * len(STREAMS))
_HEADER_V1 = struct.Struct("<4sIIII" + "I" * len(STREAMS_V1))
_GAP_ESCAPE = 255
_OBS_OUTSIDE = 255  # v2: the observed token is not among the position's entries (indices are < MAX_K)

# Raw LZMA1 settings per stream: literal context bits (lc), literal position bits (lp), position
# bits (pb) and match finder. The id stream is 2-byte symbols, so lp=1/pb=1 separate high and low
# bytes and lc=3 gives the low byte the top bits of its high byte as context. Measured on SmolLM2
# output (see bench/bench_teacher.py); the others compress to almost nothing anyway.
_LZMA_SETTINGS = {
    "ids_lo": {"lc": 3, "lp": 1, "pb": 1, "mf": lzma.MF_BT2, "nice_len": 32},
    "gaps": {"lc": 4, "lp": 0, "pb": 0, "mf": lzma.MF_BT4, "nice_len": 273},
}
_LZMA_DEFAULT = {"lc": 3, "lp": 0, "pb": 0, "mf": lzma.MF_BT4, "nice_len": 273}


class DecodedBlock(NamedTuple):
    """The values of one block, padded to its k entries per position.

    ids int32 [P, k] and logprobs float32 [P, k] (descending) hold `lengths[t]` real entries at
    position t, then padding (id `PAD_ID`, log-prob -inf); observed float32 [P] (NaN where the
    position has no next token); lengths int64 [P], each in [1, k] (k everywhere for a fixed top-k).
    """

    ids: np.ndarray
    logprobs: np.ndarray
    observed: np.ndarray
    lengths: np.ndarray


def _filters(stream: str) -> list[dict]:
    settings = _LZMA_SETTINGS.get(stream, _LZMA_DEFAULT)
    return [{"id": lzma.FILTER_LZMA1, "dict_size": 1 << 22, "mode": lzma.MODE_NORMAL, "depth": 0, **settings}]


def _compress(stream: str, raw: bytes) -> bytes:
    if not raw:
        return b""
    return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_filters(stream))


def _corrupt(what: str) -> CsdError:
    return CsdError(f"teacher top-k block: {what}; the shard is corrupt, re-run teacher-logits.")


def _decompress(stream: str, data: bytes, expected: int) -> bytes:
    if expected == 0:
        if data:
            raise _corrupt(f"stream {stream} should be empty")
        return b""
    try:
        raw = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_filters(stream)).decompress(data, expected)
    except lzma.LZMAError as err:
        raise _corrupt(f"stream {stream} does not decompress ({err})") from None
    if len(raw) != expected:
        raise _corrupt(f"stream {stream} holds {len(raw)} bytes, expected {expected}")
    return raw


def quantize(logprobs) -> np.ndarray:
    """Quantize log-probabilities to the storage grid: int64 q = clip(round(-logprob * 51), 0, 65535).

    NaN must not be passed (the caller rejects non-finite rows first); -inf saturates at Q_MAX.
    """
    scaled = np.rint(-np.asarray(logprobs, dtype=np.float64) * STEPS_PER_NAT)
    return np.clip(scaled, 0, Q_MAX).astype(np.int64)


def dequantize(q) -> np.ndarray:
    """The float32 log-probabilities of quantized values `q` (the inverse of `quantize` on the grid)."""
    return (-np.asarray(q, dtype=np.float64) / STEPS_PER_NAT).astype(np.float32)


def canonical_order(ids: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each position's entries by quantized value ascending (log-prob descending), ties by id.

    Returns (ids, q) reordered, both int64 [P, k]. Equal quantized values decode to equal
    log-probabilities, so ordering ties by id loses nothing and makes the bytes reproducible.
    """
    key = (q << 24) | ids
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(q, order, axis=1)


def _be16(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=">u2").tobytes()


def _check_inputs(ids, logprobs, observed_ids, observed_logprobs, lengths):
    """The inputs of `encode_block` as arrays, or ValueError."""
    ids = np.asarray(ids, dtype=np.int64)
    logprobs = np.asarray(logprobs)
    observed_ids = np.asarray(observed_ids, dtype=np.int64)
    observed_logprobs = np.asarray(observed_logprobs)
    if ids.ndim != 2 or ids.shape != logprobs.shape:
        raise ValueError(f"ids {ids.shape} and logprobs {logprobs.shape} must both be [P, k]")
    positions, k = ids.shape
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if observed_ids.shape != (positions,) or observed_logprobs.shape != (positions,):
        raise ValueError(f"observed arrays must have shape ({positions},)")
    lengths = np.full(positions, k, np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lengths.shape != (positions,) or (positions and (lengths.min() < 1 or lengths.max() > k)):
        raise ValueError(f"lengths must have shape ({positions},) with values in [1, {k}]")
    if positions and (ids.min() < 0 or ids.max() >= 1 << 24):
        raise ValueError("top-k ids must be in [0, 2**24)")
    return ids, logprobs, observed_ids, observed_logprobs, lengths


def encode_block(ids, logprobs, observed_ids, observed_logprobs, lengths=None) -> bytes:
    """Encode one block of teacher positions.

    ids: int [P, k] top-k token ids (k <= 255, ids < 2**24); logprobs: float [P, k] their
    log-probabilities (finite, any order); observed_ids: int [P], the next token of each position or
    -1 where there is none (the last position of a row); observed_logprobs: float [P] the
    log-probability of that token (ignored where observed_ids is -1); lengths: int [P] in [1, k],
    how many of each position's entries to store: its most likely ones (on the grid; among entries
    with equal quantized values, the first given), or None to store all k.
    Returns the payload bytes. Raises ValueError on inconsistent shapes or out-of-range values.
    """
    ids, logprobs, observed_ids, observed_logprobs, lengths = _check_inputs(
        ids, logprobs, observed_ids, observed_logprobs, lengths)
    positions, k = ids.shape
    kept = np.arange(k)[None, :] < lengths[:, None]  # after the canonical order: the most likely first
    entries = int(lengths.sum())
    q = quantize(logprobs)
    if entries != positions * k:  # keep the most likely, ties on the grid in the given order, then sort those
        first = np.argsort(q, axis=1, kind="stable")
        ids, q = np.take_along_axis(ids, first, axis=1), np.take_along_axis(q, first, axis=1)
        q = np.where(kept, q, Q_MAX + 1)  # left out: after every kept entry in the canonical order
    ids, q = canonical_order(ids, q)
    stored_ids = ids[kept]  # position-major
    id_width = 3 if positions and stored_ids.max() >= 1 << 16 else 2
    gaps_rank_major = np.diff(q, axis=1).T[kept[:, 1:].T]  # non-negative by the canonical order
    escaped = gaps_rank_major >= _GAP_ESCAPE

    has_observed = observed_ids >= 0
    obs_ids = observed_ids[has_observed]
    match = (ids[has_observed] == obs_ids[:, None]) & kept[has_observed]
    found = match.any(axis=1)
    obs_index = np.where(found, match.argmax(axis=1), _OBS_OUTSIDE).astype(np.uint8)
    outside = ~found
    q_obs = quantize(observed_logprobs[has_observed][outside])
    last = q[np.arange(positions), lengths - 1]
    # The observed token is not stored, so its log-prob is at most the position's last stored value.
    obs_gap = np.maximum(q_obs - last[has_observed][outside], 0)

    raw = {
        "lens": lengths.astype(np.uint8).tobytes() if entries != positions * k else b"",
        "top": _be16(q[:, 0]),
        "ids_lo": _be16(stored_ids & 0xFFFF),
        "ids_hi": (stored_ids >> 16).astype(np.uint8).tobytes() if id_width == 3 else b"",
        "gaps": np.minimum(gaps_rank_major, _GAP_ESCAPE).astype(np.uint8).tobytes(),
        "gaps_x": _be16(gaps_rank_major[escaped]),
        "obs": obs_index.tobytes(),
        "obs_x": _be16(obs_gap),
    }
    packed = [_compress(name, raw[name]) for name in STREAMS]
    header = _HEADER.pack(MAGIC, positions, k, id_width, int(has_observed.sum()), entries, *(len(p) for p in packed))
    return header + b"".join(packed)


def block_header(payload: bytes) -> dict:
    """The header of an encoded block: {"version", "positions", "k", "id_width", "observed", "entries",
    "stream_bytes"} (version 1 blocks store every k entries: entries = positions * k)."""
    magic = payload[:4]
    if magic not in (MAGIC, MAGIC_V1):
        raise CsdError(f"teacher top-k block starts with {magic!r}, not {MAGIC!r} or {MAGIC_V1!r}: not an encoding "
                       f"this csd-pipeline reads ({', '.join(ENCODINGS.values())}); re-run teacher-logits.")
    layout, streams = (_HEADER, STREAMS) if magic == MAGIC else (_HEADER_V1, STREAMS_V1)
    if len(payload) < layout.size:
        raise _corrupt("shorter than its header")
    if magic == MAGIC:
        _, positions, k, id_width, observed, entries, *lengths = layout.unpack_from(payload)
    else:
        _, positions, k, id_width, observed, *lengths = layout.unpack_from(payload)
        entries = positions * k
    return {"version": 2 if magic == MAGIC else 1, "positions": positions, "k": k, "id_width": id_width,
            "observed": observed, "entries": entries, "stream_bytes": dict(zip(streams, lengths)),
            "header_bytes": layout.size}


def _streams(payload: bytes, header: dict):
    """A function name, expected size -> the decompressed stream of this block."""
    chunks, offset = {}, header["header_bytes"]
    for name, size in header["stream_bytes"].items():
        chunks[name] = payload[offset:offset + size]
        offset += size
    if offset != len(payload):
        raise _corrupt("trailing bytes")
    return lambda name, expected: _decompress(name, chunks[name], expected)


def _entry_lengths(header: dict, stream) -> np.ndarray:
    positions, k, entries = header["positions"], header["k"], header["entries"]
    if entries == positions * k:  # every position holds k entries (always so in version 1)
        return np.full(positions, k, np.int64)
    lengths = np.frombuffer(stream("lens", positions), dtype=np.uint8).astype(np.int64)
    if positions and (lengths.min() < 1 or lengths.max() > k or int(lengths.sum()) != entries):
        raise _corrupt(f"entry counts outside [1, {k}] or not summing to {entries}")
    return lengths


def decode_block(payload: bytes, observed_mask) -> DecodedBlock:
    """Decode a block written by `encode_block` (or by the version 1 encoder).

    observed_mask: bool [P], True where the position has an observed next token (the encoder's
    observed_ids >= 0). Returns a `DecodedBlock`. Raises CsdError on a corrupt payload.
    """
    header = block_header(payload)
    positions, k, id_width = header["positions"], header["k"], header["id_width"]
    observed_mask = np.asarray(observed_mask, dtype=bool)
    if observed_mask.shape != (positions,) or int(observed_mask.sum()) != header["observed"]:
        raise CsdError(f"teacher top-k block holds {positions} positions ({header['observed']} with a next token) but "
                       f"the rows say {observed_mask.size} ({int(observed_mask.sum())}); the shard is corrupt, re-run "
                       "teacher-logits.")
    stream = _streams(payload, header)
    lengths = _entry_lengths(header, stream) if header["version"] == 2 else np.full(positions, k, np.int64)
    entries = int(lengths.sum())
    kept = np.arange(k)[None, :] < lengths[:, None]

    ids = np.full((positions, k), PAD_ID, np.int32)
    stored = np.frombuffer(stream("ids_lo", 2 * entries), dtype=">u2").astype(np.int32)
    if id_width == 3:
        stored |= np.frombuffer(stream("ids_hi", entries), dtype=np.uint8).astype(np.int32) << 16
    ids[kept] = stored
    gaps = np.frombuffer(stream("gaps", entries - positions), dtype=np.uint8).astype(np.int64)
    escaped = gaps == _GAP_ESCAPE
    gaps[escaped] = np.frombuffer(stream("gaps_x", 2 * int(escaped.sum())), dtype=">u2")
    q = np.zeros((positions, k), dtype=np.int64)
    q[:, 0] = np.frombuffer(stream("top", 2 * positions), dtype=">u2")
    rank_major = np.zeros((max(k - 1, 0), positions), dtype=np.int64)
    rank_major[kept[:, 1:].T] = gaps
    q[:, 1:] = rank_major.T
    np.cumsum(q, axis=1, out=q)

    observed_count = header["observed"]
    obs_index = np.frombuffer(stream("obs", observed_count), dtype=np.uint8).astype(np.int64)
    sub_lengths = lengths[observed_mask]
    outside = obs_index == (k if header["version"] == 1 else _OBS_OUTSIDE)
    if np.any(obs_index[~outside] >= sub_lengths[~outside]):
        raise _corrupt("an observed index beyond the position's entries")
    obs_gap = np.frombuffer(stream("obs_x", 2 * int(outside.sum())), dtype=">u2").astype(np.int64)
    q_sub = q[observed_mask]
    q_obs = np.empty(observed_count, dtype=np.int64)
    q_obs[~outside] = q_sub[~outside, obs_index[~outside]]
    q_obs[outside] = q_sub[outside, sub_lengths[outside] - 1] + obs_gap
    observed = np.full(positions, np.nan, dtype=np.float32)
    observed[observed_mask] = dequantize(q_obs)
    logprobs = dequantize(q)
    logprobs[~kept] = -np.inf
    return DecodedBlock(ids, logprobs, observed, lengths)
