"""Chat mode: render each side's own chat template and find the final assistant turn in its tokens.

One side (the student or a teacher) renders a chat record (`chat_records`) in four steps
(`ChatSide.render`):

1. Sentinels. The template renders the conversation with sentinels and with the real strings;
   `chat_layout.string_layout` finds where each message string lies in the real rendering, or
   refuses the record.
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
`chat_mode.py` compares the sides and aligns the regions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from csd_pipeline.align.chat_layout import SENTINEL_END, SENTINEL_START, complement, sentinel, string_layout
from csd_pipeline.align.chat_records import (
    REASONING_FIELDS,
    ChatOptions,
    ChatRefusal,
    record_messages,
    split_inline_thinking,
    strings_outside_content,
    with_reasoning_aliases,
)
from csd_pipeline.align.templates import ChatTemplate, TemplateRenderError
from csd_pipeline.errors import CsdError


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

    `bundle` is a `vocab.vocabulary.TokenizerBundle`. Raises `CsdError` (via `check`) when the template and the
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
        self._tokenizer = prefix_free_tokenizer(bundle)
        self.variables = {name: _token_text(bundle.config.get(name))
                          for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.variables = {k: v for k, v in self.variables.items() if v is not None}
        self.native_reasoning = self._renders_reasoning()

    def _renders_reasoning(self) -> bool:
        """Whether the template renders an assistant message's `reasoning_content` (a `<think>` block)."""
        messages = [{"role": "user", "content": sentinel(0)},
                    {"role": "assistant", "content": sentinel(1), "reasoning_content": sentinel(2)}]
        try:
            text = self.template.render(messages, None, self.variables)
        except TemplateRenderError:
            return False
        return sentinel(2) in text

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
        real_text, spans, keys, final = self._render_strings(record)
        bounds = _final_turn_bounds(spans, keys, final, options)
        fields: dict = {}
        for k, start, end in spans:
            fields.setdefault(keys[k], []).append(real_text[start:end])
        a1 = next(end for name, _, end in bounds if name == "answer")
        cuts = sorted({b for _, s, e in bounds for b in (s, e)})
        ids, cut_tokens, specials = self._tokenize(real_text, [(s, e) for _, s, e in spans], cuts)
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

    def render_generation_prompt(self, messages: list, tools) -> tuple[str, np.ndarray]:
        """(text, ids) of the conversation `messages` rendered up to the assistant turn the model is to write
        (`add_generation_prompt`), tokenized as `render` tokenizes: special tokens only from the template's
        text, message strings never parsed. The messages must be checked (`record_messages` of the record
        with its final assistant message); raises `ChatRefusal`."""
        real_text, spans, _ = self._render_messages(messages, tools, add_generation_prompt=True)
        ids, _, _ = self._tokenize(real_text, [(s, e) for _, s, e in spans], [])
        return real_text, ids

    def _render_strings(self, record: dict) -> tuple[str, list[tuple[int, int, int]], list[tuple[int, str]], int]:
        """(the rendering, [(string index, start, end)] of every rendered message string, the (message, field)
        of each string index, the index of the final message); raises `ChatRefusal`."""
        messages, tools = record_messages(record)
        return (*self._render_messages(messages, tools), len(messages) - 1)

    def _render_messages(self, messages: list, tools, add_generation_prompt: bool = False):
        """(the rendering, [(string index, start, end)], the (message, field) of each string index)."""
        if self.native_reasoning:
            messages = [split_inline_thinking(m) for m in messages]
        strings: dict[tuple[int, str], str] = {}
        masked = []
        for i, message in enumerate(messages):
            message = dict(message)
            for key in ("content", *REASONING_FIELDS):
                value = message.get(key)
                if isinstance(value, str) and (key == "content" or value):
                    if SENTINEL_START in value or SENTINEL_END in value:
                        raise ChatRefusal("private_use_marker_in_content")
                    strings[(i, key)] = value
                    message[key] = sentinel(len(strings) - 1)
            masked.append(with_reasoning_aliases(message))
        self._check_outside_content(masked, tools)
        real = [with_reasoning_aliases(m) for m in messages]
        try:
            sentinel_text = self.template.render(masked, tools, self.variables, add_generation_prompt)
            real_text = self.template.render(real, tools, self.variables, add_generation_prompt)
        except TemplateRenderError:
            raise ChatRefusal("template_error") from None
        keys = list(strings)
        return real_text, string_layout(sentinel_text, real_text, [strings[k] for k in keys]), keys

    def _check_outside_content(self, messages: list, tools) -> None:
        """Strings the template renders as its own text (roles, tool definitions and calls) may not hold a
        special token's text or a sentinel marker: they would become control tokens."""
        for text in strings_outside_content(messages, tools):
            if SENTINEL_START in text or SENTINEL_END in text:
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
            for t0, t1 in complement(content_spans, len(text)):
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
        from csd_pipeline.vocab.vocabulary import byte_ends_from_offsets

        encoding = self._tokenizer.encode(region.text, add_special_tokens=False)
        if list(encoding.ids) != tokens.tolist():
            raise ChatRefusal("region_tokens_depend_on_context")
        return byte_ends_from_offsets(region.text, encoding.offsets)


def _final_turn_bounds(spans: list, keys: list, final: int, options: ChatOptions) -> list[tuple[str, int, int]]:
    """(region, start, end) character ranges of the final turn's regions in the rendering; raises `ChatRefusal`."""
    answer = [(s, e) for k, s, e in spans if keys[k] == (final, "content")]
    if len(answer) != 1:
        raise ChatRefusal("final_content_not_rendered" if not answer else "final_content_rendered_twice")
    a0, a1 = answer[0]
    if not options.include_thinking:
        return [("answer", a0, a1)]
    reasoning = [(s, e) for k, s, e in spans if keys[k][0] == final and keys[k][1] in REASONING_FIELDS]
    if len(reasoning) > 1:
        raise ChatRefusal("final_reasoning_rendered_twice")
    if reasoning:
        r0, r1 = reasoning[0]
        if r1 > a0 or any(s < a0 and e > r1 for _, s, e in spans):
            raise ChatRefusal("reasoning_not_before_answer")
        return [("reasoning", r0, r1), ("close", r1, a0), ("answer", a0, a1)]
    if any(k[0] == final and k[1] in REASONING_FIELDS for k in keys):
        raise ChatRefusal("reasoning_not_rendered")
    return [("answer", a0, a1)]


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def prefix_free_tokenizer(bundle):
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
