"""The OpenAPI document of the app (``GET /openapi.json``, rendered by ``GET /docs``).

Routes read their bodies themselves (server/transport.py, strict size limits and msgspec
decoding), so FastAPI cannot infer their schemas; this module states them from the same msgspec
Structs the routes decode and encode (``msgspec.json.schema_components``), so the document
cannot drift from what the server accepts: a field added to a Struct appears here. What the
decoder does that JSON Schema derived from the Structs would not say is added: every optional
request field also accepts ``null`` (it means "not given"), unknown fields are allowed unless
the server runs with ``strict_api``, and a Struct's cross-field rule (``json_schema_extra``:
/tokenize's "prompt or messages, exactly one") is merged into its schema. (JSON Schema's
``integer`` takes ``1.0``: so does the decoder, protocol.decode_request.)
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from radixkv.server import protocol as P
from radixkv.server import responses as RS
from radixkv.server.errors import ErrorResponse

REF = "#/components/schemas/{name}"

_REQUESTS: list[Any] = [
    P.CompletionRequest,
    P.ChatCompletionRequest,
    P.TokenizeRequest,
    P.DetokenizeRequest,
    P.ScoreRequest,
    P.LoadLoRAAdapterRequest,
    P.UnloadLoRAAdapterRequest,
    RS.ResponsesRequest,
]
_RESPONSES: list[Any] = [
    P.CompletionResponse,
    P.ChatCompletionResponse,
    P.ChatCompletionChunk,
    P.TokenizeResponse,
    P.DetokenizeResponse,
    P.ScoreResponse,
    P.ModelList,
    P.Status,
    RS.ResponseObject,
    RS.DeletedResponse,
    ErrorResponse,
]

_ERROR_TEXT = {
    400: "Invalid request: bad JSON, a wrong type or value (param names it), context too long",
    401: "Missing or invalid API key",
    403: "Admin endpoints are disabled (no admin key configured)",
    404: (
        "Unknown model (code model_not_found), LoRA adapter (code lora_not_found) or stored "
        "response (code previous_response_not_found, response_not_found)"
    ),
    408: "Request body not received in time (the connection is closed)",
    413: "Request body over the size limit",
    415: "Content-Type is not application/json",
    429: (
        "A per-tenant limit (code tenant_max_prompts, tenant_max_waiting or "
        "tenant_max_queued_tokens, retry-after)"
    ),
    500: "The server failed while serving the request",
    503: "Server at capacity (code queue_full, retry-after), or the engine is unavailable",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(name)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {
        str(s): {"description": _ERROR_TEXT[s], "content": _json("ErrorResponse")} for s in statuses
    }


def sse_event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (the schema of each event, as OpenAPI 3.1 reads a
    ``text/event-stream`` schema): its ``data`` is a ``chunk`` as JSON, or ``[DONE]`` last."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"A {chunk} as JSON; the last event's data is [DONE]",
                "anyOf": [
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": _ref(chunk),
                    },
                    {"const": "[DONE]"},
                ],
            },
            "event": {"type": "string"},
        },
    }


def generation_route(request: str, response: str, chunk: str, summary: str) -> dict[str, Any]:
    """``openapi_extra`` of POST /v1/completions or /v1/chat/completions."""
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {
                "description": (
                    f"A {response}; with stream=true, server-sent events each carrying a "
                    f"{chunk} as JSON, then `data: [DONE]`"
                ),
                "content": {
                    **_json(response),
                    "text/event-stream": {"schema": sse_event(chunk)},
                },
            },
            **_errors(400, 401, 404, 408, 413, 415, 429, 500, 503),
        },
    }


def responses_route() -> dict[str, Any]:
    """``openapi_extra`` of POST /v1/responses: a response, or with stream=true its typed
    events (``event:`` the type, ``data:`` the event as JSON; the last one carries the whole
    response; no ``[DONE]``)."""
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {
                    "type": "object",
                    "required": ["type", "sequence_number"],
                    "properties": {
                        "type": {"type": "string"},
                        "sequence_number": {"type": "integer"},
                    },
                },
            },
        },
    }
    return {
        "summary": "A response (OpenAI's Responses API), run as a chat completion",
        "requestBody": {"required": True, "content": _json("ResponsesRequest")},
        "responses": {
            "200": {
                "description": "A ResponseObject; with stream=true, its events",
                "content": {**_json("ResponseObject"), "text/event-stream": {"schema": event}},
            },
            **_errors(400, 401, 404, 408, 413, 415, 429, 500, 503),
        },
    }


def json_route(
    request: str, response: str, summary: str, *, runs_engine: bool = False
) -> dict[str, Any]:
    """``openapi_extra`` of a JSON-in, JSON-out route (/tokenize); ``runs_engine``: it submits
    engine requests (/v1/score), so a tenant's limit answers 429 and a full queue 503."""
    errors = (400, 401, 404, 408, 413, 415) + ((429, 500, 503) if runs_engine else (500,))
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": f"A {response}", "content": _json(response)},
            **_errors(*errors),
        },
    }


