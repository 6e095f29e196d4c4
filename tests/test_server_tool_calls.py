"""Tool calls: parsing the hermes and llama3_json formats (whole replies and streamed ones), agent
turns (assistant tool_calls, tool results) rendered by the chat template, and the real
``openai`` client receiving ``message.tool_calls`` from a live server whose model is scripted
to write a call (radixkv-tiny would not write one by itself)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from server_helpers import MODEL, assert_clean, live_server

import radixkv.engine.engine as engine_mod
from radixkv.model.chat_template import render_chat_template
from radixkv.model.tokenizer import encode_chat
from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState
from radixkv.server.tool_calls import ToolCallStream, parse_tool_calls

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
ARGS = {"city": "Paris", "unit": "C"}


# ------------------------------------------------------------------ parsing
def test_hermes_calls_and_the_content_around_them() -> None:
    content, calls = parse_tool_calls(f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", "hermes")
    assert content == "Let me look." and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == ARGS
    assert calls[0].id.startswith("call_")
    two = f"<tool_call>{CALL}</tool_call>\n<tool_call>" + '{"name": "now", "arguments": {}}'
    content, calls = parse_tool_calls(two, "hermes")  # the last block left open at EOS
    assert content is None and [c.name for c in calls] == ["get_weather", "now"]
    assert len({c.id for c in calls}) == 2
    # arguments already a JSON string are kept as they are
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes"
    )
    assert calls[0].arguments == '{"a": 1}'


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        f"<tool_call>{CALL}</tool_call><tool_call>broken",  # one bad block: all text
    ],
)
def test_what_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
    for text in (one, f"<|python_tag|>{one}", f"  {one}\n"):
        content, calls = parse_tool_calls(text, "llama3_json")
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", ARGS)
        ]
    _, calls = parse_tool_calls(f'{one}; {{"name": "now", "parameters": {{}}}}', "llama3_json")
    assert [c.name for c in calls] == ["get_weather", "now"]
    for text in ("Paris is sunny.", "{not json", '{"city": "Paris"}'):
        assert parse_tool_calls(text, "llama3_json") == (text, [])
    with pytest.raises(ValueError, match="unknown tool call parser"):
        parse_tool_calls("x", "gorilla")


def _stream(parser: str, text: str, step: int) -> tuple[list[str], str, list[Any]]:
    s = ToolCallStream(parser)
    sent = [s.feed(text[i : i + step]) for i in range(0, len(text), step)]
    rest, calls = s.finish()
    return sent, rest, calls


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_content_never_shows_part_of_a_call(step: int) -> None:
    text = f"Let me look.<tool_call>\n{CALL}\n</tool_call>"
    sent, rest, calls = _stream("hermes", text, step)
    assert "".join(sent) == "Let me look." and rest == ""
    assert [c.name for c in calls] == ["get_weather"]
    # text that only looks like the start of a tag for a while comes out whole
    plain = "a <b> and <tool but not a call"
    sent, rest, calls = _stream("hermes", plain, step)
    assert "".join(sent) + rest == plain and calls == []
    # llama3_json: a reply that opens like JSON is held, then sent as calls or as content
    sent, rest, calls = _stream("llama3_json", '{"name": "f", "parameters": {}}', step)
    assert "".join(sent) == "" and [c.name for c in calls] == ["f"]
    sent, rest, calls = _stream("llama3_json", "{ not a call", step)
    assert "".join(sent) + rest == "{ not a call" and calls == []
    sent, rest, calls = _stream("llama3_json", "Sunny in Paris.", step)
    assert "".join(sent) == "Sunny in Paris." and calls == []


# ------------------------------------------------------------------ requests
def test_agent_turns_render_for_the_template() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "tool_choice": "auto",
    }
    req = P.decode_request(json.dumps(body).encode(), P.ChatCompletionRequest, strict=True)
    msgs = req.template_messages()
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"] == body["messages"][1]["tool_calls"]
    # the renderer hands templates the arguments as an object (tojson writes them once), for
    # the server's messages and a Python caller's alike: one chat path
    template = "{% for m in messages %}{{ m.tool_calls | tojson if m.tool_calls }}{% endfor %}"
    seen = render_chat_template(template, msgs, add_generation_prompt=False)
    assert json.loads(seen)[0]["function"]["arguments"] == ARGS
    assert render_chat_template(template, body["messages"], add_generation_prompt=False) == seen
    assert msgs[2] == {
        "role": "tool",
        "content": "18 C",
        "tool_call_id": "call_1",
        "name": "get_weather",
    }
    assert req.wants_tool_calls()
    off = P.decode_request(
        json.dumps({**body, "tool_choice": "none"}).encode(), P.ChatCompletionRequest
    )
    assert not off.wants_tool_calls()
    # forcing a call (guided decoding, server/structured.py): the reply is the calls' JSON,
    # read without the parser
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = P.decode_request(
            json.dumps({**body, "tool_choice": choice}).encode(), P.ChatCompletionRequest
        )
        assert not forced.wants_tool_calls()
    for bad in ({"type": "function", "function": {"name": "other"}}, "sometimes"):
        with pytest.raises(P.ProtocolError, match="tool_choice") as e:
            P.decode_request(
                json.dumps({**body, "tool_choice": bad}).encode(), P.ChatCompletionRequest
            )
        assert e.value.param == "tool_choice"


def test_config_checks_the_parser_name() -> None:
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="gorilla")


# ------------------------------------------------------------------ end to end
REPLY = f"Checking.<tool_call>\n{CALL}\n</tool_call>"


@pytest.fixture
def scripted() -> list[int]:
    """The position in the scripted reply (see _script_reply); tests rewind it per request."""
    return [0]


# A hermes-style template (radixkv-tiny's own knows no tools): tool schemas, the assistant's
# calls with their arguments as JSON objects, tool results.
TEMPLATE = (
    "{%- if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>{{ m.content or '' }}"
    '{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n'
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(ServerConfig(tool_call_parser="hermes"), chat_template=TEMPLATE) as s:
        yield s


def _script_reply(st: ServerState, monkeypatch: pytest.MonkeyPatch, pos: list[int]) -> None:
    """The engine's sampler replaced by a script: the tokens of REPLY, then EOS, from
    ``pos[0]`` on (one request at a time)."""
    core = st.engine.engine
    tokens = [*core.tokenizer.encode(REPLY, add_special_tokens=False), min(core.eos_token_ids)]

    def sample(logits: torch.Tensor, params: Any, generators: Any) -> list[int]:
        tok = tokens[min(pos[0], len(tokens) - 1)]
        pos[0] += 1
        return [tok] * logits.shape[0]

    monkeypatch.setattr(engine_mod, "sample", sample)


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_openai_client_gets_tool_calls(
    server: tuple[BackgroundServer, ServerState],
    scripted: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    srv, st = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    msgs: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    _script_reply(st, monkeypatch, scripted)
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS

    # streamed: the content, then one delta with the call and finish_reason tool_calls
    scripted[0] = 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Checking." and "<tool" not in text
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments or "") == ARGS and calls[0].id
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the agent's next turn: its call and the tool's result go back in, and are served
    scripted[0] = len(REPLY) - 1  # the script's end: the model just stops
    follow = [
        *msgs,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=5)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].finish_reason != "tool_calls"
    # the prompt the model saw holds the call with its arguments as an object, and the result
    req = P.decode_request(
        json.dumps({"model": MODEL, "messages": follow, "tools": TOOLS}).encode(),
        P.ChatCompletionRequest,
    )
    tok = st.engine.engine.tokenizer
    ids = encode_chat(tok, req.template_messages(), tools=TOOLS)
    seen = tok.decode(ids)
    assert '"arguments": {"city": "Paris", "unit": "C"}}</tool_call>' in seen
    assert f"<|tool|>{call.id}: 18 C" in seen
    assert r2.usage is not None and r2.usage.prompt_tokens == len(ids)
    # Engine.chat makes the same ids from the client's own messages (arguments as a string)
    assert encode_chat(tok, follow, tools=TOOLS) == ids

    # tool_choice "none" and requests without tools: the reply stays text
    scripted[0] = 0
    r3 = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert r3.choices[0].message.content == REPLY and r3.choices[0].finish_reason == "stop"
    scripted[0] = 0
    r4 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200)
    assert r4.choices[0].message.content == REPLY and not r4.choices[0].message.tool_calls
    client.close()
    assert_clean(st)
