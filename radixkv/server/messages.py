"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over
the chat route: what Anthropic's SDKs and the agents built on them send, answered in its shapes.

A Messages request becomes the chat completion request it means (as vLLM's Anthropic endpoint
does): ``system`` a system message; user turns' text blocks their content and their
``tool_result`` blocks tool messages; assistant turns' ``tool_use`` blocks their tool calls;
``tools`` (``input_schema``) function tools; ``tool_choice`` auto / any (required) / tool (that
function) / none; ``stop_sequences`` stop strings. It runs through ``ServerState.run_chat`` (the
same tokens, sampling, tool-call parsing, reasoning, admission and release as
``/v1/chat/completions``), and the chat answer is rewritten: content blocks (``thinking`` with a
``--reasoning-parser``, ``text``, ``tool_use`` with its parsed ``input``), ``stop_reason``
(end_turn, max_tokens, stop_sequence with the matched ``stop_sequence``, tool_use) and
``usage``, whose ``cache_read_input_tokens`` are the prompt tokens served from the prefix cache
(``input_tokens`` the rest, as Anthropic counts them). A stream becomes Anthropic's events:
``message_start``, per block ``content_block_start`` / ``content_block_delta`` (text_delta,
thinking_delta, input_json_delta) / ``content_block_stop``, ``message_delta`` (stop reason and
usage), ``message_stop``; an engine failure mid-stream an ``error`` event.

Keys come as ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``. Errors are
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with the same statuses as the
OpenAI routes. ``cache_control`` marks are accepted and need nothing: every prefix is cached.
Images, documents and extended thinking budgets are refused by name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, Request, Response

from radixkv.server import protocol as P
from radixkv.server.auth import request_authorization
from radixkv.server.errors import APIError, bad_request
from radixkv.server.state import ServerState
from radixkv.server.transport import SSEResponse, read_body

__all__ = ["MESSAGES_PATHS", "MessagesRequest", "add_messages_routes", "anthropic_error", "to_chat"]

# Anthropic's error type per HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageParam(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(msgspec.Struct, kw_only=True):
    """Anthropic's ``POST /v1/messages`` body (fields it defines that change nothing here,
    ``metadata`` and ``service_tier``, are accepted)."""

    model: str
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """Anthropic's ``POST /v1/messages/count_tokens`` body."""

    model: str
    messages: Annotated[list[MessageParam], msgspec.Meta(min_length=1)]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of a list of text blocks (any other block: 400 naming it)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text block, got {b.get('type')!r}", where)
        parts.append(b["text"])
    return "".join(parts)


def _messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages the request's system prompt and turns mean."""
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, b in enumerate(m.content):
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise bad_request(f"{where}[{j}]: a tool_use block needs id and name", where)
                args = json.dumps(b.get("input") or {}, ensure_ascii=False)
                calls.append(
                    {"id": b["id"], "type": "function",
                     "function": {"name": b["name"], "arguments": args}}
                )  # fmt: skip
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad_request(f"{where}[{j}]: a tool_result block needs tool_use_id", where)
                body = _text_of(b.get("content") or "", f"{where}[{j}].content")
                if b.get("is_error"):
                    body = f"Error: {body}"
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": body})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier reasoning: templates drop it from past turns anyway
            else:
                raise bad_request(
                    f"{where}[{j}]: {kind!r} blocks are not supported in {m.role} turns (text"
                    + (", tool_use" if m.role == "assistant" else ", tool_result")
                    + " only: radixkv serves text models)",
                    where,
                )
        out += results  # a user turn's tool results answer the calls just before it
        if text or (m.role == "assistant" and calls) or not results:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    tools = []
    for i, t in enumerate(req.tools):
        if "input_schema" not in t or not isinstance(t.get("name"), str):
            raise bad_request(
                f"tools[{i}]: a client tool needs name and input_schema (server tools such as "
                f"{t.get('type', '?')!r} are not supported)",
                "tools",
            )
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be {type: auto | any | none} or {type: tool, name}", "tool_choice"
    )


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    if thinking is not None and thinking.get("type") not in ("disabled", None):
        raise bad_request(
            "extended thinking budgets are not supported (a reasoning model thinks as its "
            "chat template says; its reasoning comes back as thinking blocks)",
            "thinking",
        )


def _chat_request(
    req: MessagesRequest | CountTokensRequest, **sampling: Any
) -> P.ChatCompletionRequest:
    """The chat completion request of ``req``'s conversation and tools, with ``sampling``'s
    fields (None: not given); 400 naming the Messages field otherwise."""
    _check_thinking(req.thinking)
    data = {
        "model": req.model,
        "messages": _messages(req),
        "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice),
        **sampling,
    }
    try:
        return msgspec.convert(
            {k: v for k, v in data.items() if v is not None}, P.ChatCompletionRequest
        )
    except msgspec.ValidationError as e:
        raise bad_request(f"the request does not make a valid chat: {e}", None) from None


def to_chat(req: MessagesRequest) -> P.ChatCompletionRequest:
    """The chat completion request ``req`` means (400 naming the Messages field otherwise)."""
    return _chat_request(
        req,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        stream=req.stream,
        stream_options={"include_usage": True} if req.stream else None,
    )


