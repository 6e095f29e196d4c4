"""Tool calls out of a chat reply: the model writes them as text, the API returns them as
``message.tool_calls`` (``radixkv serve --tool-call-parser NAME``, vLLM's flag and names).

Five formats, the ones the served architectures' chat templates ask for:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM2, many fine-tunes): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, or a
  block holds a JSON array of them (SmolLM2's format: ``<tool_call>[{...}, {...}]</tool_call>``;
  an empty array is no call); text outside the tags is the message's content. A last block the model did not close (it stopped
  at its end-of-turn token) counts when its JSON is whole.
- ``llama3_json`` (Llama 3.1 / 3.2 with JSON tool calling): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after
  ``<|python_tag|>``; anything else is plain content.
- ``mistral`` (Mistral / Mixtral instruct models): text before ``[TOOL_CALLS]`` is content;
  after it, either a JSON array of ``{"name": ..., "arguments": {...}}`` objects (tokenizers
  before v11; one object alone is taken too) or, from v11 on, ``NAME[ARGS]{json arguments}``,
  with ``[TOOL_CALLS]`` again before each further call (``[ARGS]`` may be missing, and a v13
  ``[CALL_ID]id`` before it is read past). Text after a call's JSON is content. The
  ``[...]`` markers are special tokens, which a decode that skips special tokens drops: for a
  request this parser reads, the server decodes the reply with special tokens kept
  (:attr:`NativeParser.keeps_special_tokens`, as vLLM does) and no content returned keeps a
  marker (a reply that is no call is its text less the markers: what the client would have
  read without the parser). Call ids are 9 letters and digits, the ids Mistral's chat
  templates accept back.
- ``pythonic`` (Llama 3.2 / Llama 4 and others): the whole reply is a Python list of calls,
  ``[get_weather(city="Paris", unit="c"), get_time()]``, optionally between
  ``<|python_start|>`` and ``<|python_end|>``. It is read with :mod:`ast` (never evaluated):
  every argument must be a keyword whose value is a literal (a string, number, ``True``,
  ``False``, ``None``, or a list, tuple or dict of them, with string keys), which becomes the
  JSON arguments; anything else (a positional argument, a name or a call as a value, a reply
  that is not one list of calls) leaves the reply content.
- ``qwen3_coder`` (Qwen3-Coder): each call is ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>
  \\nVALUE\\n</parameter>...</function>\\n</tool_call>`` (a ``<function=...>`` block without the
  ``<tool_call>`` tags counts too; the last ``</tool_call>`` may be missing at the reply's
  end; a VALUE whose ``</parameter>`` is missing ends where the next ``<parameter=`` or the
  ``</function>`` begins); text outside the blocks is content. One newline either side of a
  VALUE is the format's, not the value's. A VALUE is typed by its parameter's schema in the request's
  ``tools`` (:class:`NativeParser`; as vLLM does): ``string`` keeps the text, ``integer``,
  ``number`` and ``boolean`` read it as one (``null`` is None), ``object`` and ``array`` as
  JSON (or a Python literal); a VALUE that does not read as its type stays a string, and one
  without a schema is JSON when it parses as JSON, else a string.

A reply that does not parse as calls is returned as content, unchanged: a malformed call is the
model's text, never an error. Arguments are returned as a JSON string (``ensure_ascii=False``),
as OpenAI's API does.

Streaming (:class:`ToolCallStream`): content is passed through as it comes until a call may be
starting (a start marker: ``<tool_call>`` for ``hermes``; ``[TOOL_CALLS]``, ``[ARGS]`` or
``[CALL_ID]`` for ``mistral``; ``<tool_call>`` or ``<function=`` for ``qwen3_coder``; or a
prefix of one at the end of the text so far; for ``llama3_json`` a reply that opens with ``{``
or ``<|python_tag|>``, for ``pythonic`` one that opens with ``[`` or ``<|python_start|>``); from
there the text is held back, and the calls are sent with the finish, in one delta, with
``finish_reason: "tool_calls"``. Held-back text that turns out not to be a call is sent as
content then. The content and calls streamed are those of the whole reply parsed at once (the
content as it went out: whitespace before a call was sent before the call was seen).

Forced calls (:class:`ForcedToolChoice`, ``tool_choice`` naming a function or ``"required"``,
as vLLM does them): the reply is guided decoding's JSON, not the model's native call format,
and needs no parser: for a named function it is the call's arguments, for ``"required"`` a JSON
array of ``{"name": ..., "parameters": {...}}``, one element per call. Streamed, it is held back
whole and sent as calls with the finish. A reply that is not whole (``max_tokens`` cut it) is
returned as content.
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_MARKERS = (_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_CALL_ID)
# a v11+ call's head: its name, an optional [CALL_ID]id, an optional [ARGS]; then its JSON
_MISTRAL_HEAD = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?(?:\[ARGS\])?\s*")
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
_QWEN_CALL, _QWEN_FUNCTION = "<tool_call>", "<function="
_QWEN_FN_OPEN = re.compile(r"\s*<function=([^>\n]+)>")
# a VALUE ends at </parameter>, or where the next parameter or the function's end begins
_QWEN_PARAM = re.compile(
    r"\s*<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.DOTALL
)
_QWEN_FN_CLOSE = re.compile(r"\s*</function>")
_QWEN_CALL_CLOSE = re.compile(r"\s*</tool_call>")
# parsers whose markers are special tokens: replies they read are decoded with those kept
_KEEP_SPECIAL_TOKENS = frozenset({"mistral"})


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as a JSON string; ``id`` is
    made up here (``call_<hex>``; 9 letters and digits for ``mistral``), as clients echo it
    back in the ``tool`` message."""

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


