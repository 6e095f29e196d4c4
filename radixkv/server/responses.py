"""OpenAI's Responses API (``POST /v1/responses``), served through the chat path.

A request's ``input`` (a string, or a list of items: messages, the model's earlier function
calls and their outputs, reasoning), its ``instructions`` and the stored conversation of its
``previous_response_id`` become one chat conversation (:meth:`ResponsesRequest.chat_request`),
which runs exactly as ``/v1/chat/completions`` runs it: same template, same token ids, so a
conversation continued by ``previous_response_id`` reuses the KV of its earlier turns. The
reply comes back as output items (:class:`ResponseWriter`): the reasoning (with a
``--reasoning-parser``), the message, and function calls (with a ``--tool-call-parser``, or
forced by ``tool_choice``), whole or as the API's stream of typed events.

What maps to what: ``max_output_tokens`` -> ``max_tokens``; flat function ``tools`` ->
chat's ``{"type": "function", "function": {...}}``; ``tool_choice`` ``{"type": "function",
"name": ...}`` -> chat's; ``text.format`` (``text``, ``json_object``, ``json_schema``) ->
``response_format``; ``instructions`` -> a leading system message (not carried on to a
continuation, as OpenAI documents). Accepted and without effect: ``reasoning`` (the effort is
the model's), ``include``, ``prompt_cache_key``, ``service_tier``, ``user``, ``truncation:
"disabled"``. Refused with a 400 naming the field: tools other than functions, input parts
other than text, ``item_reference`` items, ``background: true``, ``truncation: "auto"``.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from radixkv.server import protocol as P
from radixkv.server.tool_calls import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class TextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "name": ..., "schema": {...}, "strict": ...}`` (flat, unlike chat's)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """Accepted and without effect: a model's reasoning effort is its own (a hybrid model's
    thinking switch is the template's: ``chat_template_kwargs``)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The request body (module docstring for what maps to what)."""

    # what __post_init__ checks, said in /openapi.json too (server/openapi.py merges it)
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "allOf": [
            P.only("background", {"const": False}),
            P.only("truncation", {"const": "disabled"}),
            P.only("metadata", {"type": "object", "maxProperties": 16}),
        ]
    }

    model: str
    input: P.NonEmptyStr | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool = True  # False: the response is not kept (no continuation, no GET)
    metadata: dict[str, str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on chat completions
    cache_salt: P.CacheSalt | None = None  # as on chat completions
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool = False
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    def __post_init__(self) -> None:
        if self.background:
            raise ValueError("background responses are not supported (background must be false)")
        if self.truncation == "auto":
            raise ValueError(
                "truncation 'auto' is not supported: a conversation longer than the context is "
                "a 400, never cut (truncation must be 'disabled')"
            )
        if self.metadata is not None and len(self.metadata) > 16:
            raise ValueError("metadata holds at most 16 keys")

    def conversation(self, history: list[P.ChatMessage]) -> list[P.ChatMessage]:
        """The chat messages this request runs: its instructions, the stored ``history`` of
        its previous response, then its input (ValueError naming the bad item)."""
        head = [] if self.instructions is None else [P.ChatMessage("system", self.instructions)]
        return [*head, *history, *input_messages(self.input)]

    def chat_request(self, history: list[P.ChatMessage]) -> P.ChatCompletionRequest:
        """The chat completion request that runs this one (ValueError naming the field:
        :func:`error_param` reads it)."""
        fmt = self.text.format if self.text is not None else None
        data = {
            "model": self.model,
            "messages": msgspec.to_builtins(self.conversation(history)),
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": None
            if self.tools is None
            else [chat_tool(t, i) for i, t in enumerate(self.tools)],
            "tool_choice": chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": None if fmt is None else response_format(fmt),
            "chat_template_kwargs": self.chat_template_kwargs,
            "cache_salt": self.cache_salt,
        }
        # convert (not the constructor): nested shapes are built and every bound is checked
        return msgspec.convert(
            {k: v for k, v in data.items() if v is not None}, P.ChatCompletionRequest
        )


# chat fields whose errors name them, as the Responses API names them
RESPONSES_PARAMS = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text",
}


_AT = re.compile(r"- at `\$\.([A-Za-z_]+)")


