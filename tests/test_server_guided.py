"""Structured outputs over HTTP (server/structured.py): OpenAI's ``response_format``
(``json_object``, ``json_schema``, also through the ``openai`` client's ``parse``), vLLM's
``guided_*`` fields and ``structured_outputs``, ``tool_choice`` forcing a call (named and
``"required"``, whole and streamed), the 400s naming the field (at decoding, and for what only the
engine's compile finds), and ``prompt_logprobs_start`` on /v1/completions (nulls before the start,
the context served from the cache).

radixkv-tiny's tokenizer is byte-level, so every schema and regex is spellable; its replies are
sampled with seeds, and every check is on what the constraint guarantees (valid JSON, a schema's
validation, a full match), never on what the model happens to say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_helpers import MODEL, assert_clean, in_loop, live_server

from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState
from radixkv.server.structured import forced_tool_schema, request_constraint
from radixkv.server.tool_calls import ForcedToolChoice, ToolCallStream, parse_tool_calls

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},  # (numeric ranges are not enforced: none here)
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "maxLength": 20}},
                "required": ["query"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: {} only
]
PARAMS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------ units: schemas and parsing


def test_forced_tool_schemas() -> None:
    named = forced_tool_schema(TOOLS, {"type": "function", "function": {"name": "search"}}, None)
    assert named is not None
    assert named[0] == ForcedToolChoice("search") and named[1] == PARAMS["search"]
    # no parameters: the empty object (vLLM's default)
    none = forced_tool_schema(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    assert none is not None and none[1] == {"type": "object", "properties": {}}
    found = forced_tool_schema(TOOLS, "required", None)
    assert found is not None
    how, schema = found
    assert how == ForcedToolChoice(None)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],  # unit missing
        [{"name": "search"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = forced_tool_schema(TOOLS, "required", False)
    assert one is not None and one[1]["maxItems"] == 1  # parallel_tool_calls: false
    # the tools' $defs go to the root, where their references point
    ref_tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"p": {"$ref": "#/$defs/P"}},
                "$defs": {"P": {"type": "integer"}},
            },
        },
    }
    with_defs = forced_tool_schema([ref_tool, *TOOLS], "required", None)
    assert with_defs is not None and with_defs[1]["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], with_defs[1])
    clash = json.loads(json.dumps(ref_tool))
    clash["function"]["name"] = "g"
    clash["function"]["parameters"]["$defs"]["P"] = {"type": "string"}
    with pytest.raises(ValueError, match=r"^tools\[1\]"):
        forced_tool_schema([ref_tool, clash], "required", None)
    clash["function"]["parameters"]["$defs"] = ["P"]
    with pytest.raises(ValueError, match=r"^tools\[1\]"):
        forced_tool_schema([ref_tool, clash], "required", None)


def test_forced_replies_read_as_calls() -> None:
    named = ForcedToolChoice("get_weather")
    content, calls = parse_tool_calls('{"city": "Oslo", "unit": "C"}', named)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    required = ForcedToolChoice(None)
    text = '[{"name": "now", "parameters": {}}, {"name": "search", "parameters": {"query": "é"}}]'
    content, calls = parse_tool_calls(text, required)
    assert content is None and [c.name for c in calls] == ["now", "search"]
    assert json.loads(calls[1].arguments) == {"query": "é"} and calls[0].id != calls[1].id
    # cut by max_tokens: not whole JSON, so the text is the content
    for how, cut in ((named, '{"city": "Os'), (required, '[{"name": "now", "para')):
        assert parse_tool_calls(cut, how) == (cut, [])
    # streamed: held back whole, the calls with the finish
    s = ToolCallStream(required)
    assert all(s.feed(text[i : i + 5]) == "" for i in range(0, len(text), 5))
    rest, calls = s.finish()
    assert rest == "" and [c.name for c in calls] == ["now", "search"]


def _chat(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **kw}).encode()


def _cmpl(**kw: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **kw}).encode()


def test_request_constraints() -> None:
    def constraint(body: bytes, kind: Any = P.CompletionRequest) -> Any:
        return request_constraint(P.decode_request(body, kind))

    assert constraint(_cmpl()) is None
    assert constraint(_cmpl(response_format={"type": "text"})) is None
    c = constraint(_cmpl(response_format={"type": "json_object"}))
    assert c.guided.json_object and c.param == "response_format" and c.tool_choice is None
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    c = constraint(_cmpl(response_format=fmt, guided_whitespace_pattern="[ ]*"))
    assert json.loads(c.guided.json) == SCHEMA and c.guided.whitespace_pattern == "[ ]*"
    assert list(json.loads(c.guided.json)["properties"]) == list(SCHEMA["properties"])  # order
    c = constraint(_cmpl(guided_json=json.dumps(SCHEMA)))
    assert json.loads(c.guided.json) == SCHEMA and c.param == "guided_json"
    c = constraint(_cmpl(guided_choice=["x", "y"]))
    assert c.guided.choice == ("x", "y") and c.param == "guided_choice"
    c = constraint(_cmpl(structured_outputs={"regex": "[a-z]+", "json_object": False}))
    assert c.guided.regex == "[a-z]+" and c.param == "structured_outputs"
    c = constraint(_cmpl(structured_outputs={"json_object": True, "whitespace_pattern": "\n"}))
    assert c.guided.json_object and c.guided.whitespace_pattern == "\n"
    # chat: tool_choice forcing; "auto" and "none" constrain nothing
    for choice in ("auto", "none", None):
        assert constraint(_chat(tools=TOOLS, tool_choice=choice), P.ChatCompletionRequest) is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    c = constraint(_chat(tools=TOOLS, tool_choice=named), P.ChatCompletionRequest)
    assert json.loads(c.guided.json) == WEATHER and c.tool_choice == ForcedToolChoice("get_weather")
    assert c.param == "tools"  # the schema came from there: the engine's errors name it
    c = constraint(_chat(tools=TOOLS, tool_choice="required"), P.ChatCompletionRequest)
    assert json.loads(c.guided.json)["type"] == "array" and c.tool_choice == ForcedToolChoice()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (_chat(tool_choice="required"), "tool_choice"),  # no tools
        (_chat(tools=[], tool_choice="required"), "tool_choice"),
        (_chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
        (
            _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}}),
            "tool_choice",
        ),
        (_chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
        (_chat(tools=TOOLS, tool_choice={"function": {"name": "now"}}), "tool_choice"),
        (_chat(tools=TOOLS, tool_choice="always"), "tool_choice"),
        (_chat(tools=[{"type": "retrieval"}], tool_choice="required"), "tools"),
        (_chat(tools=[{"type": "function", "function": {}}], tool_choice="required"), "tools"),
        (
            _chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}],
                tool_choice="required",
            ),
            "tools",
        ),
        (
            _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
            "response_format",
        ),
        (_chat(tools=TOOLS, tool_choice="required", guided_regex="a"), "guided_regex"),
        (_chat(tools=TOOLS, tool_choice="required", structured_outputs={"regex": "a"}), None),
    ],
)
def test_chat_constraint_rejects(body: bytes, param: str | None) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(body, P.ChatCompletionRequest)
    assert e.value.message
    if param is not None:
        assert e.value.param == param
    if b"each constrain" in e.value.message.encode():
        assert "tool_choice" in e.value.message  # the conflict names both fields


# ------------------------------------------------------------------ a radixkv-tiny server


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[BackgroundServer, ServerState]]:
    # with a tool-call parser: forced calls must not need it, nor be read by it
    with live_server(ServerConfig(tool_call_parser="hermes"), max_model_len=1024) as s:
        yield s


@pytest.fixture(scope="module")
def http(tiny: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny[0].url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(tiny: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=tiny[0].url + "/v1", api_key="x", max_retries=0, timeout=120)
    yield c
    c.close()


def _post(http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _error(http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


def _texts(r: dict[str, Any]) -> list[tuple[str | None, str]]:
    """(text or message content, finish_reason) per choice, in index order."""
    choices = sorted(r["choices"], key=lambda c: c["index"])
    return [
        (c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in choices
    ]


def _stream(http: httpx.Client, body: dict[str, Any], path: str) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_json_object(http: httpx.Client) -> None:
    base = {"n": 4, "seed": 11, "max_tokens": 300}
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "A JSON object:"}),
    ):
        r = _post(http, {**base, **body, "response_format": {"type": "json_object"}}, path)
        done = [text for text, finish in _texts(r) if finish == "stop"]
        assert done, _texts(r)  # a small model may ramble inside a string; some close
        for text in done:
            assert isinstance(json.loads(text), dict), text
        for text, finish in _texts(r):
            assert finish in ("stop", "length") and text.startswith("{")
    # vLLM's spelling of the same
    r = _post(http, {**base, "prompt": "{", "structured_outputs": {"json_object": True}})
    assert any(f == "stop" for _, f in _texts(r))
    assert all(isinstance(json.loads(t), dict) for t, f in _texts(r) if f == "stop")


def test_json_schema_outputs_validate(http: httpx.Client) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    outs = []
    r = _post(
        http,
        {"messages": MESSAGES, "response_format": fmt, "n": 3, "seed": 1, "max_tokens": 200},
        "/v1/chat/completions",
    )
    outs += _texts(r)
    for body in (
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},  # vLLM takes the schema's JSON text too
        {"structured_outputs": {"json": SCHEMA}},
        {"response_format": fmt},
    ):
        r = _post(http, {"prompt": ["Person:", "{"], "n": 2, "seed": 2, "max_tokens": 200, **body})
        outs += _texts(r)
    assert len(outs) == 3 + 4 * 4
    for text, finish in outs:
        assert finish == "stop", text  # the language ended: no EOS token needed
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value)[:2] == ["name", "age"]  # the schema's order


def test_whitespace_pattern(http: httpx.Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        },
        "required": ["a", "b"],
    }
    body = {"prompt": "JSON:", "guided_json": schema, "n": 4, "seed": 5, "max_tokens": 100}
    spaced = [t for t, _ in _texts(_post(http, body))]
    assert any(" " in t for t in spaced)  # the default: at most one space between tokens
    for extra in (
        {"guided_whitespace_pattern": "\n"},
        {"guided_json": None, "structured_outputs": {"json": schema, "whitespace_pattern": "\n"}},
    ):
        for text, finish in _texts(_post(http, {**body, **extra})):
            assert finish == "stop" and " " not in text and "\n" in text, text
            jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice(http: httpx.Client) -> None:
    pattern = r"[A-Z][a-z]{2,8} (19|20)[0-9]{2}-[0-9]{2}"
    base = {"prompt": ["Date:", "x"], "n": 3, "seed": 3, "max_tokens": 40}
    for body in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        for text, finish in _texts(_post(http, {**base, **body})):
            assert re.fullmatch(pattern, text) and finish == "stop", text
    choices = ["positive", "negative", "néant ✓"]
    seen = set()
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for text, finish in _texts(_post(http, {**base, **body, "n": 6})):
            assert text in choices and finish == "stop"
            seen.add(text)
    assert len(seen) > 1  # sampled among them
    r = _post(
        http,
        {"messages": MESSAGES, "guided_choice": ["yes", "no"], "logprobs": True, "seed": 4},
        "/v1/chat/completions",
    )
    (choice,) = r["choices"]
    assert choice["message"]["content"] in ("yes", "no")
    tokens = "".join(t["token"] for t in choice["logprobs"]["content"])
    assert tokens == choice["message"]["content"]  # logprobs cover the guided tokens


def test_streamed_guided_output_is_the_whole_one(http: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    body = {"messages": MESSAGES, "response_format": fmt, "n": 2, "seed": 9, "max_tokens": 200}
    chunks = _stream(http, body, "/v1/chat/completions")
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            if c["finish_reason"] is not None:
                finish[c["index"]] = c["finish_reason"]
    assert sorted(texts) == [0, 1] and finish == {0: "stop", 1: "stop"}
    assert len(chunks) > 4  # streamed in pieces, not held back
    whole = _post(http, body, "/v1/chat/completions")
    for i, (text, _) in enumerate(_texts(whole)):
        assert texts[i] == text  # same seed: the stream is the whole response in pieces
        jsonschema.validate(json.loads(texts[i]), SCHEMA)
    # completions
    body = {"prompt": "x", "guided_json": SCHEMA, "seed": 4, "max_tokens": 200}
    text = "".join(
        c["choices"][0]["text"] for c in _stream(http, body, "/v1/completions") if c["choices"]
    )
    jsonschema.validate(json.loads(text), SCHEMA)


def test_openai_client_parse(client: openai.OpenAI) -> None:
    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)
        unit: str = pydantic.Field(pattern="^(C|F)$")
        sunny: bool

    r = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Weather, max_tokens=200, seed=6
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and parsed.unit in ("C", "F")


def _call_args(call: dict[str, Any]) -> tuple[str, Any]:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    params = PARAMS[name] or {"type": "object", "properties": {}, "additionalProperties": False}
    jsonschema.validate(args, params)
    return name, args


def test_named_tool_choice(http: httpx.Client, client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named, "max_tokens": 100}
    r = _post(http, {**body, "n": 3, "seed": 2}, "/v1/chat/completions")
    for c in r["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert _call_args(call)[0] == "get_weather"
    # the openai client, streamed: the call comes whole with the finish
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "search"}},
            max_tokens=100,
            seed=3,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function is not None
    assert calls[0].function.name == "search"
    jsonschema.validate(json.loads(calls[0].function.arguments or ""), PARAMS["search"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # no parameters: the empty object
    r = _post(
        http,
        {**body, "tool_choice": {"type": "function", "function": {"name": "now"}}},
        "/v1/chat/completions",
    )
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "now" and json.loads(call["function"]["arguments"]) == {}
    # cut by max_tokens: no whole call, the text is the content
    r = _post(http, {**body, "max_tokens": 4}, "/v1/chat/completions")
    (c,) = r["choices"]
    assert c["finish_reason"] == "length" and c["message"]["tool_calls"] is None
    assert c["message"]["content"].startswith("{")


def test_required_tool_choice(http: httpx.Client) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300}
    r = _post(http, {**body, "n": 4, "seed": 8, "temperature": 0.8}, "/v1/chat/completions")
    names = set()
    for c in r["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        calls = c["message"]["tool_calls"]
        assert len(calls) >= 1 and len({call["id"] for call in calls}) == len(calls)
        names |= {_call_args(call)[0] for call in calls}
    assert names <= set(PARAMS)
    # one call at most with parallel_tool_calls: false
    r = _post(
        http,
        {**body, "n": 3, "seed": 8, "temperature": 0.8, "parallel_tool_calls": False},
        "/v1/chat/completions",
    )
    for c in r["choices"]:
        (call,) = c["message"]["tool_calls"]
        _call_args(call)
    # streamed: the calls in one delta with the finish, no content
    chunks = _stream(http, {**body, "seed": 8, "temperature": 0.8}, "/v1/chat/completions")
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content == ""
    (last,) = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    calls = last["choices"][0]["delta"]["tool_calls"]
    assert [call["index"] for call in calls] == list(range(len(calls))) and calls
    for call in calls:
        _call_args(call)
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_parser_leaves_constrained_content_alone(http: httpx.Client) -> None:
    """With tools and tool_choice "auto", a reply constrained by response_format is the client's
    format: content, not read by the server's --tool-call-parser."""
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "<tool_call>"}}}
    r = _post(
        http,
        {"messages": MESSAGES, "tools": TOOLS, "response_format": fmt, "max_tokens": 30},
        "/v1/chat/completions",
    )
    (c,) = r["choices"]
    assert c["message"]["content"] == '"<tool_call>"' and c["message"]["tool_calls"] is None


BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "fraction"}}}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json", ["guided_regex"]),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "response_format",
            ["guided_choice"],
        ),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", []),
        ({"response_format": {"type": "yaml"}}, "response_format", ["yaml"]),
        ({"response_format": {"type": "json_schema"}}, "response_format", ["schema"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            ["schema"],
        ),
        # what only the engine's compile finds: still a 400 naming the field
        ({"guided_json": BAD_SCHEMA}, "guided_json", ["fraction"]),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": BAD_SCHEMA}}},
            "response_format",
            ["fraction"],
        ),
        ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs", ["fraction"]),
        ({"guided_regex": "(unclosed"}, "guided_regex", ["(unclosed"]),
        ({"guided_regex": "^anchored$"}, "guided_regex", ["anchored"]),
        ({"structured_outputs": {"regex": r"\bword"}}, "structured_outputs", []),
        ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", ["reference"]),
        # a grammar is compiled by the engine too (single quotes are not GBNF)
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar", ["grammar", "GBNF"]),
        ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs", ["nothing"]),
        ({"guided_choice": ["a", ""]}, "guided_choice", []),
    ],
)
def test_bad_constraints_are_400(
    tiny: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    body: dict[str, Any],
    param: str,
    words: list[str],
) -> None:
    st = tiny[1]
    queued = in_loop(st, st.engine.stats).num_requests
    for path, base in (
        ("/v1/completions", {"prompt": ["x", "y"]}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        for stream in (False, True):
            err = _error(http, {**base, **body, "stream": stream, "max_tokens": 5}, path)
            assert err["param"] == param, err
            assert all(w in err["message"] for w in words), err
    # checked (and compiled) before submission: no prompt of them reached the engine
    assert in_loop(st, st.engine.stats).num_requests == queued


def test_bad_tool_choice_is_400(http: httpx.Client) -> None:
    path = "/v1/chat/completions"
    named = {"type": "function", "function": {"name": "get_time"}}
    err = _error(http, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": named}, path)
    assert err["param"] == "tool_choice" and "get_time" in err["message"]
    err = _error(http, {"messages": MESSAGES, "tool_choice": "required"}, path)
    assert err["param"] == "tool_choice" and "tools" in err["message"]
    # a tool whose parameters the engine cannot compile: named by the field it came from
    bad = [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        err = _error(http, {"messages": MESSAGES, "tools": bad, "tool_choice": choice}, path)
        assert err["param"] == "tools" and "fraction" in err["message"]
    err = _error(
        http,
        {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "guided_json": SCHEMA},
        path,
    )
    assert err["param"] == "guided_json" and "tool_choice" in err["message"]


def test_server_keeps_serving_after_bad_requests(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    for _ in range(3):
        for bad in (
            {"guided_regex": "(x"},
            {"guided_json": BAD_SCHEMA, "stream": True},
            {"guided_json": SCHEMA, "guided_choice": ["a"]},
            {"response_format": {"type": "json_schema"}},
            {"echo": True, "logprobs": 1, "prompt_logprobs_start": 99},
        ):
            _error(http, {"prompt": ["a", "b", "c"], "max_tokens": 3, **bad})
        r = _post(http, {"prompt": "ok", "guided_choice": ["fine", "well"], "max_tokens": 5})
        assert r["choices"][0]["text"] in ("fine", "well")
    assert_clean(tiny[1])


# ------------------------------------------------------------------ prompt_logprobs_start


def test_prompt_logprobs_start(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = tiny[1]
    context = st.tokenizer.encode("A radix tree shares the pages of common prefixes. " * 4)
    start = len(context)
    assert start > 3 * 16  # several pages of context
    conts = [st.tokenizer.encode(w, add_special_tokens=False) for w in (" Yes.", " No, never.")]
    base = {"max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    # the whole prompt scored: no prefix reused, even though the context was sent before
    full = [_post(http, {**base, "prompt": context + c}) for c in conts]
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in full)
    for cont, whole in zip(conts, full):
        http_r = http.post(
            "/v1/completions",
            json={"model": MODEL, **base, "prompt": context + cont, "prompt_logprobs_start": start},
        )
        assert http_r.status_code == 200, http_r.text
        r = http_r.json()
        # the context came from the cache (up to the start, in whole pages)
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and int(http_r.headers["x-cached-tokens"]) == cached
        assert cached <= start
        lp = r["choices"][0]["logprobs"]
        want = whole["choices"][0]["logprobs"]
        n = len(context) + len(cont)
        assert len(lp["tokens"]) == n + 1 and lp["tokens"] == want["tokens"]
        assert lp["text_offset"] == want["text_offset"]
        assert lp["token_logprobs"][:start] == [None] * start
        assert lp["top_logprobs"][:start] == [None] * start
        # from the start on: the values of the whole prompt's scoring
        assert lp["token_logprobs"][start:] == pytest.approx(
            want["token_logprobs"][start:], abs=1e-4
        )
        assert [set(t) for t in lp["top_logprobs"][start:]] == [
            set(t) for t in want["top_logprobs"][start:]
        ]
        assert r["choices"][0]["text"] == whole["choices"][0]["text"]
    # vLLM's prompt_logprobs, with the start: null before it
    body = {"prompt": context + conts[1], "max_tokens": 2, "prompt_logprobs": 2}
    plp = _post(http, {**body, "prompt_logprobs_start": start})["choices"][0]["prompt_logprobs"]
    ref = _post(http, body)["choices"][0]["prompt_logprobs"]
    assert plp[:start] == [None] * start and all(e is not None for e in plp[start:])
    for got, want in zip(plp[start:], ref[start:]):
        assert list(got) == list(want)
        for k in got:
            assert got[k]["logprob"] == pytest.approx(want[k]["logprob"], abs=1e-4)
    # streamed echo: the same choice, its prompt first
    body = {**base, "prompt": context + conts[0], "prompt_logprobs_start": start, "max_tokens": 3}
    whole = _post(http, body)["choices"][0]
    chunks = _stream(http, body, "/v1/completions")
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tlp = [
        v
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert text == whole["text"] and tlp[:start] == [None] * start
    assert tlp[start:] == pytest.approx(whole["logprobs"]["token_logprobs"][start:], abs=1e-4)
    assert_clean(st)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"prompt_logprobs_start": -1}, []),
        ({"prompt_logprobs_start": 1.5}, []),
        ({"prompt_logprobs_start": 3}, ["echo"]),  # nothing to score
        ({"prompt_logprobs_start": 3, "echo": True}, ["echo"]),  # echo without logprobs
        ({"prompt_logprobs_start": 3, "logprobs": 1}, ["echo"]),  # logprobs without echo
        ({"prompt_logprobs_start": 5, "echo": True, "logprobs": 0}, ["less than"]),
        ({"prompt_logprobs_start": 99, "prompt_logprobs": 1}, ["less than"]),
    ],
)
def test_bad_prompt_logprobs_start_is_400(
    http: httpx.Client, extra: dict[str, Any], words: list[str]
) -> None:
    err = _error(
        http, {"prompt": [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], "max_tokens": 2, **extra}
    )
    assert err["param"] == "prompt_logprobs_start"
    assert all(w in err["message"] for w in words), err


def test_oversized_grammar_is_400_and_other_streams_go_on(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    """Issue 47: a grammar rule of 2,001 alternatives (~20 KB) used to pass intake and fail
    the whole batch mid-generation; it is a 400 naming the limit, and another tenant's running
    streams finish normally."""
    alts = " | ".join(f'"w{i}"' for i in range(2001))
    body = {"prompt": "x", "max_tokens": 4}
    with (
        httpx.Client(base_url=tiny[0].url, timeout=120) as other,
        other.stream(
            "POST",
            "/v1/completions",
            json={"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 24, "stream": True},
        ) as streaming,
    ):
        lines = streaming.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "error" not in json.loads(first[6:])
        for grammar in ("start: x\nx: " + alts + "\n", 'start: "a" (' + alts + ")\n"):
            err = _error(http, {**body, "guided_grammar": grammar})
            assert err["param"] == "guided_grammar", err
            assert "alternatives" in err["message"] and "1999" in err["message"], err
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert sum(r in ("length", "stop") for r in reasons) == 3
    assert_clean(tiny[1])