@dataclass(frozen=True, eq=False)
class NativeParser:
    """A ``--tool-call-parser`` (``name``) reading one request's reply, with the request's
    ``tools`` (OpenAI's shapes, ``{"type": "function", "function": {"name", "parameters"}}``):
    ``qwen3_coder`` types parameter values by their schemas; the others ignore them. A bare
    parser name works as one without tools."""

    name: str
    tools: list[dict[str, Any]] | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the reply must be decoded with its special tokens (``mistral``: its
        ``[TOOL_CALLS]`` marker is one); the parser leaves them out of the content."""
        return self.name in _KEEP_SPECIAL_TOKENS


# how a reply's calls are read: a --tool-call-parser name (with the request's tools, or
# without), or a forced tool choice
ToolParser = str | NativeParser | ForcedToolChoice


def _native(parser: ToolParser) -> NativeParser | None:
    """The parser as a NativeParser (None for a forced choice); ValueError for a bad name."""
    if isinstance(parser, ForcedToolChoice):
        return None
    native = parser if isinstance(parser, NativeParser) else NativeParser(parser)
    if native.name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {native.name!r}; choose from {TOOL_CALL_PARSERS}"
        )
    return native


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: JSON has no infinity
        raise ValueError(f"{text} is out of range")
    return value


# JSON as the standard has it: no NaN, no Infinity (which json.dumps would write back)
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)
_loads = _DECODER.decode


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
            call = _call(_loads(chunk), args_key)
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


# ------------------------------------------------------------------ the formats
# Each reads a reply as (the text outside its calls, unstripped; the calls), or None when it
# holds no call or a malformed one (the reply is then content).
_Found = tuple[str, list[ToolCall]] | None


def _hermes(text: str, tools: Any) -> _Found:
    if _HERMES_START not in text:
        return None
    calls: list[ToolCall] = []
    for m in _HERMES_BLOCK.finditer(text):
        found = _hermes_block(m.group(1))
        if found is None:
            return None
        calls += found
    return (_HERMES_BLOCK.sub("", text), calls) if calls else None


def _hermes_block(body: str) -> list[ToolCall] | None:
    """The calls of one ``<tool_call>`` block: a JSON call object, or a JSON array of them
    (SmolLM2's format, ``<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>``); None
    when it is neither."""
    if not body.strip().startswith("["):
        return _calls([body], "arguments")
    try:
        items = _loads(body.strip())
    except ValueError:
        return None
    calls = [_call(item, "arguments") for item in items] if isinstance(items, list) else [None]
    return None if None in calls else [c for c in calls if c is not None]


def _llama3_json(text: str, tools: Any) -> _Found:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls = _calls(body.split(";"), "parameters") if body.startswith("{") else None
    return None if calls is None else ("", calls)


def _mistral_id() -> str:
    return "".join(random.choices(_MISTRAL_ID_CHARS, k=9))


def _mistral(text: str, tools: Any) -> _Found:
    start = text.find(_MISTRAL_CALLS)
    if start < 0 or any(m in text[:start] for m in _MISTRAL_MARKERS):
        return None
    content, calls = [text[:start]], []
    for segment in text[start + len(_MISTRAL_CALLS) :].split(_MISTRAL_CALLS):
        body = segment.lstrip()
        items: list[Any]
        if body.startswith(("[", "{")):  # before v11: a JSON array of calls (or one call)
            try:
                value, end = _DECODER.raw_decode(body)
            except ValueError:
                return None
            items = value if isinstance(value, list) else [value]
            if not items:
                return None
        else:  # v11+: NAME[ARGS]{...}
            head = _MISTRAL_HEAD.match(body)
            if head is None or not body.startswith("{", head.end()):
                return None
            try:
                args, end = _DECODER.raw_decode(body, head.end())
            except ValueError:
                return None
            items = [{"name": head.group(1), "arguments": args}]
        for item in items:
            call = _call(item, "arguments")
            if call is None:
                return None
            calls.append(replace(call, id=_mistral_id()))
        rest = body[end:]
        if any(m in rest for m in _MISTRAL_MARKERS):
            return None
        content.append(rest)
    return "".join(content), calls


def _mistral_content(text: str) -> str:
    """A mistral reply that is no call, as content: its text less the markers."""
    for marker in _MISTRAL_MARKERS:
        text = text.replace(marker, "")
    return text


def _json_value(value: Any) -> Any:
    """A Python literal as JSON (tuples become lists); ValueError when it is not one."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v) for k, v in value.items()}
    raise ValueError(f"not a JSON value: {type(value).__name__}")


def _pythonic(text: str, tools: Any) -> _Found:
    body = text.strip()
    if body.startswith(_PY_START):
        body = body[len(_PY_START) :].strip().removesuffix(_PY_END)
    body = body.strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in args:  # **kwargs, or a keyword given twice
                return None
            try:  # literal_eval reads literals only: nothing is evaluated
                args[kw.arg] = _json_value(ast.literal_eval(kw.value))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return "", calls


def _tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by name (what the request gives of them)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


_TYPE_ALIASES = {"int": "integer", "float": "number", "bool": "boolean", "str": "string"}
_TYPE_ALIASES |= {"dict": "object", "list": "array"}


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, or ``anyOf`` /
    ``oneOf`` alternatives)."""
    found = schema.get("type")
    types = {found} if isinstance(found, str) else set(found) if isinstance(found, list) else set()
    for key in ("anyOf", "oneOf"):
        for alt in schema.get(key) or ():
            if isinstance(alt, dict):
                types |= _schema_types(alt)
    return {_TYPE_ALIASES.get(t, t) for t in types if isinstance(t, str)}


def _json_or_string(value: str) -> Any:
    try:
        return _loads(value)
    except ValueError:
        return value


def _qwen_value(value: str, schema: Any) -> Any:
    """A parameter's VALUE typed by its schema (module doc)."""
    if not isinstance(schema, dict):
        return _json_or_string(value)
    enum = schema.get("enum")
    if isinstance(enum, list) and value in enum:
        return value
    types = _schema_types(schema)
    if not types:
        return _json_or_string(value)
    word = value.strip()
    if word.lower() == "null":
        return None
    if "string" in types:
        return value
    if "integer" in types and re.fullmatch(r"-?\d+", word):
        return int(word)
    if "number" in types:
        number = _json_or_string(word)
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return number
    if "boolean" in types and word.lower() in ("true", "false"):
        return word.lower() == "true"
    if types & {"object", "array"}:
        try:
            parsed = _loads(word)
        except ValueError:
            try:
                parsed = _json_value(ast.literal_eval(word))
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return value
        if isinstance(parsed, dict) and "object" in types:
            return parsed
        if isinstance(parsed, list) and "array" in types:
            return parsed
    return value


