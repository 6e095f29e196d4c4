"""Shared helpers for the server tests: a live server on 127.0.0.1 and calls into its loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from engine_helpers import scripted_sampler

import radixkv.engine.engine as engine_mod
from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

MODEL = "radixkv-tiny"
# radixkv-tiny's format, plus tool calls and results and an assistant turn's reasoning (for
# servers with a hermes tool-call parser and a qwen3 reasoning parser), and a reply that
# reasons and then calls the weather tool
TOOL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>\n'
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}<|end|>\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
THOUGHT = "<think>\nWeather needs a tool.\n</think>\n\n"
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@contextmanager
def live_server(
    config: ServerConfig | None = None, **engine_kwargs: Any
) -> Iterator[tuple[BackgroundServer, ServerState]]:
    """A radixkv-tiny server on a free loopback port; its engine is shut down with it."""
    engine = AsyncEngine(MODEL, **{"num_pages": 2048, **engine_kwargs})
    app = build_app(engine, config or ServerConfig(), owns_engine=True)
    with BackgroundServer(app) as srv:
        yield srv, app.state.radixkv


def in_loop(st: ServerState, fn: Callable[[], Awaitable[Any]], timeout: float = 30) -> Any:
    """Run ``fn()`` in the server's event loop (where the AsyncEngine lives) and wait for it."""
    assert st.loop is not None

    async def call() -> Any:
        return await fn()

    return asyncio.run_coroutine_threadsafe(call(), st.loop).result(timeout)


def wait_drained(st: ServerState, timeout: float = 20) -> Any:
    """Until the server and its engine hold no request; returns the final engine stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = in_loop(st, st.engine.stats)
        if st.in_flight == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained: in_flight={st.in_flight} stats={stats}")
        time.sleep(0.02)


def assert_clean(st: ServerState) -> None:
    """Engine invariants hold, every lock count is zero and no private page remains."""
    wait_drained(st)
    in_loop(st, st.engine.check_invariants)
    core = st.engine.engine
    for node in core.cache.iter_nodes():
        assert node.lock_ref == 0 or node.parent is None, f"lock_ref {node.lock_ref} after drain"
    assert core.pool.num_free + core.cache.num_cached_pages == core.pool.num_pages


@contextmanager
def checked_http(server: tuple[BackgroundServer, ServerState]) -> Iterator[Any]:
    """An ``httpx`` client of the live server; on exit the server must be clean
    (:func:`assert_clean`)."""
    import httpx

    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c
    assert_clean(server[1])


@contextmanager
def checked_client(server: tuple[BackgroundServer, ServerState]) -> Iterator[Any]:
    """An ``openai`` client of the live server (no retries); on exit, after the test's
    requests, the server must be clean (:func:`assert_clean`)."""
    import openai

    srv, st = server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield c
    finally:
        c.close()
    assert_clean(st)


def metric_values(text: str, model_name: str | None = None) -> dict[str, float]:
    """A Prometheus text page as ``{'name{label="v",...}': value}`` with the ``model_name`` label
    left out of the key (every sample must carry it, equal to ``model_name`` when given)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            name = labels.pop("model_name", None)
            assert name is not None, f"{sample.name} has no model_name label"
            assert model_name is None or name == model_name, (sample, model_name)
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[sample.name + (f"{{{inner}}}" if inner else "")] = sample.value
    return out


def script_reply(st: ServerState, monkeypatch: pytest.MonkeyPatch, reply: str) -> list[int]:
    """The server's model scripted to write ``reply`` and then EOS (radixkv-tiny would not
    write tags or calls by itself), one request at a time; returns the reply's tokens."""
    core = st.engine.engine
    ids = core.tokenizer.encode(reply, add_special_tokens=False)
    monkeypatch.setattr(engine_mod, "sample", scripted_sampler([*ids, min(core.eos_token_ids)]))
    return ids


@contextmanager
def failing_forward(st: ServerState, fail_at: int = 1) -> Iterator[dict[str, int]]:
    """The engine's forward raises ``RuntimeError("injected forward failure")`` on its
    ``fail_at``-th call from now; the yielded dict (``n``: calls so far, ``fail_at``) can be
    reset to inject another. The real forward is back afterwards."""
    runner = st.engine.engine.runner
    real_forward = runner.forward
    calls = {"n": 0, "fail_at": fail_at}

    def flaky_forward(*a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected forward failure")
        return real_forward(*a, **kw)

    runner.forward = flaky_forward
    try:
        yield calls
    finally:
        runner.forward = real_forward
