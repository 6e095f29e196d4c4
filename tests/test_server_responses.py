"""OpenAI's Responses API (``POST /v1/responses``) through the real ``openai`` client: the same
tokens as chat completions for the same conversation, output items (reasoning, message,
function calls) whole and as the typed event stream the client's accumulator accepts,
continuations by ``previous_response_id`` that hit the prefix cache, stored responses read and
deleted per tenant, structured output by ``text.format``, and 400/404s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import (
    CALL,
    MODEL,
    THOUGHT,
    TOOL_TEMPLATE,
    assert_clean,
    checked_client,
    live_server,
    script_reply,
)

from radixkv.model.tokenizer import encode_chat
from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.response_store import ResponseStore, Stored
from radixkv.server.responses import ResponsesRequest, input_messages, shell
from radixkv.server.state import ServerState

TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    config = ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes")
    with live_server(config, chat_template=TOOL_TEMPLATE, guided_jump_forward=False) as s:
        yield s


@pytest.fixture
def client(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    with checked_client(server) as c:
        yield c


def test_same_tokens_as_chat_completions(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Name a colour.", max_output_tokens=12,
        temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == r.usage.input_tokens + 12
    assert r.instructions == "Be brief." and r.max_output_tokens == 12


def test_reasoning_message_and_function_call_items(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    reply = THOUGHT + "Checking." + CALL
    ids = script_reply(st, monkeypatch, reply)
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    reasoning, _, call = r.output
    assert reasoning.content is not None and reasoning.content[0].text == "Weather needs a tool."  # type: ignore[union-attr]
    assert r.output_text == "Checking."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert call.call_id.startswith("call_") and r.status == "completed"  # type: ignore[union-attr]
    thought = len(st.tokenizer.encode(THOUGHT.rstrip(), add_special_tokens=False))
    assert r.usage is not None and r.usage.output_tokens == len(ids) + 1  # and the EOS
    assert r.usage.output_tokens_details.reasoning_tokens == thought

    # streamed: the client's accumulator takes the events and ends with the same items
    script_reply(st, monkeypatch, reply)
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # each event shows its moment: items are added empty and filled by the deltas
    added = [e.item for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert [(a.type, a.status) for a in added] == [
        ("reasoning", "in_progress"),
        ("message", "in_progress"),
        ("function_call", "in_progress"),
    ]
    assert added[1].content == [] and added[2].arguments == ""  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == "Checking."
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking." and final.output[2].arguments == call.arguments  # type: ignore[union-attr]
    assert final.usage is not None  # the same counts (the prompt is cached now)
    assert final.usage.output_tokens_details == r.usage.output_tokens_details
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        r.usage.input_tokens,
        r.usage.output_tokens,
    )
    assert final.usage.input_tokens_details.cached_tokens > 0


def test_continuations_run_the_conversation_and_hit_the_cache(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    # A conversation no other test has sent: the continuation's hit can only come from its
    # first turn (prompt and reply cached when the first response finished).
    first, call, second = call_then_answer(st, monkeypatch, client)
    assert second.output_text == "Sunny." and second.previous_response_id == first.id
    ids = encode_chat(st.tokenizer, seen_conversation(call))
    assert second.usage is not None and second.usage.input_tokens == len(ids)
    assert second.usage.input_tokens_details.cached_tokens > 0
    # the same from the whole conversation as input items
    script_reply(st, monkeypatch, "Sunny.")
    items: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Weather needs a tool."}]},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]  # fmt: skip
    third = client.responses.create(model=MODEL, input=items, tools=TOOLS)
    assert third.usage is not None and third.usage.input_tokens == len(ids)
    # a first turn's instructions are not carried on to its continuation
    told, call, after = call_then_answer(st, monkeypatch, client, instructions="Use tools.")
    assert told.usage is not None and after.usage is not None
    assert after.usage.input_tokens == len(encode_chat(st.tokenizer, seen_conversation(call)))


def call_then_answer(
    st: ServerState, monkeypatch: pytest.MonkeyPatch, client: openai.OpenAI, **first_kw: Any
) -> tuple[Any, Any, Any]:
    """A first response that calls the weather tool (``first_kw`` passed on to it), then its
    continuation by ``previous_response_id`` with the tool's result: (first, call, second)."""
    script_reply(st, monkeypatch, THOUGHT + CALL)
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=TOOLS, **first_kw)
    (call,) = [o for o in first.output if o.type == "function_call"]
    script_reply(st, monkeypatch, "Sunny.")
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        tools=TOOLS,
    )
    return first, call, second


