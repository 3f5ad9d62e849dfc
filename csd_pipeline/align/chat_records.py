"""Chat records and what chat mode supervises in them.

A chat record is `{"messages": [{"role", "content", ...}], "tools"?: [...]}`; an assistant message may
carry its reasoning as `reasoning_content` (aliases `thinking`, `reasoning`) or inline as
`<think>...</think>` at the start of its content. `record_messages` checks a record; a record that
cannot be used raises `ChatRefusal(reason)`, which the align stage counts. `ChatOptions` says which
regions of the final assistant turn are trained on and which enter KD (see docs/CHAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from csd_pipeline.errors import CsdError

REGIONS = ("reasoning", "close", "answer", "eot")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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


def record_messages(record) -> tuple[list[dict], list | None]:
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


def split_inline_thinking(message: dict) -> dict:
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


def with_reasoning_aliases(message: dict) -> dict:
    """Give a message's reasoning under every name templates read (as transformers does)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {**message, **{k: reasoning for k in REASONING_FIELDS}}


def strings_outside_content(messages: list, tools):
    """Every string of the messages outside their content and reasoning (roles, tool calls, keys), and of `tools`."""

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
