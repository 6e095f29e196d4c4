"""Reasoning out of chat replies (``--reasoning-parser``): the split of whole replies, streams
that agree with it under any chunking, the prompt deciding whether a reply starts inside a block,
and a live server whose model is scripted to think (radixkv-tiny would not by itself): the
``openai`` client gets ``message.reasoning`` and ``delta.reasoning``, tool calls are read from
the content only, ``include_reasoning`` drops it, a structured output is held to its schema
from the end of the block on, and a turn's reasoning goes back into the template."""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import MODEL, checked_client, live_server, script_reply

from radixkv.model.tokenizer import encode_chat
from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.cli import add_serve_arguments, server_config_from_args
from radixkv.server.config import ServerConfig
from radixkv.server.reasoning import REASONING_PARSERS, ReasoningParser, ReasoningStream
from radixkv.server.state import ServerState

QWEN3 = ReasoningParser.of("qwen3")


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize(
    ("text", "opened", "split"),
    [
        ("<think>\nLet me see.\n</think>\n\nIt is 4.", False, ("Let me see.", "It is 4.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Let me see.\n</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),
        ("<think>\nLet me see.</think>It is 4.", True, ("Let me see.", "It is 4.")),
        # a reply that opened a block and was cut inside it: all reasoning, no content
        ("<think>\nStill thinking", False, ("Still thinking", None)),
        ("Still thinking", True, ("Still thinking", None)),
        # an empty block (Qwen3 with thinking off writes one when asked to)
        ("<think>\n\n</think>\n\nIt is 4.", False, (None, "It is 4.")),
        ("<think>x</think>", False, ("x", None)),
        # no block: the reply, unchanged (whitespace and all), as without a parser
        ("  It is 4.\n", False, (None, "  It is 4.\n")),
        ("It is 4. <think>no</think>", False, (None, "It is 4. <think>no</think>")),
        ("<thinking>", False, (None, "<thinking>")),
        ("", False, (None, "")),
        ("", True, (None, None)),
        # the end tag splits once: a second one is content
        ("a</think>b</think>c", True, ("a", "b</think>c")),
    ],
)
def test_whole_replies_split(text: str, opened: bool, split: tuple[Any, Any]) -> None:
    assert QWEN3.split(text, opened) == split


def test_the_prompt_says_whether_a_reply_starts_reasoning() -> None:
    assert QWEN3.prompt_opens("<|im_start|>assistant\n<think>\n")  # Qwen3 -Thinking-2507
    assert QWEN3.prompt_opens("<｜Assistant｜><think>\n")  # DeepSeek-R1
    assert not QWEN3.prompt_opens("<|im_start|>assistant\n")  # Qwen3: the model decides
    assert not QWEN3.prompt_opens("assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not QWEN3.prompt_opens("<think> is a tag<|im_end|>\n<|im_start|>assistant\n")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        ReasoningParser.of("granite")


def _streamed(text: str, opened: bool, cuts: list[int]) -> tuple[str, str, list[str]]:
    s = ReasoningStream(QWEN3, opened)
    reasoning, content, sent = "", "", []
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for a, b in itertools.pairwise(bounds):
        r, c = s.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
        sent.append(text[:b])
    r, c = s.finish()
    return reasoning + r, content + c, sent


PIECES = [
    "<think>",
    "</think>",
    "\n",
    " ",
    "a",
    "b c",
    "<",
    "</",
    "</th",
    "<thi",
    "think>",
    "x\n\n",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=12),
    st.booleans(),
    st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
def test_streams_agree_with_the_whole_reply_under_any_chunking(
    pieces: list[str], opened: bool, cuts: list[int]
) -> None:
    text = "".join(pieces)
    reasoning, content, _ = _streamed(text, opened, cuts)
    want_r, want_c = QWEN3.split(text, opened)
    assert (reasoning, content) == (want_r or "", want_c or "")


def test_a_stream_holds_back_only_what_may_still_change() -> None:
    s = ReasoningStream(QWEN3, opened=False)
    assert s.feed("<thi") == ("", "")  # may be the start tag
    assert s.feed("nk>\nStep one.") == ("Step one.", "")
    assert s.feed("\n</th") == ("", "")  # a newline and maybe the end tag
    assert s.feed("ink>\n\nFour") == ("", "Four")
    assert s.feed(".") == ("", ".")
    assert s.finish() == ("", "")
    plain = ReasoningStream(QWEN3, opened=False)
    assert plain.feed("Four") == ("", "Four")  # no block: content goes out at once
    assert plain.feed(" <think>") == ("", " <think>")


# ------------------------------------------------------------------ the request side
def test_reasoning_in_messages_is_checked_and_reaches_the_template() -> None:
    def decode(messages: list[dict[str, Any]]) -> P.ChatCompletionRequest:
        body = {"model": MODEL, "messages": messages}
        return P.decode_request(json.dumps(body).encode(), P.ChatCompletionRequest)

    turn = {"role": "assistant", "content": "4", "reasoning": "2 + 2"}
    req = decode([{"role": "user", "content": "2 + 2?"}, turn])
    assert req.template_messages()[1] == {
        "role": "assistant",
        "content": "4",
        "reasoning": "2 + 2",
        "reasoning_content": "2 + 2",
    }
    old = decode([{"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}])
    assert old.template_messages()[0]["reasoning"] == "2 + 2"
    with pytest.raises(P.ProtocolError, match="reasoning and reasoning_content disagree"):
        decode([{"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"}])


def test_the_flag_and_the_config() -> None:
    def config(*argv: str) -> ServerConfig:
        args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--model", MODEL, *argv])
        return server_config_from_args(args)

    assert config("--reasoning-parser", "deepseek_r1").reasoning_parser == "deepseek_r1"
    assert config().reasoning_parser is None
    assert config("--responses-store-size", "7").responses_store_size == 7
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="granite")


# ------------------------------------------------------------------ end to end
# radixkv-tiny's format with what a thinking model's template adds: an assistant turn's
# reasoning shown in a block, and a generation prompt that opens one when asked to (as the
# templates of DeepSeek-R1 and Qwen3 -Thinking-2507 always do)
TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}<|end|>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if think %}<think>\n{% endif %}{% endif %}"
)
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    config = ServerConfig(reasoning_parser="qwen3", tool_call_parser="hermes")
    # one sampled token per step (the script below counts steps): no jump-forward
    with live_server(config, chat_template=TEMPLATE, guided_jump_forward=False) as s:
        yield s


@pytest.fixture
def client(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    with checked_client(server) as c:
        yield c


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[str, str, list[Any], Any]:
    """A streamed chat's reasoning, content, tool-call deltas and last finish reason."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    return reasoning, content, calls, chunks[-1].choices[0].finish_reason


def test_reasoning_then_content_and_tool_calls(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    reply = f"<think>\nThe user wants weather. <tool_call> comes next.\n</think>\n\nChecking.<tool_call>{CALL}</tool_call>"
    script_reply(st, monkeypatch, reply)
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=300)
    msg = r.choices[0].message
    # the tag inside the reasoning is not a call: calls are read from the content only
    assert msg.reasoning == "The user wants weather. <tool_call> comes next."  # type: ignore[attr-defined]
    assert msg.content == "Checking." and r.choices[0].finish_reason == "tool_calls"
    thought = reply[: reply.index("</think>") + len("</think>")]  # one token per byte
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == len(thought)
    (call,) = msg.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    script_reply(st, monkeypatch, reply)
    reasoning, content, calls, finish = _stream(client, messages=USER, tools=TOOLS, max_tokens=300)
    assert (reasoning, content, finish) == (msg.reasoning, "Checking.", "tool_calls")  # type: ignore[attr-defined]
    assert [c.function.name for c in calls] == ["get_weather"]
    script_reply(st, monkeypatch, reply)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=300,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == len(thought)

    # include_reasoning=false: the reasoning is generated and counted, not shown
    script_reply(st, monkeypatch, reply)
    r2 = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=300, extra_body={"include_reasoning": False}
    )
    assert getattr(r2.choices[0].message, "reasoning", None) is None
    assert r2.choices[0].message.content == f"Checking.<tool_call>{CALL}</tool_call>"
    assert r2.usage is not None and r2.usage.completion_tokens == r.usage.completion_tokens  # type: ignore[union-attr]


def test_a_reply_without_a_block_is_unchanged(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    script_reply(st, monkeypatch, "  Just an answer, <think> and all.\n")
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
    assert r.choices[0].message.content == "  Just an answer, <think> and all.\n"
    assert getattr(r.choices[0].message, "reasoning", None) is None
    script_reply(st, monkeypatch, "  Just an answer, <think> and all.\n")
    reasoning, content, _, _ = _stream(client, messages=USER, max_tokens=100)
    assert (reasoning, content) == ("", "  Just an answer, <think> and all.\n")


def test_a_prompt_that_opens_the_block(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generation prompt ends with ``<think>\\n``: the reply holds only the end tag; cut by
    ``max_tokens`` inside the block it is all reasoning."""
    _, st = server
    think = {"chat_template_kwargs": {"think": True}}
    reply = "Two and two.\n</think>\n\nFour."
    script_reply(st, monkeypatch, reply)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100, extra_body=think)
    assert r.choices[0].message.reasoning == "Two and two."  # type: ignore[attr-defined]
    assert r.choices[0].message.content == "Four."
    script_reply(st, monkeypatch, reply)
    assert _stream(client, messages=USER, max_tokens=100, extra_body=think)[:2] == (
        "Two and two.",
        "Four.",
    )
    script_reply(st, monkeypatch, reply)
    cut = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body=think)
    assert cut.choices[0].message.reasoning == "Two a"  # type: ignore[attr-defined]
    assert cut.choices[0].message.content is None and cut.choices[0].finish_reason == "length"
    # the same reply to a prompt that opens nothing is content
    script_reply(st, monkeypatch, reply)
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=100)
    assert plain.choices[0].message.content == reply


