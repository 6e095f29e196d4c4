"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) through the
real ``anthropic`` client: the same tokens and text as chat completions for the same
conversation, streamed as Anthropic's events, tool use and tool results, stop reasons, the
prefix cache reported as ``cache_read_input_tokens``, and errors in Anthropic's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
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
    in_loop,
    live_server,
    script_reply,
)

from radixkv.model.tokenizer import encode_chat
from radixkv.server.auth import request_authorization
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

KEY = "messages-key-0001"
# greedy: the SDK has no temperature parameter any more, older clients send it in the body
GREEDY = {"temperature": 0}
TOOLS: list[Any] = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
OPENAI_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    config = ServerConfig(
        reasoning_parser="qwen3", tool_call_parser="hermes", api_keys={KEY: "tenant-a"}
    )
    with live_server(config, chat_template=TOOL_TEMPLATE, guided_jump_forward=False) as s:
        yield s


@pytest.fixture
def claude(server: tuple[BackgroundServer, ServerState]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server[0].url, api_key=KEY, max_retries=0) as c:
        yield c
    assert_clean(server[1])


@pytest.fixture
def oai(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    with checked_client(server) as c:
        c.api_key = KEY
        yield c


def test_a_turn_is_the_chat_completion_of_the_same_conversation(
    claude: anthropic.Anthropic, oai: openai.OpenAI, server: tuple[BackgroundServer, ServerState]
) -> None:
    _, st = server
    system, user = "You complete Python.", "def fib(n):"
    m = claude.messages.create(
        model=MODEL, max_tokens=12, system=system, extra_body=GREEDY,
        messages=[{"role": "user", "content": user}],
    )  # fmt: skip
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
    )  # fmt: skip
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert m.stop_reason == "max_tokens" and m.role == "assistant" and m.model == MODEL
    assert chat.usage is not None
    ids = encode_chat(
        st.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(ids) == chat.usage.prompt_tokens
    assert u.output_tokens == 12 and u.cache_creation_input_tokens == 0
    # the same conversation again: its prefix comes from the cache, and Anthropic counts the
    # cached part apart from input_tokens
    again = claude.messages.create(
        model=MODEL, max_tokens=12, system=system, extra_body=GREEDY,
        messages=[{"role": "user", "content": user}],
    )  # fmt: skip
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(ids)
    assert claude.messages.count_tokens(
        model=MODEL, system=system, messages=[{"role": "user", "content": user}]
    ).input_tokens == len(ids)


def test_streamed_events_build_the_same_message(claude: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, max_tokens=16, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": "import os\n"}]}],
    )  # fmt: skip
    whole = claude.messages.create(**kw)
    kinds = [e.type for e in claude.messages.create(stream=True, **kw)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    with claude.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 16


def test_stop_sequences_say_which_matched(claude: anthropic.Anthropic, oai: openai.OpenAI) -> None:
    msgs: list[Any] = [{"role": "user", "content": "import os\n"}]
    free = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=msgs)
    text = free.content[0].text  # type: ignore[union-attr]
    at = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[at : at + 2]  # its first occurrence is after the start
    m = claude.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=msgs, stop_sequences=["@@", stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:at]  # type: ignore[union-attr]
    with claude.messages.stream(
        model=MODEL, max_tokens=24, extra_body=GREEDY, messages=msgs, stop_sequences=[stop]
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # the OpenAI route says which stop matched too (vLLM's stop_reason)
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0, messages=msgs, stop=[stop]
    )
    assert chat.choices[0].model_extra["stop_reason"] == stop  # type: ignore[index]


def test_tool_use_and_a_tool_result_turn(
    claude: anthropic.Anthropic,
    server: tuple[BackgroundServer, ServerState],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    ask: list[Any] = [{"role": "user", "content": "Weather in Lima?"}]
    script_reply(st, monkeypatch, THOUGHT + "Checking." + CALL)
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    thinking, said, use = m.content
    assert thinking.thinking == "Weather needs a tool." and said.text == "Checking."  # type: ignore[union-attr]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}  # type: ignore[union-attr]
    assert m.stop_reason == "tool_use"
    script_reply(st, monkeypatch, THOUGHT + "Checking." + CALL)
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=TOOLS) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.content[2].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert streamed.stop_reason == "tool_use"
    # the result goes back as a tool_result block: the conversation the model sees is the
    # chat with the assistant's call and a tool message, and its first turn comes from cache
    script_reply(st, monkeypatch, "Sunny.")
    turns: list[Any] = [
        *ask,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": use.id, "name": "get_weather", "input": {"city": "Paris"}},
        ]},  # type: ignore[union-attr]
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "18 C",
             "cache_control": {"type": "ephemeral"}},
        ]},  # type: ignore[union-attr]
    ]  # fmt: skip
    done = claude.messages.create(model=MODEL, max_tokens=50, messages=turns, tools=TOOLS)
    assert done.content[0].text == "Sunny." and done.stop_reason == "end_turn"  # type: ignore[union-attr]
    seen = [
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": use.id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},  # type: ignore[union-attr]
        {"role": "tool", "tool_call_id": use.id, "content": "18 C"},  # type: ignore[union-attr]
    ]  # fmt: skip
    ids = encode_chat(st.tokenizer, seen, tools=OPENAI_TOOLS)
    assert done.usage.input_tokens + done.usage.cache_read_input_tokens == len(ids)
    assert done.usage.cache_read_input_tokens > 0
    forced = claude.messages.create(
        model=MODEL, max_tokens=60, messages=ask, tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert [b.type for b in forced.content] == ["tool_use"] and forced.stop_reason == "tool_use"
    assert isinstance(forced.content[0].input, dict)  # type: ignore[union-attr]


def _post(server: tuple[BackgroundServer, ServerState], body: Any, **headers: str) -> Any:
    return httpx.post(
        server[0].url + "/v1/messages", json=body, headers={"x-api-key": KEY, **headers}, timeout=60
    )


BAD: list[tuple[dict[str, Any], int, str, str]] = [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        400,
        "invalid_request_error",
        "'image' blocks are not supported",
    ),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        400,
        "invalid_request_error",
        "thinking budgets",
    ),
    ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        400,
        "invalid_request_error",
        "server tools",
    ),
    ({"model": "claude-opus-9"}, 404, "not_found_error", "claude-opus-9"),
    ({"max_tokens": 10**7}, 400, "invalid_request_error", "maximum context length"),
]


