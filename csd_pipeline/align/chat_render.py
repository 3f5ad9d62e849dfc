"""Chat mode: render each model's own chat template and find the final assistant turn in its tokens.

A chat record is `{"messages": [{"role", "content", ...}], "tools"?: [...]}`; an assistant message may
carry its reasoning as `reasoning_content` (aliases `thinking`, `reasoning`) or inline as
`<think>...</think>` at the start of its content. One side (the student or a teacher) renders the
record in four steps (`ChatSide.render`):

1. Sentinels. The template renders the conversation twice: once with every content and reasoning
   string replaced by a unique sentinel of private-use characters, once with the real strings.
   Splitting the sentinel rendering at the sentinels gives the template's own text (pieces) and
   where each message string goes. The real rendering must equal the pieces with each string put
   back, verbatim or as the template trimmed it (`strip`, `lstrip`, `rstrip`, of whitespace or
   newlines only); anything else (a template that rewrites content or branches on it) refuses
   the record. So the position of every message string in the rendering is known exactly.
2. Special tokens come only from the template: the template's pieces are searched for the
   tokenizer's special tokens; message strings never are (a message that contains
   `<|im_start|>` stays text). The text between special tokens is tokenized with special-token
   parsing off, in one piece (as the model sees it at inference), except that token boundaries
   are forced at the edges of the supervised regions so that their tokens spell exactly their bytes.
3. The final assistant turn: `answer` (its content as rendered), then the end-of-turn token `eot`,
   which must be the special token the template emits right after the content. With
   `include_thinking` and a template that renders reasoning (Qwen3-style `<think>` blocks),
   `reasoning` (the reasoning as rendered) and `close` (the template's text between reasoning and
   answer, e.g. `\\n</think>\\n\\n`) come first; the opening scaffold (`<think>\\n`) stays context.
4. Everything before the first region is context, everything after `eot` is the tail.

A record that cannot be rendered exactly raises `ChatRefusal(reason)`; the align stage counts it.
`chat_align.py` compares the sides and aligns the regions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from csd_pipeline.align.templates import (
    ChatTemplate,
    TemplateRenderError,
    gguf_chat_template,
    load_chat_template,
)
from csd_pipeline.errors import CsdError

__all__ = ["ChatOptions", "ChatRefusal", "ChatSide", "ChatTemplate", "RenderedChat", "Region", "gguf_chat_template",
           "load_chat_template"]

REGIONS = ("reasoning", "close", "answer", "eot")
CONTENT_REGIONS = ("reasoning", "close", "answer")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Sentinel k: START + k in private-use digits + END. Message strings may not contain START/END.
_START, _END, _DIGIT0 = "\ue000", "\ue001", 0xE010
_SENTINEL = re.compile(_START + "([\ue010-\ue019]+)" + _END)
_TRIMS = ((None, None), ("strip", None), ("lstrip", None), ("rstrip", None),
          ("strip", "\n"), ("lstrip", "\n"), ("rstrip", "\n"))
_WALK_LIMIT = 20_000  # steps of the trimmed-layout search before a record is refused as ambiguous


class ChatRefusal(Exception):
    """A chat record that cannot be rendered or aligned exactly; `reason` is the counted key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ChatOptions:
    """What chat mode supervises (see docs/CHAT.md).

    include_thinking: the final turn's reasoning and its closing marker are trained on too.
    alignment_regions: the regions whose chunks enter KD (subset of REGIONS); empty = all supervised.
    drop_first_assistant_chunk: per teacher, exclude the first accepted content chunk from KD.
    """

    include_thinking: bool = False
    alignment_regions: tuple[str, ...] = ()
    drop_first_assistant_chunk: tuple[bool, ...] = ()

    def validate(self, num_teachers: int) -> None:
        """Raise `CsdError` for an unsupported combination (one sentence naming the option)."""
        unknown = [r for r in self.alignment_regions if r not in REGIONS]
        if unknown:
            raise CsdError(f"--alignment-regions {','.join(unknown)} is unknown; choose from {','.join(REGIONS)}.")
        if self.alignment_regions and not self.include_thinking:
            raise CsdError("--alignment-regions selects <think> regions and needs --include-thinking; add it, or drop "
                           "--alignment-regions to align the answer and end-of-turn token.")
        if self.drop_first_assistant_chunk and len(self.drop_first_assistant_chunk) != num_teachers:
            raise CsdError(f"--drop-first-assistant-chunk has {len(self.drop_first_assistant_chunk)} entries for "
                           f"{num_teachers} teachers; name teacher indices 0..{num_teachers - 1}.")

    def supervised(self) -> tuple[str, ...]:
        """Regions in the student's loss mask."""
        return REGIONS if self.include_thinking else ("answer", "eot")

    def kd_regions(self) -> tuple[str, ...]:
        """Regions whose accepted chunks stay accepted (the others become OUTSIDE_LOSS_REGION)."""
        return tuple(self.alignment_regions) or self.supervised()

    def drops_first(self, teacher: int) -> bool:
        return bool(self.drop_first_assistant_chunk) and self.drop_first_assistant_chunk[teacher]

    def record(self) -> dict:
        """JSON form for the manifest."""
        return {"include_thinking": self.include_thinking, "alignment_regions": list(self.alignment_regions),
                "drop_first_assistant_chunk": list(self.drop_first_assistant_chunk)}


