"""Compact encoding of teacher top-k log-probabilities, one block of positions at a time.

A *block* holds consecutive teacher positions (several rows of one shard). Per position it keeps
the top-k token ids, their log-probabilities and, where the position has a next token, the
log-probability of that observed token (SPEC §6). The layout is documented, byte by byte, in
`schemas/teacher_topk.py`; in short:

- log-probabilities are quantized on one absolute grid, q = round(-logprob * 51), so every decoded
  value is within 1/102 nat (0.0098) of the float32 value (down to -1285 nat, where q saturates at
  65535; no log-probability in a real top-k comes near that);
- the k entries are put in a canonical order, q ascending (log-prob descending), ties by id, so
  the quantized values are non-decreasing: the first is stored whole, the rest as gaps between
  neighbours (quantize first, then take differences, so rounding never accumulates);
- ids are stored big-endian (the high byte first, which gives the low byte a useful context);
- the observed log-prob is an index into the top-k when the observed token is there, else the gap
  below the k-th value;
- each stream is compressed on its own with raw LZMA (the adaptive range coder of LZMA models
  these streams better than zstd's Huffman stage: about 61 B/position instead of 68 on SmolLM2).

Everything here is numpy and the standard library (`lzma`, `struct`); no torch.
"""

from __future__ import annotations

import lzma
import struct

import numpy as np

from csd_pipeline.errors import CsdError

ENCODING = "csd-topk-lzma-v1"
"""Name of this encoding, recorded in the teacher manifest and the shard schema metadata."""

STEPS_PER_NAT = 51
"""The quantization grid: a log-probability is stored as round(-logprob * 51) (step 1/51 nat)."""

MAX_ABS_ERROR = 0.5 / STEPS_PER_NAT
"""Worst-case absolute error of a decoded log-probability above the saturation floor (~0.0098 nat)."""

Q_MAX = 0xFFFF
"""Largest quantized value: log-probabilities below -Q_MAX/51 (about -1285 nat) decode as that floor."""

LOGPROB_FLOOR = -Q_MAX / STEPS_PER_NAT

MAX_K = 255
MAGIC = b"CTK1"
STREAMS = ("top", "ids_lo", "ids_hi", "gaps", "gaps_x", "obs", "obs_x")
_HEADER = struct.Struct("<4sIIII" + "I" * len(STREAMS))
_GAP_ESCAPE = 255

# Raw LZMA1 settings per stream: literal context bits (lc), literal position bits (lp), position
# bits (pb) and match finder. The id stream is 2-byte symbols, so lp=1/pb=1 separate high and low
# bytes and lc=3 gives the low byte the top bits of its high byte as context. Measured on SmolLM2
# output (see bench/bench_teacher.py); the others compress to almost nothing anyway.
_LZMA_SETTINGS = {
    "ids_lo": {"lc": 3, "lp": 1, "pb": 1, "mf": lzma.MF_BT2, "nice_len": 32},
    "gaps": {"lc": 4, "lp": 0, "pb": 0, "mf": lzma.MF_BT4, "nice_len": 273},
}
_LZMA_DEFAULT = {"lc": 3, "lp": 0, "pb": 0, "mf": lzma.MF_BT4, "nice_len": 273}


def _filters(stream: str) -> list[dict]:
    settings = _LZMA_SETTINGS.get(stream, _LZMA_DEFAULT)
    return [{"id": lzma.FILTER_LZMA1, "dict_size": 1 << 22, "mode": lzma.MODE_NORMAL, "depth": 0, **settings}]


def _compress(stream: str, raw: bytes) -> bytes:
    if not raw:
        return b""
    return lzma.compress(raw, format=lzma.FORMAT_RAW, filters=_filters(stream))


def _decompress(stream: str, data: bytes, expected: int) -> bytes:
    if expected == 0:
        if data:
            raise CsdError(f"teacher top-k block: stream {stream} should be empty; the shard is corrupt, re-run teacher-logits.")
        return b""
    try:
        raw = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=_filters(stream)).decompress(data, expected)
    except lzma.LZMAError as err:
        raise CsdError(f"teacher top-k block: stream {stream} does not decompress ({err}); the shard is corrupt, "
                       "re-run teacher-logits.") from None
    if len(raw) != expected:
        raise CsdError(f"teacher top-k block: stream {stream} holds {len(raw)} bytes, expected {expected}; the shard is "
                       "corrupt, re-run teacher-logits.")
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


