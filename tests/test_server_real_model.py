"""The OpenAI-compatible server on the real model, SmolLM2-135M-Instruct (the packaged GGUF),
through the ``openai`` client: chat completions rendered with the model's own ChatML template,
streamed and not, cached tokens reported as a conversation and a shared system prompt come
back, and a tool call the model writes read by the hermes parser (SmolLM2 writes its calls as
a JSON array inside ``<tool_call>``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from real_model_helpers import SYSTEM, smollm2

from radixkv.engine.async_engine import AsyncEngine
from radixkv.model.tokenizer import encode_chat
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig

MODEL = "smollm2-135m-instruct"
PAGE = 16
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]  # fmt: skip
# SmolLM2's function-calling system prompt (its model card's), the tools listed in it: the
# chat template has no tools section of its own
TOOL_SYSTEM = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls "
    "to achieve the purpose.\n\nYou have access to the following tools:\n<tools>"
    + json.dumps([t["function"] for t in TOOLS])
    + "</tools>\n\nThe output MUST strictly adhere to the following format, and NO other text "
    'MUST be included.\n<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": '
    '"value1"}},\n... (more tool calls as required)\n]</tool_call>'
)

EXAMPLE_CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Berlin"}}]</tool_call>'


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(smollm2(), page_size=PAGE, num_pages=1024)
    app = build_app(engine, ServerConfig(tool_call_parser="hermes"), owns_engine=True)
    with BackgroundServer(app) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield c
        c.close()


def test_chat_streaming_and_cached_tokens(client: openai.OpenAI) -> None:
    msgs: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    ids = encode_chat(smollm2().tokenizer, msgs)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    answer = r.choices[0].message.content or ""
    assert "Paris" in answer
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    # the same request streamed: the same text, its whole pages now served from the cache
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == len(ids) // PAGE * PAGE
    # the next turn: the first turn's prompt and answer are cached
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And Spain?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids) // PAGE * PAGE
    assert r2.choices[0].message.content


def test_tool_call_the_model_writes(client: openai.OpenAI) -> None:
    """After one example turn, SmolLM2-135M-Instruct answers a weather question with
    ``<tool_call>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]</tool_call>``
    (greedy): returned as a tool call, not as text."""
    msgs: list[Any] = [
        {"role": "system", "content": TOOL_SYSTEM},
        {"role": "user", "content": "What is the weather in Berlin?"},
        {"role": "assistant", "content": EXAMPLE_CALL},
        {"role": "user", "content": "What is the weather in Tokyo?"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=TOOLS, max_tokens=40, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Tokyo"})
    ]
    assert not choice.message.content
