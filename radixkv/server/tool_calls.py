"""Tool calls out of a chat reply: the model writes them as text, the API returns them as
``message.tool_calls`` (``radixkv serve --tool-call-parser NAME``, vLLM's flag and names).

Two formats, the ones the served architectures' chat templates ask for:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, many fine-tunes): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
  outside the tags is the message's content. A last block the model did not close (it stopped
  at its end-of-turn token) counts when its JSON is whole.
- ``llama3_json`` (Llama 3.1 / 3.2 with JSON tool calling): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after
  ``<|python_tag|>``; anything else is plain content.

A reply that does not parse as calls is returned as content, unchanged: a malformed call is the
model's text, never an error. Arguments are returned as a JSON string, as OpenAI's API does.

Streaming (:class:`ToolCallStream`): content is passed through as it comes until a call may be
starting (the start tag, or a prefix of it at the end of the text so far; for ``llama3_json`` a
reply that opens with ``{``); from there the text is held back, and the calls are sent with
the finish, in one delta, with ``finish_reason: "tool_calls"``. Held-back text that turns out
not to be a call is sent as content then.

Forced calls (:class:`ForcedToolChoice`, ``tool_choice`` naming a function or ``"required"``,
as vLLM does them): the reply is guided decoding's JSON, not the model's native call format,
and needs no parser: for a named function it is the call's arguments, for ``"required"`` a JSON
array of ``{"name": ..., "parameters": {...}}``, one element per call. Streamed, it is held back
whole and sent as calls with the finish. A reply that is not whole (``max_tokens`` cut it) is
returned as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json")

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as a JSON string; ``id`` is
    made up here (``call_<hex>``), as clients echo it back in the ``tool`` message."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ForcedToolChoice:
    """How to read a reply whose tool call was forced: ``name`` the function ``tool_choice``
    named (the reply is its arguments), or None for ``"required"`` (the reply is a JSON array
    of ``{"name", "parameters"}`` objects)."""

    name: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(None, calls), or (text, []) when the reply is not the JSON asked for."""
        try:
            value = json.loads(text)
        except ValueError:
            return text, []
        if self.name is not None:
            # the arguments as generated (guided decoding made them valid JSON)
            return None, [ToolCall(self.name, text.strip())]
        if not isinstance(value, list) or not value:
            return text, []
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return text, []
            args = item.get("parameters", {})
            calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
        return None, calls


# how a reply's calls are read: a --tool-call-parser name, or a forced tool choice
ToolParser = str | ForcedToolChoice


def _check_parser(parser: ToolParser) -> None:
    if isinstance(parser, ForcedToolChoice):
        return
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}; choose from {TOOL_CALL_PARSERS}")


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall from a decoded JSON object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # already a JSON string: keep it if it is one
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls(chunks: list[str], args_key: str) -> list[ToolCall] | None:
    """One call per JSON chunk, or None when any chunk is not one."""
    calls = []
    for chunk in chunks:
        try:
            call = _call(json.loads(chunk), args_key)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def parse_tool_calls(text: str, parser: ToolParser) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply. With no calls found the content is ``text`` itself;
    with calls it is the text around them, stripped, or None when nothing is left."""
    _check_parser(parser)
    if isinstance(parser, ForcedToolChoice):
        return parser.parse(text)
    if parser == "hermes":
        if _HERMES_START not in text:
            return text, []
        calls = _calls([m.group(1) for m in _HERMES_BLOCK.finditer(text)], "arguments")
        if calls is None:
            return text, []
        rest = _HERMES_BLOCK.sub("", text).strip()
        return (rest or None), calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()  # llama3_json
    calls = _calls(body.split(";"), "parameters") if body.startswith("{") else None
    if calls is None:
        return text, []
    return None, calls


class ToolCallStream:
    """One streamed choice's text through the parser (module doc). ``feed(new_text)`` returns
    the content that can be sent now; ``finish()`` returns (content still held back, calls)."""

    def __init__(self, parser: ToolParser) -> None:
        _check_parser(parser)
        self.parser = parser
        self._text = ""  # everything so far
        self._sent = 0  # chars of it sent as content

    def _safe_end(self) -> int:
        """How much of the text can go out as content without splitting a possible call."""
        text = self._text
        if isinstance(self.parser, ForcedToolChoice):
            return 0  # the whole reply is the call(s): sent with the finish
        if self.parser == "llama3_json":
            head = text.lstrip()
            # a reply that opens like a call is held whole (it is one, or it is sent at the end)
            if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
                return 0
            return len(text)
        i = text.find(_HERMES_START, self._sent)
        if i >= 0:
            return i
        # hold back a tail that could be the start tag's beginning ("<", "<tool", ...)
        for k in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
            if _HERMES_START.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def feed(self, new_text: str) -> str:
        self._text += new_text
        end = max(self._safe_end(), self._sent)
        out = self._text[self._sent : end]
        self._sent = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls): the held-back text is parsed; when it holds no calls
        it is content after all."""
        held = self._text[self._sent :]
        self._sent = len(self._text)
        content, calls = parse_tool_calls(held, self.parser)
        if not calls:
            return held, []
        return (content or ""), calls