def encode_block(ids, logprobs, observed_ids, observed_logprobs) -> bytes:
    """Encode one block of teacher positions.

    ids: int [P, k] top-k token ids (k <= 255, ids < 2**24); logprobs: float [P, k] their
    log-probabilities (finite, any order); observed_ids: int [P], the next token of each position or
    -1 where there is none (the last position of a row); observed_logprobs: float [P] the
    log-probability of that token (ignored where observed_ids is -1).
    Returns the payload bytes. Raises ValueError on inconsistent shapes or out-of-range ids.
    """
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
    if positions and (ids.min() < 0 or ids.max() >= 1 << 24):
        raise ValueError("top-k ids must be in [0, 2**24)")
    id_width = 3 if positions and ids.max() >= 1 << 16 else 2

    ids, q = canonical_order(ids, quantize(logprobs))
    gaps = np.diff(q, axis=1)  # [P, k-1], non-negative by the canonical order
    gaps_rank_major = np.ascontiguousarray(gaps.T)
    escaped = gaps_rank_major >= _GAP_ESCAPE

    has_observed = observed_ids >= 0
    obs_ids = observed_ids[has_observed]
    match = ids[has_observed] == obs_ids[:, None]
    found = match.any(axis=1)
    obs_index = np.where(found, match.argmax(axis=1), k).astype(np.uint8)
    outside = ~found
    q_obs = quantize(observed_logprobs[has_observed][outside])
    # The observed token is outside the top-k, so its log-prob is at most the k-th value.
    obs_gap = np.maximum(q_obs - q[has_observed][outside, k - 1], 0)

    raw = {
        "top": _be16(q[:, 0]),
        "ids_lo": _be16(ids & 0xFFFF),
        "ids_hi": (ids >> 16).astype(np.uint8).tobytes() if id_width == 3 else b"",
        "gaps": np.minimum(gaps_rank_major, _GAP_ESCAPE).astype(np.uint8).tobytes(),
        "gaps_x": _be16(gaps_rank_major[escaped]),
        "obs": obs_index.tobytes(),
        "obs_x": _be16(obs_gap),
    }
    packed = [_compress(name, raw[name]) for name in STREAMS]
    header = _HEADER.pack(MAGIC, positions, k, id_width, int(has_observed.sum()), *(len(p) for p in packed))
    return header + b"".join(packed)


def block_header(payload: bytes) -> dict:
    """The header of an encoded block: {"positions", "k", "id_width", "observed", "stream_bytes"}."""
    if len(payload) < _HEADER.size:
        raise CsdError("teacher top-k block is shorter than its header; the shard is corrupt, re-run teacher-logits.")
    magic, positions, k, id_width, observed, *lengths = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise CsdError(f"teacher top-k block starts with {magic!r}, not {MAGIC!r}: not this encoding ({ENCODING}); "
                       "re-run teacher-logits with this csd-pipeline.")
    return {"positions": positions, "k": k, "id_width": id_width, "observed": observed,
            "stream_bytes": dict(zip(STREAMS, lengths))}


def decode_block(payload: bytes, observed_mask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode a block written by `encode_block`.

    observed_mask: bool [P], True where the position has an observed next token (the encoder's
    observed_ids >= 0). Returns (ids int32 [P, k], logprobs float32 [P, k] in descending order,
    observed_logprob float32 [P], NaN where the mask is False). Raises CsdError on a corrupt payload.
    """
    header = block_header(payload)
    positions, k, id_width = header["positions"], header["k"], header["id_width"]
    observed_mask = np.asarray(observed_mask, dtype=bool)
    if observed_mask.shape != (positions,) or int(observed_mask.sum()) != header["observed"]:
        raise CsdError(f"teacher top-k block holds {positions} positions ({header['observed']} with a next token) but "
                       f"the rows say {observed_mask.size} ({int(observed_mask.sum())}); the shard is corrupt, re-run "
                       "teacher-logits.")
    chunks, offset = {}, _HEADER.size
    for name in STREAMS:
        size = header["stream_bytes"][name]
        chunks[name] = payload[offset:offset + size]
        offset += size
    if offset != len(payload):
        raise CsdError("teacher top-k block has trailing bytes; the shard is corrupt, re-run teacher-logits.")

    def stream(name, expected):
        return _decompress(name, chunks[name], expected)

    top = np.frombuffer(stream("top", 2 * positions), dtype=">u2").astype(np.int64)
    ids = np.frombuffer(stream("ids_lo", 2 * positions * k), dtype=">u2").astype(np.int32).reshape(positions, k)
    if id_width == 3:
        ids |= np.frombuffer(stream("ids_hi", positions * k), dtype=np.uint8).astype(np.int32).reshape(positions, k) << 16
    gaps = np.frombuffer(stream("gaps", positions * (k - 1)), dtype=np.uint8).astype(np.int64)
    escaped = gaps == _GAP_ESCAPE
    gaps[escaped] = np.frombuffer(stream("gaps_x", 2 * int(escaped.sum())), dtype=">u2")
    q = np.empty((positions, k), dtype=np.int64)
    q[:, 0] = top
    q[:, 1:] = gaps.reshape(k - 1, positions).T
    np.cumsum(q, axis=1, out=q)

    observed_count = header["observed"]
    obs_index = np.frombuffer(stream("obs", observed_count), dtype=np.uint8).astype(np.int64)
    outside = obs_index == k
    if obs_index.size and obs_index.max() > k:
        raise CsdError("teacher top-k block has an observed index beyond k; the shard is corrupt, re-run teacher-logits.")
    obs_gap = np.frombuffer(stream("obs_x", 2 * int(outside.sum())), dtype=">u2").astype(np.int64)
    q_sub = q[observed_mask]
    q_obs = np.empty(observed_count, dtype=np.int64)
    q_obs[~outside] = q_sub[~outside, obs_index[~outside]]
    q_obs[outside] = q_sub[outside, k - 1] + obs_gap
    observed = np.full(positions, np.nan, dtype=np.float32)
    observed[observed_mask] = dequantize(q_obs)
    return ids, dequantize(q), observed