def test_structured_output_starts_after_the_block(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt that opens a block: the model reasons freely (text no JSON schema allows),
    and the content after the end tag is held to the schema."""
    _, st = server
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    extra = {"chat_template_kwargs": {"think": True}}
    script_reply(st, monkeypatch, 'It says Paris!\n</think>{"city": "Paris"} and more')
    r = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=100,
        response_format=fmt,
        extra_body=extra,  # type: ignore[arg-type]
    )
    msg = r.choices[0].message
    assert msg.reasoning == "It says Paris!"  # type: ignore[attr-defined]
    assert json.loads(msg.content or "") == {"city": "Paris"}
    assert r.choices[0].finish_reason == "stop"
    # without the block the schema holds from the first token: the script cannot write
    script_reply(st, monkeypatch, 'It says Paris!\n</think>\n{"city": "Paris"}')
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=100,
        response_format=fmt,  # type: ignore[arg-type]
    )
    assert getattr(r2.choices[0].message, "reasoning", None) is None
    assert set(json.loads(r2.choices[0].message.content or "")) == {"city"}


def test_a_turns_reasoning_goes_back_into_the_template(
    server: tuple[BackgroundServer, ServerState],
    client: openai.OpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, st = server
    script_reply(st, monkeypatch, "Fine.")
    turns = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning": "Look it up."}]
    follow = [*turns, {"role": "user", "content": "And tomorrow?"}]
    r = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=10)
    tok = st.engine.engine.tokenizer
    ids = encode_chat(tok, P.template_messages([P.ChatMessage(**m) for m in follow]))
    assert "<|assistant|><think>Look it up.</think>Sunny.<|end|>" in tok.decode(ids)
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
