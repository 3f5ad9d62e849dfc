"""Chat templates: load (a file, a tokenizer_config.json, GGUF metadata, or the tokenizer's own) and render.

Rendering follows transformers' `apply_chat_template`: a sandboxed jinja2 environment with
`trim_blocks`/`lstrip_blocks`, `raise_exception`, the `tojson` filter, `{% generation %}` blocks and
`loopcontrols`; `add_generation_prompt=False` for whole conversations (align), True for the prompt
of a turn to write (generate). One difference: `strftime_now` is pinned to
`TEMPLATE_DATE`, so that a template that prints today's date (Llama 3) renders the same every day.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from csd_pipeline.errors import CsdError
from csd_pipeline.runtime.files import bytes_sha256

# strftime_now() in templates (Llama 3 prints today's date) is pinned, so that shards do not depend on the day.
TEMPLATE_DATE = datetime(2024, 7, 26)


class TemplateRenderError(Exception):
    """The template raised while rendering a conversation (raise_exception, a bad field, ...)."""


class ChatTemplate:
    """A compiled chat template (or a named set, as in tokenizer_config.json) and where it came from."""

    def __init__(self, source, origin: str):
        self.origin = origin
        if isinstance(source, str):
            named = {"default": source}
        elif isinstance(source, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                              and isinstance(t.get("template"), str) for t in source):
            named = {t["name"]: t["template"] for t in source}
        else:
            raise CsdError(f"chat template from {origin} is neither a string nor a list of named templates; fix it.")
        if "default" not in named:
            raise CsdError(f"chat template from {origin} has no template named 'default'; add one.")
        self.texts = named
        self.sha256 = bytes_sha256(json.dumps(named, sort_keys=True).encode("utf-8"))
        self._compiled = {name: _compile(text, origin) for name, text in named.items()}

    def render(self, messages: list, tools, variables: dict, add_generation_prompt: bool = False) -> str:
        """Render a conversation: a whole one (align), or with `add_generation_prompt` the history up to the
        assistant turn the model is to write (generate); raises `TemplateRenderError`."""
        import jinja2

        template = self._compiled["tool_use" if tools and "tool_use" in self._compiled else "default"]
        try:
            return template.render(messages=messages, tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError):
            raise TemplateRenderError(self.origin) from None


def _compile(text: str, origin: str):
    """Compile like transformers' apply_chat_template: sandboxed, trim/lstrip blocks, HF's globals."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for HF's masks; here it renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = TEMPLATE_DATE.strftime
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as err:
        raise CsdError(f"chat template from {origin} does not compile (line {err.lineno}: {err.message}); "
                       "fix the template or pass another with --student-chat-template / --teacher-chat-template.") from None


def load_chat_template(bundle, path: str | None, who: str) -> ChatTemplate:
    """The chat template of one side: `path` (a .jinja/text file, a tokenizer_config.json or a GGUF file)
    when given, else the tokenizer's `chat_template` (tokenizer_config.json; the fixtures copy it from
    GGUF metadata). `who` names the side in errors ("student", "teacher 0"). Raises `CsdError`."""
    flag = "--student-chat-template" if who == "student" else "--teacher-chat-template"
    if path is None:
        source = bundle.config.get("chat_template")
        if not source:
            raise CsdError(f"the {who} tokenizer {bundle.source} has no chat template (no chat_template in its "
                           f"tokenizer_config.json); pass {flag} FILE.")
        return ChatTemplate(source, f"the {who} tokenizer {bundle.source}")
    file = Path(path)
    if not file.is_file():
        raise CsdError(f"{flag} {path}: no such file; pass a .jinja file, a tokenizer_config.json or a GGUF file.")
    if file.suffix.lower() == ".gguf":
        source = gguf_chat_template(file)
        if not source:
            raise CsdError(f"{flag} {path}: the GGUF file has no tokenizer.chat_template; pass a .jinja file.")
        return ChatTemplate(source, str(path))
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CsdError(f"{flag} {path}: cannot read it as UTF-8 text ({err.__class__.__name__}).") from None
    if file.suffix.lower() == ".json":
        try:
            source = json.loads(text).get("chat_template")
        except (ValueError, AttributeError, RecursionError):
            source = None
        if not source:
            raise CsdError(f"{flag} {path}: the JSON file has no chat_template; pass a .jinja file.")
        return ChatTemplate(source, str(path))
    return ChatTemplate(text, str(path))


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_chat_template(path) -> str | None:
    """`tokenizer.chat_template` from a GGUF file's metadata (None when absent), read without parsing
    the vocabulary arrays. Raises `CsdError` when the file is not a little-endian GGUF v2/v3 file."""
    import mmap
    import struct

    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
                raise ValueError("not a GGUF v2/v3 file")
            count = struct.unpack_from("<Q", data, 16)[0]
            at = 24

            def string(at):
                size = struct.unpack_from("<Q", data, at)[0]
                return bytes(data[at + 8:at + 8 + size]), at + 8 + size

            def skip(kind, at):
                if kind in _GGUF_SIZES:
                    return at + _GGUF_SIZES[kind]
                if kind == _GGUF_STRING:
                    return string(at)[1]
                if kind == _GGUF_ARRAY:
                    inner, n = struct.unpack_from("<IQ", data, at)
                    at += 12
                    if inner in _GGUF_SIZES:
                        return at + n * _GGUF_SIZES[inner]
                    for _ in range(n):
                        at = skip(inner, at)
                    return at
                raise ValueError(f"unknown GGUF value type {kind}")

            for _ in range(count):
                key, at = string(at)
                kind = struct.unpack_from("<I", data, at)[0]
                at += 4
                if key == b"tokenizer.chat_template" and kind == _GGUF_STRING:
                    return string(at)[0].decode("utf-8")
                at = skip(kind, at)
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise CsdError(f"{path} is not a readable GGUF file ({err}); pass a .jinja template instead.") from None
    return None