def seen_conversation(call: Any) -> list[dict[str, Any]]:
    """The conversation the model sees in the continuation: the first user turn, the
    assistant's reasoning and tool call, the tool's result."""
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Weather needs a tool.",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"},
    ]


def test_stored_responses_read_deleted_and_not_kept(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    script_reply(st, monkeypatch, "Hi.")
    r = client.responses.create(model=MODEL, input="Hello", metadata={"run": "7"})
    got = client.responses.retrieve(r.id)
    assert got.output_text == "Hi." and got.metadata == {"run": "7"} and got.id == r.id
    assert client.responses.delete(r.id) is None  # the client returns nothing on success
    with pytest.raises(openai.NotFoundError, match="not found") as missing:
        client.responses.retrieve(r.id)
    assert missing.value.code == "response_not_found"
    script_reply(st, monkeypatch, "Hi.")
    gone = client.responses.create(model=MODEL, input="Hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=gone.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_text_format_holds_the_output_to_a_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 8}},
        "required": ["colour"],
    }
    fmt: Any = {"format": {"type": "json_schema", "name": "c", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input="A colour as JSON", text=fmt, temperature=0)
    assert set(json.loads(r.output_text)) == {"colour"} and r.status == "completed"
    assert r.text is not None and r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "'input_image' parts are not supported",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role must be"),
        ({"background": True}, "background", "background responses are not supported"),
        ({"truncation": "auto"}, "truncation", "truncation 'auto' is not supported"),
        ({"max_output_tokens": 0}, "max_output_tokens", ">= 1"),
        ({"max_output_tokens": 100_000}, "input", "maximum context length"),  # as chat does
        ({"input": "x" * 20_000}, "input", "maximum context length"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice", ""),
        ({"text": {"format": {"type": "xml"}}}, "text", "xml"),
    ],
)
def test_bad_requests_name_the_field(
    server: tuple[BackgroundServer, ServerState], body: dict[str, Any], param: str, message: str
) -> None:
    srv, st = server
    r = httpx.post(srv.url + "/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert_clean(st)


def test_the_store_is_per_tenant_and_bounded() -> None:
    req = ResponsesRequest(model=MODEL, input="x")
    store = ResponseStore(capacity=2)
    kept = [Stored(shell(req, f"resp_{i}", 0), input_messages("x")) for i in range(3)]
    store.put("alice", kept[0])
    assert store.get("bob", "resp_0") is None and store.get("alice", "resp_0") is kept[0]
    store.put("alice", kept[1])
    store.get("alice", "resp_0")  # used: resp_1 is now the least recent
    store.put("bob", kept[2])
    assert store.get("alice", "resp_1") is None and len(store) == 2
    assert not store.delete("bob", "resp_0") and store.delete("alice", "resp_0")
    store_none = ResponseStore(capacity=0)
    store_none.put("alice", kept[0])
    assert len(store_none) == 0
    with pytest.raises(ValueError, match="responses_store_size must be >= 0"):
        ServerConfig(responses_store_size=-1)


def test_other_tenants_cannot_read_or_continue() -> None:
    keys = {"key-alice-0000": "alice", "key-bob-00000": "bob"}
    with live_server(ServerConfig(api_keys=keys)) as (srv, st):
        alice, bob = (
            openai.OpenAI(base_url=srv.url + "/v1", api_key=k, max_retries=0, timeout=60)
            for k in keys
        )
        r = alice.responses.create(model=MODEL, input="secret", max_output_tokens=3)
        assert alice.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=MODEL, input="x", previous_response_id=r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(r.id)
        assert alice.responses.retrieve(r.id).id == r.id
        assert_clean(st)


def test_input_items_become_chat_turns() -> None:
    msgs = input_messages(
        [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        ]
    )
    assert [(m.role, m.text()) for m in msgs] == [
        ("developer", "Rules."),
        ("user", "Q"),
        ("assistant", "A"),
    ]
    assert msgs[2].reasoning == "think" and msgs[2].tool_calls is not None
    assert msgs[2].tool_calls[0]["id"] == "c1"
    assert P.template_messages(msgs)[0]["role"] == "system"