def text_route(request: str, summary: str, ok: str, *errors: int) -> dict[str, Any]:
    """``openapi_extra`` of a JSON-in route whose success is a plain-text message (vLLM's
    LoRA adapter routes answer ``ok``'s text)."""
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {
                "description": f"Done: the text `{ok}`",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
            **_errors(*sorted({408, 415, *errors})),
        },
    }


def simple_route(
    summary: str, ok: str | None, *errors: int, media: str = "application/json"
) -> dict[str, Any]:
    """``openapi_extra`` of a route without a body: 200 with the ``ok`` schema (JSON) or, when
    ``ok`` is None, text of type ``media``, and the given error statuses."""
    content = _json(ok) if ok is not None else {media: {"schema": {"type": "string"}}}
    return {
        "summary": summary,
        "responses": {"200": {"description": "OK", "content": content}, **_errors(*errors)},
    }


def _nullable_optionals(schema: dict[str, Any]) -> None:
    """Let every optional property also be null (the decoder reads null as "not given")."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        if name in required:
            continue
        options = prop.get("anyOf", [prop])
        if any(o.get("type") == "null" for o in options):
            continue
        inner = {k: v for k, v in prop.items() if k not in ("default", "description", "title")}
        outer = {k: prop[k] for k in ("default", "description", "title") if k in prop}
        schema["properties"][name] = {"anyOf": [inner, {"type": "null"}], **outer}


def _bound_token_ids(node: Any, vocab_size: int | None) -> None:
    """Every token id schema (marked ``P.TOKEN_ID_MARK``) bounded by the vocabulary, in place:
    the server answers 400 to an id the model does not have."""
    if isinstance(node, dict):
        if node.pop(P.TOKEN_ID_MARK, False) and vocab_size is not None:
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def components(*, strict: bool, vocab_size: int | None = None) -> dict[str, Any]:
    """The schemas of every request and response Struct, adjusted to what the decoder accepts
    (and, given ``vocab_size``, to the served model's token ids)."""
    _, requests = msgspec.json.schema_components(_REQUESTS, ref_template=REF)
    _, responses = msgspec.json.schema_components(_RESPONSES, ref_template=REF)
    for schema in requests.values():
        if schema.get("type") == "object":
            _nullable_optionals(schema)
            if strict:
                schema["additionalProperties"] = False
    for kind in _REQUESTS:  # cross-field rules a Struct states next to its check
        extra = getattr(kind, "json_schema_extra", None)
        if extra is not None:
            requests[kind.__name__].update(copy.deepcopy(extra))
    _bound_token_ids(requests, vocab_size)
    _bound_token_ids(responses, None)
    overlap = requests.keys() & responses.keys()
    assert not overlap, f"request and response schemas share names: {overlap}"
    return {**requests, **responses}


def complete(
    doc: dict[str, Any],
    *,
    strict: bool,
    vocab_size: int | None = None,
    priorities: bool = True,
) -> dict[str, Any]:
    """FastAPI's document of the routes, plus the components their ``openapi_extra`` refer to.
    What the server's settings decide is stated too: token ids below ``vocab_size``, and,
    unless ``priorities`` (the priority scheduling policy), ``priority`` 0 only."""
    schemas = components(strict=strict, vocab_size=vocab_size)
    if not priorities:
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            schemas[name].setdefault("allOf", []).append(P.only("priority", {"const": 0}))
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
    return doc
