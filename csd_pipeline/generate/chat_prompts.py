"""Chat prompts of the generate stage: records whose final assistant turn the student writes.

A prompt is a chat record as chat mode reads it (docs/CHAT.md): `{"messages": [...], "tools"?: [...]}`.
The turn to write is the final message when it is the assistant's (its content, possibly empty, is
replaced and kept as the sample's `generated.reference` when non-empty), else a new assistant message appended
to the conversation. The student's chat template renders the messages before that turn with
`add_generation_prompt` (`align.chat_render.ChatSide.render_generation_prompt`: special tokens only
from the template, message text never parsed into them); the sample is the completed record, which
`csd-pipeline align --mode chat` reads and supervises on the written turn only.

The written record is checked once more: its rendering by chat mode must start with exactly the ids
the student was prompted with, up to the written content (`prompt_not_prefix` otherwise), so that the
context the student is trained with is the context it wrote in.
"""

from __future__ import annotations

import json

from csd_pipeline.align.chat_records import ChatOptions, ChatRefusal, record_messages

PLACEHOLDER = "x"  # stands for the content to write while a prompt record is checked


def chat_prompt(source: str, record_index: int, text: str) -> tuple[dict | None, str | None]:
    """({"source", "record_index", "record"[, "reference"]}, None) for a usable chat prompt, else (None, reason).

    `text` is the record as JSON (the corpus readers' whole-record documents). The entry's record (JSON
    text, its keys in the input's order) ends with an assistant message whose content is "" (the turn to write)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None, "broken_json"
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
        return None, "missing_messages"
    messages = list(record["messages"])
    final = messages[-1]
    reference = None
    if isinstance(final, dict) and final.get("role") == "assistant":
        reference = final.get("content")
        messages[-1] = {**final, "content": ""}
    else:
        messages.append({"role": "assistant", "content": ""})
    if len(messages) < 2:
        return None, "nothing_before_the_turn"
    try:
        record_messages({**record, "messages": with_content(messages, PLACEHOLDER)})
    except ChatRefusal as refusal:
        return None, refusal.reason
    if reference is not None and not isinstance(reference, str):
        return None, "content_not_string"
    # The record travels as JSON text: the executor's plan may be written with sorted keys and read back,
    # and the record's own key order must survive that for a re-run to write the same bytes.
    entry = {"source": source, "record_index": record_index,
             "record": json.dumps({**record, "messages": messages}, ensure_ascii=False)}
    if reference:
        entry["reference"] = reference
    return entry, None


def with_content(messages: list, content: str) -> list:
    """`messages` with the final message's content replaced."""
    return [*messages[:-1], {**messages[-1], "content": content}]


class ChatPrompter:
    """The student's chat side (`ChatSide`): prompt ids for a chat entry, and the check of a written record."""

    def __init__(self, bundle, template_path: str | None):
        from csd_pipeline.align.chat_render import ChatSide
        from csd_pipeline.align.templates import load_chat_template

        self.side = ChatSide(bundle, load_chat_template(bundle, template_path, "student"), "student")

    def prompt_ids(self, entry: dict) -> list[int]:
        """The ids the student is prompted with; raises `ChatRefusal`."""
        record = json.loads(entry["record"])
        _, ids = self.side.render_generation_prompt(record["messages"][:-1], record.get("tools"))
        return ids.tolist()

    def check_written(self, record: dict, prompt: list[int]) -> str | None:
        """None when chat mode renders `record` (its final content written) as `prompt` + the content, else
        the reason ("prompt_not_prefix" or chat mode's refusal). An empty completion is not checked."""
        if not record["messages"][-1]["content"]:
            return None
        try:
            rendered = self.side.render(record, ChatOptions())
        except ChatRefusal as refusal:
            return refusal.reason
        start = rendered.first_region_token
        return None if rendered.ids[:start].tolist() == prompt else "prompt_not_prefix"


def written_record(entry: dict, completion: str, extra: dict) -> dict:
    """The sample: the prompt record (every field kept) with the written turn's content, and one more field,
    `generated`: `extra` (source, record index, sample, finish, completion tokens) and the reference."""
    record = json.loads(entry["record"])
    generated = {**extra, **({"reference": entry["reference"]} if "reference" in entry else {})}
    return {**record, "messages": with_content(record["messages"], completion), "generated": generated}