# ---------------------------------------------------------------------------------------------
# One side's rendering


@dataclass
class Region:
    """One region of the final assistant turn on one side: its text and its token range."""

    name: str
    text: str
    start: int  # first token
    end: int  # one past the last token
    ends: np.ndarray | None = None  # byte ends from character offsets, when the tokens do not spell `text`


@dataclass
class RenderedChat:
    """One side's rendering of one record: tokens, and where the final assistant turn lies in them."""

    text: str  # the rendering
    ids: np.ndarray  # int32, everything the model is fed
    regions: list[Region]  # the final turn's content regions (non-empty ones), in order
    eot: int  # token index of the end-of-turn token
    fields: dict = field(default_factory=dict)  # (message, field) -> rendered forms, for comparing sides

    @property
    def first_region_token(self) -> int:
        return self.regions[0].start if self.regions else self.eot

    def region(self, name: str) -> Region | None:
        return next((r for r in self.regions if r.name == name), None)


class ChatSide:
    """A tokenizer with its chat template: renders records into tokens with the final turn located.

    `bundle` is a `vocab.TokenizerBundle`. Raises `CsdError` (via `check`) when the template and the
    tokenizer do not work together (e.g. the template's end-of-turn marker is not a special token).
    """

    def __init__(self, bundle, template: ChatTemplate, who: str):
        self.bundle = bundle
        self.template = template
        self.who = who
        self._added = {t.content: (i, t.lstrip, t.rstrip)
                       for i, t in bundle.tokenizer.get_added_tokens_decoder().items() if t.special}
        names = sorted(self._added, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self._tokenizer = _prefix_free_tokenizer(bundle)
        self.variables = {name: _token_text(bundle.config.get(name))
                          for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.variables = {k: v for k, v in self.variables.items() if v is not None}
        self.native_reasoning = self._renders_reasoning()

    def _renders_reasoning(self) -> bool:
        """Whether the template renders an assistant message's `reasoning_content` (a `<think>` block)."""
        messages = [{"role": "user", "content": _sentinel(0)},
                    {"role": "assistant", "content": _sentinel(1), "reasoning_content": _sentinel(2)}]
        try:
            text = self.template.render(messages, None, self.variables)
        except TemplateRenderError:
            return False
        return _sentinel(2) in text

    def check(self, options: ChatOptions) -> None:
        """Render a small probe conversation; raise `CsdError` naming the template when it cannot work."""
        probe = {"messages": [{"role": "user", "content": "What is 2 + 2?"},
                              {"role": "assistant", "content": "2 + 2 is 4."}]}
        try:
            self.render(probe, ChatOptions())
        except ChatRefusal as refusal:
            raise CsdError(f"the chat template of the {self.who} ({self.template.origin}) cannot be used with the "
                           f"tokenizer {self.bundle.source}: a two-message probe is refused ({refusal.reason}); pass a "
                           "template written for this tokenizer.") from None
        if options.alignment_regions and not self.native_reasoning:
            raise CsdError(f"--alignment-regions needs templates that render <think> blocks from reasoning_content "
                           f"(Qwen3-style ChatML), but the {self.who} template ({self.template.origin}) does not; "
                           "drop --alignment-regions or pass such a template.")

    # --- rendering -----------------------------------------------------------------------------

    def render(self, record: dict, options: ChatOptions) -> RenderedChat:
        """Render `record` on this side; raises `ChatRefusal` when it cannot be done exactly."""
        messages, tools = _messages(record)
        if self.native_reasoning:
            messages = [_split_inline_thinking(m) for m in messages]
        final = len(messages) - 1
        strings: dict[tuple[int, str], str] = {}
        masked = []
        for i, message in enumerate(messages):
            message = dict(message)
            for key in ("content", *REASONING_FIELDS):
                value = message.get(key)
                if isinstance(value, str) and (key == "content" or value):
                    if _START in value or _END in value:
                        raise ChatRefusal("private_use_marker_in_content")
                    strings[(i, key)] = value
                    message[key] = _sentinel(len(strings) - 1)
            masked.append(_with_reasoning_aliases(message))
        self._check_outside_content(masked, tools)
        keys = list(strings)
        real_messages = [_with_reasoning_aliases(m) for m in messages]
        try:
            sentinel_text = self.template.render(masked, tools, self.variables)
            real_text = self.template.render(real_messages, tools, self.variables)
        except TemplateRenderError:
            raise ChatRefusal("template_error") from None
        spans = _layout(sentinel_text, real_text, [strings[k] for k in keys])
        fields: dict = {}
        for k, start, end in spans:
            fields.setdefault(keys[k], []).append(real_text[start:end])
        answer = [(s, e) for k, s, e in spans if keys[k] == (final, "content")]
        if len(answer) != 1:
            raise ChatRefusal("final_content_not_rendered" if not answer else "final_content_rendered_twice")
        a0, a1 = answer[0]
        bounds = [("answer", a0, a1)]
        if options.include_thinking:
            reasoning = [(s, e) for k, s, e in spans if keys[k][0] == final and keys[k][1] in REASONING_FIELDS]
            if len(reasoning) > 1:
                raise ChatRefusal("final_reasoning_rendered_twice")
            if reasoning:
                r0, r1 = reasoning[0]
                if r1 > a0 or any(s < a0 and e > r1 for _, s, e in spans):
                    raise ChatRefusal("reasoning_not_before_answer")
                bounds = [("reasoning", r0, r1), ("close", r1, a0), ("answer", a0, a1)]
            elif any(k[0] == final and k[1] in REASONING_FIELDS for k in keys):
                raise ChatRefusal("reasoning_not_rendered")
        content_spans = [(s, e) for _, s, e in spans]
        ids, cut_tokens, specials = self._tokenize(real_text, content_spans, sorted({b for _, s, e in bounds for b in (s, e)}))
        eot = specials.get(a1)
        if eot is None:
            raise ChatRefusal("no_end_of_turn_after_content")
        regions = []
        for name, start, end in bounds:
            if end <= start:
                continue
            if name == "close" and any(start <= p < end for p in specials):
                raise ChatRefusal("special_token_in_thinking_close")
            region = Region(name, real_text[start:end], cut_tokens[start], cut_tokens[end])
            region.ends = self._offset_ends(region, ids)
            regions.append(region)
        return RenderedChat(real_text, ids, regions, eot, {k: tuple(v) for k, v in fields.items()})

    def _check_outside_content(self, messages: list, tools) -> None:
        """Strings the template renders as its own text (roles, tool definitions and calls) may not hold a
        special token's text or a sentinel marker: they would become control tokens."""
        for text in _strings_outside_content(messages, tools):
            if _START in text or _END in text:
                raise ChatRefusal("private_use_marker_in_content")
            if self._special_re is not None and self._special_re.search(text):
                raise ChatRefusal("special_token_text_outside_content")

    def _tokenize(self, text: str, content_spans: list[tuple[int, int]], cuts: list[int]):
        """Token ids of a rendering: special tokens only from template text, the rest without special parsing.

        The text between two special tokens is tokenized in one piece, as the model sees it; where that
        puts no token boundary at a cut (a region edge), the piece is tokenized in parts split at its cuts.
        Returns (ids int32, {cut position: token index}, {start of each special match: token index}).
        """
        pieces = self._pieces(text, content_spans)
        texts = [text[a:b] for a, b, special, _ in pieces if special is None]
        encodings = iter(self._encode(texts))
        ids: list[int] = []
        at_position: dict[int, int] = {}
        specials: dict[int, int] = {}
        for a, b, match_start, special_id in pieces:
            at_position.setdefault(a, len(ids))
            if match_start is not None:
                specials[match_start] = len(ids)
                specials.setdefault(a, len(ids))
                ids.append(special_id)
                continue
            encoding = next(encodings)
            inner = [c for c in cuts if a < c < b]
            split = self._natural_split(text[a:b], encoding.ids, [c - a for c in inner]) if inner else []
            if split is None:  # no token boundary at a region edge: tokenize the parts on their own
                parts = [text[x:y] for x, y in zip([a, *inner], [*inner, b])]
                for x, part in zip([a, *inner], self._encode(parts)):
                    at_position[x] = len(ids)
                    ids.extend(part.ids)
                continue
            for c, index in zip(inner, split):
                at_position[c] = len(ids) + index
            ids.extend(encoding.ids)
        at_position[len(text)] = len(ids)
        if any(c not in at_position for c in cuts):
            # a cut inside whitespace that a special token strips: the region edge has no token boundary
            raise ChatRefusal("region_edge_inside_special_token")
        return np.asarray(ids, dtype=np.int32), {c: at_position[c] for c in cuts}, specials

    def _encode(self, texts: list[str]) -> list:
        """Encodings of `texts` (no special tokens added or parsed; offsets are not needed here)."""
        if not texts:
            return []
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return encode(texts, add_special_tokens=False)

    def _pieces(self, text: str, content_spans: list[tuple[int, int]]) -> list[tuple]:
        """(start, end, special match start or None, special id or None) covering `text` in order."""
        pieces: list[tuple] = []
        position = 0
        if self._special_re is not None:
            for t0, t1 in _complement(content_spans, len(text)):
                for match in self._special_re.finditer(text, t0, t1):
                    s, e = match.span()
                    token_id, lstrip, rstrip = self._added[match.group()]
                    if lstrip:
                        while s > max(t0, position) and text[s - 1].isspace():
                            s -= 1
                    if rstrip:
                        while e < t1 and text[e].isspace():
                            e += 1
                    if position < s:
                        pieces.append((position, s, None, None))
                    pieces.append((s, e, match.start(), token_id))
                    position = e
        if position < len(text):
            pieces.append((position, len(text), None, None))
        return pieces

    def _natural_split(self, piece: str, ids: list[int], cuts: list[int]) -> list[int] | None:
        """Token index at each character cut of `piece` when its tokens end exactly there, else None."""
        vocab = self.bundle.vocab
        spelled = [vocab.token_bytes[i] for i in ids]
        data = piece.encode("utf-8")
        if b"".join(spelled) != data:
            return None
        ends = np.cumsum([len(b) for b in spelled])
        out = []
        for c in cuts:
            at = len(piece[:c].encode("utf-8"))
            index = int(np.searchsorted(ends, at)) + 1
            if index > len(ends) or ends[index - 1] != at:
                return None
            out.append(index)
        return out

    def _offset_ends(self, region: Region, ids: np.ndarray) -> np.ndarray | None:
        """Byte ends from character offsets when the region's tokens do not spell its text (a normalizer)."""
        vocab = self.bundle.vocab
        tokens = ids[region.start:region.end]
        if b"".join(vocab.token_bytes[i] for i in tokens.tolist()) == region.text.encode("utf-8"):
            return None
        from csd_pipeline.vocab.vocabulary import _ends_from_offsets

        encoding = self._tokenizer.encode(region.text, add_special_tokens=False)
        if list(encoding.ids) != tokens.tolist():
            raise ChatRefusal("region_tokens_depend_on_context")
        return _ends_from_offsets(region.text, encoding.offsets)

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` as this side tokenizes message text (no special tokens, no dummy prefix)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------------------------------------
# Records


def _messages(record) -> tuple[list[dict], list | None]:
    """The record's messages (checked) and tools; raises `ChatRefusal` for a malformed record."""
    if not isinstance(record, dict):
        raise ChatRefusal("record_not_object")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRefusal("missing_messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatRefusal("malformed_message")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise ChatRefusal("content_not_string")
        for key in REASONING_FIELDS:
            if message.get(key) is not None and not isinstance(message[key], str):
                raise ChatRefusal("reasoning_not_string")
    final = messages[-1]
    if final["role"] != "assistant":
        raise ChatRefusal("last_message_not_assistant")
    if not isinstance(final.get("content"), str) or not final["content"]:
        raise ChatRefusal("empty_final_content")
    if final.get("tool_calls"):
        raise ChatRefusal("final_message_has_tool_calls")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatRefusal("tools_not_list")
    return messages, tools


def _split_inline_thinking(message: dict) -> dict:
    """An assistant message with `<think>r</think>a` content and no reasoning field -> reasoning r, content a
    (for templates that render reasoning themselves, as Qwen3's does with inline content)."""
    content = message.get("content")
    if (message.get("role") != "assistant" or not isinstance(content, str) or "</think>" not in content
            or any(message.get(k) is not None for k in REASONING_FIELDS)):
        return message
    head, _, answer = content.partition("</think>")
    lead, opened, reasoning = head.partition("<think>")
    if not opened or lead.strip():
        return message
    return {**message, "content": answer, "reasoning_content": reasoning}


def _with_reasoning_aliases(message: dict) -> dict:
    """Give a message's reasoning under every name templates read (as transformers does)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {**message, **{k: reasoning for k in REASONING_FIELDS}}


def _strings_outside_content(messages: list, tools):
    def walk(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield str(key)
                yield from walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                yield from walk(item)

    for message in messages:
        for key, value in message.items():
            if key not in ("content", *REASONING_FIELDS):
                yield from walk(value)
    yield from walk(tools)


def _sentinel(k: int) -> str:
    return _START + "".join(chr(_DIGIT0 + int(d)) for d in str(k)) + _END


def _sentinel_index(match) -> int:
    return int("".join(str(ord(c) - _DIGIT0) for c in match.group(1)))


def _trimmed(value: str, how) -> str:
    method, chars = how
    return value if method is None else getattr(value, method)(chars)


def _layout(sentinel_text: str, real_text: str, strings: list[str]) -> list[tuple[int, int, int]]:
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
    if any(_START in p or _END in p for p in pieces):
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


def _complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The gaps between sorted, non-overlapping spans within [0, length)."""
    gaps, position = [], 0
    for start, end in spans:
        if position < start:
            gaps.append((position, start))
        position = max(position, end)
    if position < length:
        gaps.append((position, length))
    return gaps


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _prefix_free_tokenizer(bundle):
    """The bundle's tokenizer without a dummy prefix (a rendered chat is cut into pieces; only the text
    of the whole document would get one) and with special-token parsing off."""
    if not bundle.vocab.dummy_prefix and '"add_prefix_space": true' not in bundle.raw_json.replace('":true', '": true'):
        return bundle.tokenizer
    spec = json.loads(bundle.raw_json)
    changed = False

    def strip_prefix(node):
        nonlocal changed
        if isinstance(node, dict):
            kind = node.get("type")
            if kind == "Sequence":
                for key in ("normalizers", "pretokenizers"):
                    if key in node:
                        kept = [n for n in node[key] if not (isinstance(n, dict) and n.get("type") == "Prepend")]
                        changed |= len(kept) != len(node[key])
                        node[key] = kept
                        for child in kept:
                            strip_prefix(child)
            elif kind == "Metaspace" and (node.get("prepend_scheme", "always") != "never" or node.get("add_prefix_space")):
                node["prepend_scheme"], node["add_prefix_space"] = "never", False
                changed = True
            elif kind == "ByteLevel" and node.get("add_prefix_space"):
                node["add_prefix_space"] = False
                changed = True
        return node

    normalizer = spec.get("normalizer")
    if isinstance(normalizer, dict) and normalizer.get("type") == "Prepend":
        spec["normalizer"], changed = None, True
    else:
        strip_prefix(normalizer)
    strip_prefix(spec.get("pre_tokenizer"))
    if not changed:
        return bundle.tokenizer
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.encode_special_tokens = True
    return tokenizer