def _usage(u: dict[str, Any] | None) -> dict[str, int]:
    u = u or {}
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": int(u.get("prompt_tokens", 0)) - cached,
        "output_tokens": int(u.get("completion_tokens", 0)),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop(choice: dict[str, Any], stops: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "stop" and isinstance(matched, str) and matched in (stops or ()):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "stop", "end_turn"), None


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {"_raw": arguments}  # a parser passed on malformed arguments: keep them


def to_message(chat: dict[str, Any], model: str, stops: list[str] | None) -> dict[str, Any]:
    """A chat completion (JSON) as Anthropic's message object."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        content.append({"type": "thinking", "thinking": msg["reasoning"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        fn = c["function"]
        content.append(
            {"type": "tool_use", "id": c["id"], "name": fn["name"],
             "input": _tool_input(fn["arguments"])}
        )  # fmt: skip
    reason, sequence = _stop(choice, stops)
    return {
        "id": "msg_" + chat["id"].rsplit("-", 1)[-1],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(chat.get("usage")),
    }


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data}).encode() + b"\n\n"


async def to_events(
    chunks: AsyncIterator[bytes], model: str, stops: list[str] | None, input_tokens: int
) -> AsyncIterator[bytes]:
    """A chat completion's SSE chunks as Anthropic's message events."""
    msg_id = "msg_" + uuid.uuid4().hex
    usage = {"input_tokens": input_tokens, "output_tokens": 0}
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model,
             "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip
    yield _event("message_start", {"message": start})
    index = -1  # the open block's index
    open_kind: str | None = None  # "text" | "thinking" | "tool_use"
    calls: dict[int, int] = {}  # chat tool-call index -> block index
    finish: tuple[str, str | None] | None = None
    final_usage: dict[str, int] | None = None

    def close() -> bytes:
        return _event("content_block_stop", {"index": index})

    async for raw in chunks:
        for line in raw.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                err = chunk["error"]
                yield _event(
                    "error", {"error": {"type": "api_error", "message": err.get("message", "")}}
                )
                return
            if chunk.get("usage"):
                final_usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for kind, key, dkind in (("thinking", "reasoning", "thinking_delta"),
                                         ("text", "content", "text_delta")):  # fmt: skip
                    piece = delta.get(key)
                    if not piece:
                        continue
                    if open_kind != kind:
                        if open_kind is not None:
                            yield close()
                        index, open_kind = index + 1, kind
                        block = {"type": kind, kind: ""}
                        if kind == "thinking":
                            block["signature"] = ""
                        yield _event(
                            "content_block_start", {"index": index, "content_block": block}
                        )
                    field = "thinking" if kind == "thinking" else "text"
                    yield _event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": dkind, field: piece}},
                    )
                for call in delta.get("tool_calls") or []:
                    k = call.get("index", 0)
                    fn = call.get("function") or {}
                    if k not in calls:
                        if open_kind is not None:
                            yield close()
                        index, open_kind = index + 1, "tool_use"
                        calls[k] = index
                        block = {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                                 "name": fn.get("name", ""), "input": {}}  # fmt: skip
                        yield _event(
                            "content_block_start", {"index": index, "content_block": block}
                        )
                    if fn.get("arguments"):
                        yield _event(
                            "content_block_delta",
                            {"index": calls[k],
                             "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}},
                        )  # fmt: skip
                if choice.get("finish_reason"):
                    finish = _stop(choice, stops)
    if open_kind is not None:
        yield close()
    reason, sequence = finish or ("end_turn", None)
    u = final_usage or {"output_tokens": 0}
    yield _event(
        "message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": u}
    )
    yield _event("message_stop", {})


# the routes answering in Anthropic's error shape
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


def anthropic_error(err: APIError) -> Response:
    """An error as Anthropic's API answers it: ``{"type": "error", "error": {"type",
    "message"}}``."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"),
                                       "message": err.message}}  # fmt: skip
    return Response(
        json.dumps(body), status_code=err.status, media_type="application/json",
        headers=err.headers,
    )  # fmt: skip


def add_messages_routes(app: FastAPI, st: ServerState) -> None:
    @app.post(MESSAGES_PATHS[0], include_in_schema=False)
    async def messages(request: Request) -> Response:
        try:
            principal = st.auth.authenticate(request_authorization(request.headers))
            req = st.decode(await read_body(request, st.config.max_body_bytes), MessagesRequest)
            chat = to_chat(req)
            input_tokens = len(st.chat_ids(chat)) if req.stream else 0
            answer = await st.run_chat(request, principal, chat)
        except APIError as e:
            return anthropic_error(e)
        if isinstance(answer, SSEResponse):
            return answer.with_body(
                lambda chunks: to_events(chunks, req.model, req.stop_sequences, input_tokens)
            )
        if answer.status_code != 200:
            return answer  # a client gone (499)
        body = to_message(json.loads(answer.body), req.model, req.stop_sequences)
        return Response(json.dumps(body), media_type="application/json", headers={
            k: v for k, v in answer.headers.items() if k.startswith("x-")
        })  # fmt: skip

    @app.post(MESSAGES_PATHS[1], include_in_schema=False)
    async def count_tokens(request: Request) -> Response:
        try:
            st.auth.authenticate(request_authorization(request.headers))
            req = st.decode(await read_body(request, st.config.max_body_bytes), CountTokensRequest)
            st.check_model(req.model)
            n = len(st.chat_ids(_chat_request(req, max_tokens=1)))
        except APIError as e:
            return anthropic_error(e)
        return Response(json.dumps({"input_tokens": n}), media_type="application/json")