def _qwen_functions(
    text: str, pos: int, props: dict[str, dict[str, Any]]
) -> tuple[list[ToolCall], int] | None:
    """The ``<function=...>`` blocks from ``pos`` on, and where they end; None when the first
    is not a whole one."""
    calls = []
    while (head := _QWEN_FN_OPEN.match(text, pos)) is not None:
        name = head.group(1).strip()
        schemas = props.get(name, {})
        args: dict[str, Any] = {}
        pos = head.end()
        while (param := _QWEN_PARAM.match(text, pos)) is not None:
            key = param.group(1).strip()
            value = param.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _qwen_value(value, schemas.get(key))
            pos = param.end()
        close = _QWEN_FN_CLOSE.match(text, pos)
        if not name or close is None:
            return None
        pos = close.end()
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return (calls, pos) if calls else None


def _qwen3_coder(text: str, tools: list[dict[str, Any]] | None) -> _Found:
    props = _tool_properties(tools)
    content, calls, pos = [], [], 0
    while True:
        starts = [i for m in (_QWEN_CALL, _QWEN_FUNCTION) if (i := text.find(m, pos)) >= 0]
        if not starts:
            break
        i = min(starts)
        content.append(text[pos:i])
        wrapped = text.startswith(_QWEN_CALL, i)
        found = _qwen_functions(text, i + len(_QWEN_CALL) if wrapped else i, props)
        if found is None:
            return None
        more, pos = found
        calls += more
        if wrapped:
            close = _QWEN_CALL_CLOSE.match(text, pos)
            if close is not None:
                pos = close.end()
            elif text[pos:].strip():  # only the reply's last block may be left open
                return None
            else:
                pos = len(text)
    content.append(text[pos:])
    return ("".join(content), calls) if calls else None


