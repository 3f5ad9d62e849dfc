"""Where each message string lies in a rendered chat: the sentinel rendering and its layout search.

The template renders the conversation twice: once with every content and reasoning string replaced
by a unique sentinel of private-use characters, once with the real strings. Splitting the sentinel
rendering at the sentinels gives the template's own text (pieces) and where each message string
goes. The real rendering must equal the pieces with each string put back, verbatim or as the
template trimmed it (`strip`, `lstrip`, `rstrip`, of whitespace or newlines only); anything else (a
template that rewrites content or branches on it) refuses the record. So the position of every
message string in the rendering is known exactly (`string_layout`).
"""

from __future__ import annotations

import re

from csd_pipeline.align.chat_records import ChatRefusal

# Sentinel k: START + k in private-use digits + END. Message strings may not contain START/END.
SENTINEL_START, SENTINEL_END = "\ue000", "\ue001"
_DIGIT0 = 0xE010
_SENTINEL = re.compile(SENTINEL_START + "([\ue010-\ue019]+)" + SENTINEL_END)
_TRIMS = ((None, None), ("strip", None), ("lstrip", None), ("rstrip", None),
          ("strip", "\n"), ("lstrip", "\n"), ("rstrip", "\n"))
_WALK_LIMIT = 20_000  # steps of the trimmed-layout search before a record is refused as ambiguous


def sentinel(k: int) -> str:
    """The sentinel that stands for message string `k` in the sentinel rendering."""
    return SENTINEL_START + "".join(chr(_DIGIT0 + int(d)) for d in str(k)) + SENTINEL_END


def _sentinel_index(match) -> int:
    return int("".join(str(ord(c) - _DIGIT0) for c in match.group(1)))


def _trimmed(value: str, how) -> str:
    method, chars = how
    return value if method is None else getattr(value, method)(chars)


def string_layout(sentinel_text: str, real_text: str, strings: list[str]) -> list[tuple[int, int, int]]:
    """Where each message string lies in `real_text`: [(string index, start, end)] in order.

    `sentinel_text` is the rendering with sentinels; the real rendering must be its template pieces with
    each sentinel replaced by its string, verbatim or trimmed (the same trims as templates use). The
    search tries verbatim first and backtracks (bounded); raises `ChatRefusal` when no layout exists.
    """
    pieces, order = [], []
    position = 0
    for match in _SENTINEL.finditer(sentinel_text):
        pieces.append(sentinel_text[position:match.start()])
        index = _sentinel_index(match)
        if index >= len(strings):
            raise ChatRefusal("template_invents_content")
        order.append(index)
        position = match.end()
    pieces.append(sentinel_text[position:])
    if any(SENTINEL_START in p or SENTINEL_END in p for p in pieces):
        raise ChatRefusal("template_cuts_content")
    # Fast path: every string verbatim.
    spans, cursor, out = [], 0, []
    for piece, index in zip(pieces, order):
        cursor += len(piece)
        out.append(piece)
        out.append(strings[index])
        spans.append((index, cursor, cursor + len(strings[index])))
        cursor += len(strings[index])
    out.append(pieces[-1])
    if "".join(out) == real_text:
        return spans
    # Trimmed layout: depth-first over the trims of each occurrence.
    if not real_text.startswith(pieces[0]):
        raise ChatRefusal("template_changes_with_content")
    stack = [(0, len(pieces[0]), 0)]  # (occurrence, position in real_text, next trim to try)
    chosen: list[tuple[int, int, int]] = []
    steps = 0
    while stack:
        steps += 1
        if steps > _WALK_LIMIT:
            raise ChatRefusal("template_layout_ambiguous")
        occurrence, at, trim = stack.pop()
        del chosen[occurrence:]
        if occurrence == len(order):
            if at == len(real_text):
                return chosen
            continue
        if trim + 1 < len(_TRIMS):
            stack.append((occurrence, at, trim + 1))
        value = _trimmed(strings[order[occurrence]], _TRIMS[trim])
        if any(value == _trimmed(strings[order[occurrence]], t) for t in _TRIMS[:trim]):
            continue  # the same text as an earlier trim
        after = pieces[occurrence + 1]
        if real_text.startswith(value, at) and real_text.startswith(after, at + len(value)):
            chosen.append((order[occurrence], at, at + len(value)))
            stack.append((occurrence + 1, at + len(value) + len(after), 0))
    raise ChatRefusal("template_changes_with_content")


def complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The gaps between sorted, non-overlapping spans within [0, length)."""
    gaps, position = [], 0
    for start, end in spans:
        if position < start:
            gaps.append((position, start))
        position = max(position, end)
    if position < length:
        gaps.append((position, length))
    return gaps