def error_param(message: str) -> str | None:
    """The request field a conversion error names, as the Responses API calls it (the path
    of a shape error, else the message's first word), or None."""
    m = _AT.search(message)
    name = m.group(1) if m else re.split(r"[ .\[]", message, maxsplit=1)[0]
    name = RESPONSES_PARAMS.get(name, name)
    return name if name in ResponsesRequest.__struct_fields__ else None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of parts")
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise ValueError(
                f"{where}.content[{k}] must be a text part (input_text or output_text with "
                f"text); {kind!r} parts are not supported"
            )
        out.append(part["text"])
    return "".join(out)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
    ):
        raise ValueError(f"{where}: a reasoning item's content is a list of parts with text")
    return "".join(p["text"] for p in parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[P.ChatMessage]:
    """``input`` as chat messages: messages as they are; a reasoning item goes with the
    assistant turn after it; function calls join the assistant turn before them (or make one);
    function call outputs become tool messages."""
    if isinstance(items, str):
        return [P.ChatMessage("user", items)]
    out: list[P.ChatMessage] = []
    pending_reasoning: str | None = None

    def assistant() -> P.ChatMessage:
        """The assistant turn the next item belongs to (the last message if it is one)."""
        nonlocal pending_reasoning
        if not out or out[-1].role != "assistant" or pending_reasoning is not None:
            out.append(P.ChatMessage("assistant", None, reasoning=pending_reasoning))
            pending_reasoning = None
        return out[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"{where}.role must be user, system, developer or assistant")
            text = _text(item.get("content", ""), where)
            if role == "assistant":
                msg = assistant()
                msg.content = (msg.text() or "") + text
            else:
                out.append(P.ChatMessage(role, text))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call has call_id, name and arguments")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            msg = assistant()
            msg.tool_calls = [*(msg.tool_calls or []), call]
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise ValueError(f"{where}: a function_call_output has call_id and output")
            text = output if isinstance(output, str) else _text(output, where)
            out.append(P.ChatMessage("tool", text, tool_call_id=item["call_id"]))
        elif kind == "reasoning":
            pending_reasoning = (pending_reasoning or "") + _reasoning_text(item, where)
        else:
            raise ValueError(f"{where}.type {kind!r} is not supported")
    if pending_reasoning is not None:
        assistant()
    if not out:
        raise ValueError("input must hold at least one item")
    return out


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as a chat tool."""
    if tool.get("type") != "function":
        raise ValueError(f"tools[{i}].type {tool.get('type')!r} is not supported (only function)")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ValueError(f"tools[{i}] needs a name")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    spec = {"name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


# ---------------------------------------------------------------- the response


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    content: list[OutputText]
    role: str = "assistant"
    status: str = "completed"


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def response_usage(u: P.Usage) -> ResponseUsage:
    """A chat usage in the Responses API's names (reasoning tokens 0 where it counted none)."""
    details = u.completion_tokens_details
    reasoning = 0 if isinstance(details, msgspec.UnsetType) else details.reasoning_tokens
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputTokensDetails(u.prompt_tokens_details.cached_tokens),
        output_tokens=u.completion_tokens,
        output_tokens_details=OutputTokensDetails(reasoning),
        total_tokens=u.total_tokens,
    )


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response, as ``POST /v1/responses`` returns it and ``GET /v1/responses/{id}`` reads
    it back; ``status`` is ``in_progress`` in a stream's first events."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    object: str = "response"
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = True
    truncation: str = "disabled"


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


def shell(req: ResponsesRequest, rid: str, created: int) -> ResponseObject:
    """The response before its output: what every event's ``response`` and the final one
    share."""
    text = {"format": {"type": "text"}}
    if req.text is not None and req.text.format is not None:
        text = {"format": msgspec.to_builtins(req.text.format)}
    return ResponseObject(
        id=rid,
        created_at=created,
        model=req.model,
        status="in_progress",
        output=[],
        tools=list(req.tools or []),
        tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        metadata=dict(req.metadata or {}),
        text=text,
        store=req.store,
    )