@pytest.mark.parametrize(("patch", "status", "kind", "msg"), BAD)
def test_errors_are_anthropic_shaped_and_run_nothing(
    server: tuple[BackgroundServer, ServerState],
    patch: dict[str, Any],
    status: int,
    kind: str,
    msg: str,
) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body.update(patch)
    body = {k: v for k, v in body.items() if v is not None}
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind, err
    assert msg in err["error"]["message"], err
    assert_clean(server[1])


def test_keys_come_as_x_api_key_or_bearer(server: tuple[BackgroundServer, ServerState]) -> None:
    assert request_authorization({"x-api-key": "k1"}) == "Bearer k1"
    assert request_authorization({"authorization": "Bearer k2", "x-api-key": "k1"}) == "Bearer k2"
    assert request_authorization({}) is None
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert _post(server, body).status_code == 200
    denied = _post(server, body, **{"x-api-key": "not-a-key-at-all"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(
        server[0].url + "/v1/messages", json=body,
        headers={"authorization": f"Bearer {KEY}"}, timeout=60,
    )  # fmt: skip
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    assert_clean(server[1])


def test_a_client_that_leaves_releases_everything(
    server: tuple[BackgroundServer, ServerState],
) -> None:
    """A stream closed after its first event, and a whole answer the client stops waiting for:
    both aborted, nothing held (the Messages stream took over the chat stream's cleanup)."""
    srv, st = server
    body = {
        "model": MODEL,
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
    }
    headers = {"x-api-key": KEY}
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/v1/messages", json={**body, "stream": True}, headers=headers) as r,
    ):
        assert r.status_code == 200
        assert next(r.iter_lines()) == "event: message_start"  # then the client goes
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=srv.url, timeout=0.5) as c:
        c.post("/v1/messages", json={**body, "max_tokens": 2000}, headers=headers)
    assert_clean(st)
    st_after = in_loop(st, st.engine.stats)
    assert st_after.num_aborted >= 2
