"""The OpenAI API as real clients send it, through the real ``openai`` client on a live server:
nulls, neutral values, unknown fields (ignored with one warning per name, or 400 with
``strict_api``), ``min_p``, and logprobs for completions and chat, streamed and not, equal to
``log_softmax`` of transformers' logits for the same tokens."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from _model_hf_builders import hf_logits
from engine_helpers import make_small_llama
from server_helpers import assert_clean

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import protocol as P
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

MODEL = "small-llama"
ATOL = 1e-4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-server"))


def _serve(lm: Any, **config: Any) -> tuple[BackgroundServer, ServerState]:
    engine = AsyncEngine(lm, page_size=4, num_pages=600)
    app = build_app(engine, ServerConfig(model_name=MODEL, **config), owns_engine=True)
    return BackgroundServer(app).start(), app.state.radixkv


@pytest.fixture(scope="module")
def server(small: tuple[Any, Any]) -> Iterator[tuple[BackgroundServer, ServerState]]:
    srv, st = _serve(small[1])
    yield srv, st
    srv.stop()


class Bodies:
    """Records the JSON bodies the openai client really sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.content:
            self.sent.append(json.loads(request.content))


@pytest.fixture(scope="module")
def bodies() -> Bodies:
    return Bodies()


@pytest.fixture(scope="module")
def client(server: tuple[BackgroundServer, ServerState], bodies: Bodies) -> Iterator[openai.OpenAI]:
    http = httpx.Client(event_hooks={"request": [bodies]}, timeout=60)
    c = openai.OpenAI(
        base_url=server[0].url + "/v1", api_key="unused", max_retries=0, http_client=http
    )
    yield c
    c.close()


def _reference(hf: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    logits = hf_logits(hf, prompt + out)
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(out) - 1], dim=-1)


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


PROMPT = list(range(40, 77))


# ------------------------------------------------------------------ what clients send


def test_nulls_and_neutral_values(client: openai.OpenAI, bodies: Bodies) -> None:
    bodies.sent.clear()
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=4,
        temperature=None,
        top_p=None,
        n=None,
        seed=None,
        stop=None,
        user=None,
        logprobs=False,
        top_logprobs=None,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        extra_body={"top_k": None, "min_p": 0},
    )
    sent = bodies.sent[-1]
    assert sent["temperature"] is None and sent["logprobs"] is False  # really sent that way
    assert sent["response_format"] == {"type": "text"} and sent["top_k"] is None
    assert r.choices[0].logprobs is None and r.usage is not None
    assert r.usage.completion_tokens <= 4
    c = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=None, echo=False, best_of=1, suffix=None
    )
    assert c.choices[0].logprobs is None and c.usage is not None


def test_unknown_fields_warn_once_per_name(client: openai.OpenAI) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("radixkv.server")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            r = client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=2,
                extra_body={"compat_field_a": 1, "compat_field_b": {"x": None}},
            )
            assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        logger.removeHandler(handler)
    warned = [rec.getMessage() for rec in records if rec.levelno == logging.WARNING]
    assert sum("compat_field_a" in m for m in warned) == 1, warned
    assert sum("compat_field_b" in m for m in warned) == 1, warned


def test_strict_api_rejects_unknown_fields(small: tuple[Any, Any]) -> None:
    srv, st = _serve(small[1], strict_api=True)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"compat_field_a": 1}
            )
        err = e.value.response.json()["error"]
        assert err["param"] == "compat_field_a" and "--strict-api" in err["message"]
        # nulls and neutral values are still fine
        r = c.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, temperature=None, logprobs=None
        )
        assert r.usage is not None and 1 <= r.usage.completion_tokens <= 2
        assert_clean(st)
    finally:
        srv.stop()


def test_min_p_one_is_greedy(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=8, seed=3)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    for seed in range(3):
        r = client.completions.create(
            **{**kw, "seed": seed}, temperature=1.5, extra_body={"min_p": 1.0}
        )
        assert r.choices[0].text == greedy
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**kw, extra_body={"min_p": 1.5})


# ------------------------------------------------------------------ logprobs


def test_completion_logprobs_equal_transformers(
    small: tuple[Any, Any], client: openai.OpenAI
) -> None:
    hf, _ = small
    kw: dict[str, Any] = dict(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=7,
        temperature=0,
        logprobs=3,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    out = _ids(lp.tokens)
    assert len(out) == 7 and r.usage is not None and r.usage.completion_tokens == 7
    ref = _reference(hf, PROMPT, out)
    assert lp.top_logprobs is not None and lp.text_offset is not None
    for j, tok in enumerate(out):
        assert abs(lp.token_logprobs[j] - ref[j, tok].item()) <= ATOL
        assert int(ref[j].argmax()) == tok  # greedy
        top = lp.top_logprobs[j]
        assert _ids(list(top)) == ref[j].topk(3).indices.tolist()
        for t, v in zip(_ids(list(top)), top.values()):
            assert abs(v - ref[j, t].item()) <= ATOL
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    # streamed (with usage): the chunks' logprobs, concatenated, are the same
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    tokens: list[str] = []
    values: list[float] = []
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
        if chunk.usage is not None:
            usage = chunk.usage
    assert tokens == lp.tokens and values == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert usage is not None and usage.completion_tokens == 7


def test_completion_logprobs_n2_and_text_tokens(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, seed=1, logprobs=0)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.tokens is not None
        assert c.logprobs.top_logprobs is not None
        assert all(len(t) == 1 for t in c.logprobs.top_logprobs)  # the sampled token only
        assert all(not t.startswith("token_id:") for t in c.logprobs.tokens)
        assert all(v <= 0 for v in c.logprobs.token_logprobs or [])


def _chat_ids(st: ServerState, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids the server itself renders for ``messages``."""
    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    return st.chat_ids(P.decode_request(body, P.ChatCompletionRequest))


def test_chat_logprobs_equal_transformers_streamed_and_not(
    small: tuple[Any, Any], server: tuple[BackgroundServer, ServerState], client: openai.OpenAI
) -> None:
    hf, _ = small
    messages = [{"role": "user", "content": "Pages of keys and values are shared"}]
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    as_ids = client.chat.completions.create(
        **{**kw, "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True}}
    )
    content = as_ids.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    out = _ids([t.token for t in content])
    ref = _reference(hf, _chat_ids(server[1], messages), out)
    for j, (tok, t) in enumerate(zip(out, content)):
        assert abs(t.logprob - ref[j, tok].item()) <= ATOL
        assert len(t.top_logprobs) == 2
        assert _ids([a.token for a in t.top_logprobs]) == ref[j].topk(2).indices.tolist()
        for a in t.top_logprobs:
            assert abs(a.logprob - ref[j, int(a.token[9:])].item()) <= ATOL

    r = client.chat.completions.create(**kw)
    whole = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert whole is not None
    assert [t.logprob for t in whole] == pytest.approx([t.logprob for t in content], abs=ATOL)
    for t in whole:
        assert t.bytes == list(t.token.encode())
    streamed: list[Any] = []
    usage = None
    for chunk in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [
        [a.token for a in t.top_logprobs] for t in whole
    ]
    assert usage is not None and usage.completion_tokens == 6
    assert_clean(server[1])