class ResponseWriter:
    """Builds one response's output items from its reply as it comes (reasoning and content
    text, then tool calls), as the stream's events when streaming; a whole response is the
    same calls at once, so both shapes have the same items.

    Each ``reasoning``/``content``/``calls``/``finish`` returns the events it makes (plain
    dicts with ``type`` and ``sequence_number``, the items as they were at that event)."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self._seq = 0
        self._open: ReasoningItem | MessageItem | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event, its items copied as they are now (later calls change the live ones)."""
        self._seq += 1
        copied = {k: msgspec.to_builtins(v) for k, v in fields.items()}
        return {"type": kind, "sequence_number": self._seq - 1, **copied}

    def started(self) -> list[dict[str, Any]]:
        r = self.response
        return [
            self._event("response.created", response=r),
            self._event("response.in_progress", response=r),
        ]

    def _add(self, item: OutputItem) -> dict[str, Any]:
        self.response.output.append(item)
        return self._event(
            "response.output_item.added", output_index=len(self.response.output) - 1, item=item
        )

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {
            "item_id": self._open.id,
            "output_index": len(self.response.output) - 1,
            "content_index": 0,
        }

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._text(text, ReasoningItem, ReasoningText, "rs", "reasoning_text")

    def content(self, text: str) -> list[dict[str, Any]]:
        return self._text(text, MessageItem, OutputText, "msg", "output_text", logprobs=[])

    def _text(
        self,
        text: str,
        item_type: type[ReasoningItem] | type[MessageItem],
        part_type: type[ReasoningText] | type[OutputText],
        prefix: str,
        kind: str,
        **extra: Any,
    ) -> list[dict[str, Any]]:
        """``text`` appended to the open item of ``item_type`` (one opened, with its one part,
        after closing another); ``kind``: the part's event name (``response.<kind>.delta``)."""
        if not text:
            return []
        events = []
        if not isinstance(self._open, item_type):
            events += self._close()
            item = item_type(id=new_id(prefix), content=[], status="in_progress")
            events.append(self._add(item))
            self._open = item
            part = part_type(text="")
            item.content.append(part)  # type: ignore[arg-type]
            events.append(self._event("response.content_part.added", **self._where(), part=part))
        self._open.content[0].text += text
        events.append(self._event(f"response.{kind}.delta", **self._where(), delta=text, **extra))
        return events

    def calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        events = self._close()
        for call in calls:
            item = FunctionCallItem(
                id=new_id("fc"), call_id=call.id, name=call.name, arguments="", status="in_progress"
            )
            events.append(self._add(item))
            where = {"item_id": item.id, "output_index": len(self.response.output) - 1}
            item.arguments = call.arguments
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments)
            )
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, arguments=call.arguments
                )
            )
            item.status = "completed"
            events.append(
                self._event(
                    "response.output_item.done", output_index=where["output_index"], item=item
                )
            )
        return events

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        self._open = None
        part = item.content[0]
        if isinstance(item, ReasoningItem):
            done = self._event("response.reasoning_text.done", **where, text=part.text)
        else:
            done = self._event("response.output_text.done", **where, text=part.text, logprobs=[])
        item.status = "completed"
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def finish(self, finish_reason: str | None, usage: ResponseUsage) -> list[dict[str, Any]]:
        """Close what is open and complete the response (``incomplete`` when ``max_tokens``
        cut it); the last event carries the whole response."""
        events = self._close()
        r = self.response
        r.usage = usage
        if finish_reason == "length":
            r.status, r.incomplete_details = "incomplete", IncompleteDetails("max_output_tokens")
            events.append(self._event("response.incomplete", response=r))
        else:
            r.status = "completed"
            events.append(self._event("response.completed", response=r))
        return events


def history(response: ResponseObject, conversation: list[P.ChatMessage]) -> list[P.ChatMessage]:
    """What a continuation of ``response`` starts from: the conversation it ran (without its
    instructions: the first message when it had them) and its output as an assistant turn."""
    turns = conversation[1:] if response.instructions is not None else list(conversation)
    reasoning = "".join(
        p.text for item in response.output if isinstance(item, ReasoningItem) for p in item.content
    )
    text = "".join(
        p.text for item in response.output if isinstance(item, MessageItem) for p in item.content
    )
    calls = [
        {
            "id": i.call_id,
            "type": "function",
            "function": {"name": i.name, "arguments": i.arguments},
        }
        for i in response.output
        if isinstance(i, FunctionCallItem)
    ]
    turn = P.ChatMessage("assistant", text, tool_calls=calls or None, reasoning=reasoning or None)
    return [*turns, turn]