_FORMATS: dict[str, Callable[[str, Any], _Found]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "mistral": _mistral,
    "pythonic": _pythonic,
    "qwen3_coder": _qwen3_coder,
}
_START_MARKERS = {
    "hermes": (_HERMES_START,),
    "mistral": _MISTRAL_MARKERS,
    "qwen3_coder": (_QWEN_CALL, _QWEN_FUNCTION),
}
# formats whose calls are the whole reply: a reply opening with one of these is held whole
_WHOLE_REPLY_OPENERS = {"llama3_json": ("{", _PYTHON_TAG), "pythonic": ("[", _PY_START)}


def _as_content(native: NativeParser, text: str) -> str:
    """A reply (or its held-back rest) that holds no call, as content."""
    return _mistral_content(text) if native.name == "mistral" else text


def parse_tool_calls(text: str, parser: ToolParser) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply. With no calls found the content is ``text`` itself
    (for ``mistral``, less its markers); with calls it is the text around them, stripped, or
    None when nothing is left."""
    native = _native(parser)
    if native is None:
        assert isinstance(parser, ForcedToolChoice)
        return parser.parse(text)
    found = _FORMATS[native.name](text, native.tools)
    if found is None:
        return _as_content(native, text), []
    content, calls = found
    return (content.strip() or None), calls


def _hold_from(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where content must stop: the first marker at or after ``start``, else a tail of the
    text that may be a marker's beginning ("<", "<tool", ...), else the text's end."""
    found = [i for m in markers if (i := text.find(m, start)) >= 0]
    if found:
        return min(found)
    for k in range(min(max(map(len, markers)) - 1, len(text) - start), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return len(text) - k
    return len(text)


class ToolCallStream:
    """One streamed choice's text through the parser (module doc). ``feed(new_text)`` returns
    the content that can be sent now; ``finish()`` returns (content still held back, calls)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._native = _native(parser)
        self._text = ""  # everything so far
        self._sent = 0  # chars of it sent as content

    def _safe_end(self) -> int:
        """How much of the text can go out as content without splitting a possible call."""
        text = self._text
        if self._native is None:
            return 0  # forced: the whole reply is the call(s), sent with the finish
        name = self._native.name
        if name in _WHOLE_REPLY_OPENERS:
            head = text.lstrip()
            # a reply that opens like a call is held whole (it is one, or it is sent at the end)
            for opener in _WHOLE_REPLY_OPENERS[name]:
                if opener.startswith(head[: len(opener)]):  # empty head: it may still open so
                    return 0
            return len(text)
        return _hold_from(text, self._sent, _START_MARKERS[name])

    def feed(self, new_text: str) -> str:
        self._text += new_text
        end = max(self._safe_end(), self._sent)
        out = self._text[self._sent : end]
        self._sent = end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, calls): the held-back text is parsed; when it holds no calls
        it is content after all. With calls, the content around them that was held back, less
        the whitespace the whole reply's content would not have."""
        start = self._sent
        held = self._text[start:]
        self._sent = len(self._text)
        if self._native is None:
            content, calls = parse_tool_calls(held, self.parser)
            return (held, []) if not calls else (content or "", calls)
        found = _FORMATS[self._native.name](held, self._native.tools)
        if found is None:
            return _as_content(self._native, held), []
        rest, calls = found
        rest = rest.rstrip()
        if not self._text[:start].strip():
            rest = rest.lstrip()
        return rest, calls
