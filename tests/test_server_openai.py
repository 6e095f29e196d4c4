"""The real ``openai`` client against a live radixkv server on 127.0.0.1.

Completions, chat, streaming, n > 1, seeds, stop strings, cached_tokens rising on a repeated
prefix, the cache headers, metrics, admin reset, and every error the client can provoke.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import MODEL, assert_clean, live_server, metric_values

from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

ADMIN = "admin-key-0123"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(ServerConfig(admin_key=ADMIN, max_body_bytes=BODY_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _doc(i: int, n: int = 400) -> str:
    """A prompt of n bytes (= n tokens with the byte tokenizer) whose first page is unique to i."""
    head = f"document {i:05d}: "
    return (head + "the quick brown fox jumps over the lazy dog. " * (n // 40 + 1))[:n]


def test_models_and_health(
    server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(server[0].url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_completion_usage_and_cached_tokens_rise(
    server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    page = server[1].engine.engine.page_size
    base = _doc(1, 300)
    seen: list[int] = []
    texts = []
    for extra in ("", " and more", " and more and even more text"):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=base + extra, max_tokens=6, temperature=0
        )
        r = raw.parse()
        u = r.usage
        assert u is not None and u.prompt_tokens_details is not None
        cached = u.prompt_tokens_details.cached_tokens
        assert cached is not None
        assert raw.headers["x-cached-tokens"] == str(cached)
        assert raw.headers["x-cache-hit"] == ("true" if cached else "false")
        assert u.prompt_tokens == len(server[1].tokenizer.encode(base + extra))
        assert u.completion_tokens == 6 and u.total_tokens == u.prompt_tokens + 6
        assert cached % page == 0 and cached <= u.prompt_tokens - 1
        assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
        seen.append(cached)
        texts.append(r.choices[0].text)
    assert seen[0] == 0
    assert seen[1] >= (300 // page) * page  # the whole first prompt's full pages
    assert seen[2] > seen[1]
    # cache hit or miss, greedy output is the same
    again = client.completions.create(model=MODEL, prompt=base, max_tokens=6, temperature=0)
    assert again.choices[0].text == texts[0]
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[union-attr]


def test_chat_uses_template_and_multiturn_hits(
    server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    tok = server[1].tokenizer
    msgs: list[Any] = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Tell me about prefix caching, please. " * 4},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    expected = tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
    )
    assert r.usage is not None and r.usage.prompt_tokens == len(expected)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    answer = r.choices[0].message.content or ""
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=5, temperature=0
    )
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    # turn 2 hits the whole first turn's prompt (minus the partial page)
    page = server[1].engine.engine.page_size
    assert r2.usage.prompt_tokens_details.cached_tokens >= (len(expected) // page) * page


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    prompt = _doc(2, 200)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, usage = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.finish_reason:
                finishes.append(c.finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == full.choices[0].text
    assert finishes == ["length"]
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_chat_n2_with_usage(client: openai.OpenAI) -> None:
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream two answers"}],
        max_tokens=7,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    ) as raw:
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert raw.headers["x-cache-hit"] in ("true", "false")
        lines = [line for line in raw.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    texts = {0: "", 1: ""}
    finish: dict[int, str] = {}
    roles = set()
    for ch in chunks:
        assert ch["object"] == "chat.completion.chunk"
        for c in ch["choices"]:
            if c["delta"].get("role"):
                roles.add(c["index"])
            texts[c["index"]] += c["delta"].get("content") or ""
            if c["finish_reason"]:
                assert c["index"] not in finish
                finish[c["index"]] = c["finish_reason"]
    assert roles == {0, 1} and finish == {0: "length", 1: "length"}
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 14
    assert "cached_tokens" in last["usage"]["prompt_tokens_details"]


def test_n_samples_and_seed_reproducible(
    server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=_doc(3, 64), max_tokens=8, temperature=1.0, n=3, seed=11
    )
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage is not None and a.usage.completion_tokens == 24
    # several prompts x n: index = prompt * n + sample
    m = client.completions.create(model=MODEL, prompt=[_doc(4, 40), _doc(5, 40)], max_tokens=3, n=2)
    assert sorted(c.index for c in m.choices) == [0, 1, 2, 3]
    n_prompt = sum(len(server[1].tokenizer.encode(p)) for p in (_doc(4, 40), _doc(5, 40)))
    assert (
        m.usage is not None
        and m.usage.prompt_tokens == n_prompt
        and m.usage.completion_tokens == 12
    )


def test_stop_string(client: openai.OpenAI) -> None:
    prompt = _doc(6, 100)
    full = (
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    assert len(full) >= 4
    stop = full[2:4]
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop matched
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=["@@", stop],
        extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    last = [c for c in streamed if c.choices][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert plain.choices[0].model_extra["stop_reason"] is None  # length: no stop matched


def _err(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, None),
        ({"temperature": -1}, None),
        ({"top_p": 0}, None),
        ({"n": 0}, None),
        ({"extra_body": {"logprobs": 99}}, "logprobs"),
        ({"extra_body": {"response_format": {"type": "grammar"}}}, "response_format"),
        ({"extra_body": {"max_tokens": "ten"}}, "max_tokens"),
        ({"prompt": ""}, None),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": "x" * 16380, "max_tokens": 16}, "prompt"),
    ],
)
def test_completion_errors_are_openai_400(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str | None
) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    err = _err(e.value)
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_context_length_and_model_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * 16380, max_tokens=16)
    assert _err(e.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "z" * 17000}]
        )
    assert _err(e.value)["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e2:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert _err(e2.value)["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as e3:
        client.completions.create(model=MODEL, prompt="w" * (BODY_LIMIT + 10), max_tokens=2)
    assert e3.value.status_code == 413
    _err(e3.value)


def test_metrics_after_traffic(
    server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    client.completions.create(model=MODEL, prompt=_doc(7, 100), max_tokens=2)
    client.completions.create(model=MODEL, prompt=_doc(7, 100), max_tokens=2)
    r = httpx.get(server[0].url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = metric_values(r.text, MODEL)
    for name in (
        "radixkv_prefix_cache_queries_tokens_total",
        "radixkv_prefix_cache_hits_tokens_total",
        "radixkv_prefix_cache_hit_rate",
        "radixkv_kv_pages_used",
        "radixkv_kv_pages_total",
        "radixkv_prefix_cache_evicted_pages_total",
        "radixkv_num_requests_running",
        "radixkv_num_requests_waiting",
        "radixkv_time_to_first_token_seconds_count",
        "radixkv_time_per_output_token_seconds_count",
        'radixkv_requests_total{finish_reason="length"}',
    ):
        assert name in values, name
    assert values["radixkv_prefix_cache_hits_tokens_total"] > 0
    assert 0 < values["radixkv_prefix_cache_hit_rate"] < 1
    assert values["radixkv_kv_pages_total"] == server[1].engine.engine.pool.num_pages
    assert values["radixkv_time_to_first_token_seconds_count"] >= 2


def test_admin_reset(server: tuple[BackgroundServer, ServerState], client: openai.OpenAI) -> None:
    url = server[0].url + "/reset_prefix_cache"
    prompt = _doc(8, 200)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": ADMIN}):
        r = httpx.post(url, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url).status_code == 405
    r = httpx.post(url, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert_clean(server[1])


def test_admin_disabled_without_key() -> None:
    with live_server() as (srv, _):
        r = httpx.post(
            srv.url + "/reset_prefix_cache", headers={"Authorization": "Bearer anything-at-all"}
        )
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
