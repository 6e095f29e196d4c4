"""Bad input on every endpoint, client disconnects, queue limits, and tenant isolation.

Every error must be OpenAI-shaped JSON, and the server must keep serving afterwards with its
engine clean (invariants hold, locks zero, pages conserved).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_helpers import (
    MODEL,
    assert_clean,
    failing_forward,
    in_loop,
    live_server,
    metric_values,
    wait_drained,
)

from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState

ADMIN = "admin-key-0123"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(ServerConfig(admin_key=ADMIN, max_body_bytes=32 * 1024)) as s:
        yield s


@pytest.fixture
def http(server: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, timeout=30) as c:
        yield c


def _assert_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


GOOD_CMPL = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD_BODIES: list[tuple[str, bytes, int]] = [
    ("/v1/completions", b"", 400),
    ("/v1/completions", b"{", 400),
    ("/v1/completions", b"\xff\xfe", 400),
    ("/v1/completions", b'"a string"', 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", json.dumps({**GOOD_CMPL, "n": "2"}).encode(), 400),
    ("/v1/completions", json.dumps({**GOOD_CMPL, "stop": [1]}).encode(), 400),
    ("/v1/completions", json.dumps({**GOOD_CMPL, "top_k": -5}).encode(), 400),
    (
        "/v1/completions",
        json.dumps({**GOOD_CMPL, "stream": True, "stream_options": {"include_usage": 1}}).encode(),
        400,
    ),
    ("/v1/completions", json.dumps({**GOOD_CMPL, "prompt": [[1, 2], []]}).encode(), 400),
    (
        "/v1/completions",
        json.dumps({**GOOD_CMPL, "prompt": [300]}).encode(),
        400,
    ),  # outside the vocabulary
    ("/v1/completions", json.dumps({**GOOD_CMPL, "model": "other"}).encode(), 404),
    ("/v1/chat/completions", b"null", 400),
    (
        "/v1/chat/completions",
        json.dumps({**GOOD_CHAT, "messages": [{"role": "tool", "content": "x"}]}).encode(),
        400,
    ),
    (
        "/v1/chat/completions",
        json.dumps({**GOOD_CHAT, "messages": [{"content": "x"}]}).encode(),
        400,
    ),
    ("/v1/chat/completions", json.dumps({**GOOD_CHAT, "temperature": "hot"}).encode(), 400),
    ("/v1/chat/completions", json.dumps({**GOOD_CHAT, "top_logprobs": 3}).encode(), 400),
    ("/v1/chat/completions", json.dumps({**GOOD_CHAT, "max_tokens": 20000}).encode(), 400),
    ("/v1/chat/completions", json.dumps({**GOOD_CHAT, "model": ""}).encode(), 404),
    ("/v1/completions", json.dumps({**GOOD_CMPL, "prompt": "p" * 40000}).encode(), 413),
    ("/v1/chat/completions", b"x" * 40000, 413),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_BODIES)
def test_bad_bodies(http: httpx.Client, path: str, body: bytes, status: int) -> None:
    _assert_error(
        http.post(path, content=body, headers={"content-type": "application/json"}), status
    )


def test_body_limit_without_content_length(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to check up front
        for _ in range(40):
            yield b"x" * 1024

    json_type = {"content-type": "application/json"}
    _assert_error(http.post("/v1/completions", content=chunks(), headers=json_type), 413)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/models/radixkv-tiny", 404),
        ("POST", "/health", 405),
        ("POST", "/metrics", 405),
        ("GET", "/reset_prefix_cache", 405),
        ("POST", "/reset_prefix_cache", 401),
        ("GET", "/nope", 404),
        ("POST", "/openapi.json", 405),
        ("POST", "/reset_prefix_cache/", 404),  # no redirect echoing the Host header
        ("POST", "/v1/completions/", 404),
        ("GET", "/v1/models/", 404),
    ],
)
def test_bad_methods_and_paths(http: httpx.Client, method: str, path: str, status: int) -> None:
    _assert_error(http.request(method, path), status)


def test_good_requests_still_served_after_errors(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    for path, body, _ in BAD_BODIES[:6]:
        http.post(path, content=body)
    assert http.post("/v1/completions", json=GOOD_CMPL).status_code == 200
    assert http.post("/v1/chat/completions", json=GOOD_CHAT).status_code == 200
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").status_code == 200
    values = metric_values(http.get("/metrics").text, MODEL)
    assert values['radixkv_http_errors_total{status="400"}'] >= 6
    assert_clean(server[1])


def test_stream_disconnect_aborts_and_releases(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = server[1]
    before = in_loop(st, st.engine.stats).num_aborted
    body = {
        **GOOD_CMPL,
        "prompt": "stream then leave " * 20,
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert all(line.startswith("data: ") or line == "" for line in got)
        assert st.in_flight == 1
    # the client is gone mid-generation: the request is aborted, its pages come back
    stats = wait_drained(st)
    assert stats.num_aborted == before + 1
    assert_clean(st)


def test_non_stream_disconnect_aborts(server: tuple[BackgroundServer, ServerState]) -> None:
    st = server[1]
    before = in_loop(st, st.engine.stats).num_aborted
    body = {**GOOD_CMPL, "max_tokens": 3000, "ignore_eos": True}
    with (
        httpx.Client(base_url=server[0].url, timeout=httpx.Timeout(30, read=0.5)) as c,
        pytest.raises(httpx.ReadTimeout),
    ):
        c.post("/v1/completions", json=body)
    stats = wait_drained(st)
    assert stats.num_aborted == before + 1
    assert_clean(st)


def test_queue_full_is_503_and_recovers() -> None:
    with (
        live_server(ServerConfig(max_queue=2)) as (srv, st),
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        # more sequences than could ever be admitted: a client error (retrying cannot help)
        err = _assert_error(c.post("/v1/completions", json={**GOOD_CMPL, "n": 3}), 400)
        assert err["param"] == "n" and "max_queue=2" in err["message"]
        long = {**GOOD_CMPL, "max_tokens": 3000, "ignore_eos": True, "n": 2, "stream": True}
        with c.stream("POST", "/v1/completions", json=long) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(lines)
            err = _assert_error(c.post("/v1/completions", json=GOOD_CMPL), 503)
            assert err["code"] == "queue_full"
            assert st.in_flight == 2
            next(lines)  # still streaming
        wait_drained(st)
        assert c.post("/v1/completions", json=GOOD_CMPL).status_code == 200
        assert_clean(st)


# ------------------------------------------------------------------------------ tenants

KEYS = {"key-alice-000": "alice", "key-bob-00000": "bob"}


def _ttft(client: openai.OpenAI, prompt: str, salt: str | None = None) -> tuple[float, int]:
    """Seconds to the end of a 1-token completion (= time to first token) and its cached tokens."""
    extra = {"cache_salt": salt} if salt else None
    t0 = time.perf_counter()
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra
    )
    dt = time.perf_counter() - t0
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return dt, int(r.usage.prompt_tokens_details.cached_tokens or 0)


def test_tenant_isolation_counts_and_timing() -> None:
    cfg = ServerConfig(api_keys=KEYS)
    with live_server(cfg) as (srv, st):
        kw: dict[str, Any] = dict(base_url=srv.url + "/v1", max_retries=0, timeout=60)
        alice = openai.OpenAI(api_key="key-alice-000", **kw)
        bob = openai.OpenAI(api_key="key-bob-00000", **kw)
        nobody = openai.OpenAI(api_key="key-wrong-000", **kw)
        try:
            with pytest.raises(openai.AuthenticationError):
                nobody.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            with pytest.raises(openai.AuthenticationError):
                nobody.models.list()
            n = 1000  # long enough that a prefill is clearly slower than a cache hit
            warm, hit, cross, cold = [], [], [], []
            for k in range(4):
                secret = f"{k:03d} alice secret " + "confidential " * (n // 13)
                other = f"{k:03d} bob cold one " + "unrelated!!! " * (n // 13)
                assert len(st.tokenizer.encode(secret)) == len(st.tokenizer.encode(other))
                t, c = _ttft(alice, secret)
                warm.append(t)
                assert c == 0
                t, c = _ttft(alice, secret)  # the same tenant repeating hits
                hit.append(t)
                assert c > n - 32
                t, c = _ttft(bob, secret)  # another tenant never sees it
                cross.append(t)
                assert c == 0
                t, c = _ttft(bob, other)
                cold.append(t)
                assert c == 0
                if k == 0:  # a salt only narrows: alice with a salt misses her own unsalted entry
                    assert _ttft(alice, secret, salt="s1")[1] == 0
                    assert _ttft(alice, secret, salt="s1")[1] > 0
            med = {
                name: statistics.median(v)
                for name, v in (("warm", warm), ("hit", hit), ("cross", cross), ("cold", cold))
            }
            print("tenant TTFT medians (s):", {k: round(v, 4) for k, v in med.items()})
            # the measurement can see a hit ...
            assert med["hit"] < 0.6 * med["cold"]
            # ... and bob's TTFT on alice's prompt looks like a cold prompt, not a hit
            assert med["cross"] > 0.6 * med["cold"]
            assert med["cross"] > 1.5 * med["hit"]
        finally:
            for c in (alice, bob, nobody):
                c.close()
        assert_clean(st)


def test_engine_failure_is_reported_and_server_recovers() -> None:
    with live_server() as (srv, st), httpx.Client(base_url=srv.url, timeout=30) as c:
        with failing_forward(st) as calls:
            err = _assert_error(c.post("/v1/completions", json=GOOD_CMPL), 500)
            assert "injected" in err["message"] and err["type"] == "server_error"
            # a failure after the stream started arrives as an error event, then [DONE]
            calls["n"], calls["fail_at"] = 0, 3
            body = {**GOOD_CMPL, "max_tokens": 50, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            assert "injected" in json.loads(data[-2])["error"]["message"]
        assert c.post("/v1/completions", json=GOOD_CMPL).status_code == 200
        assert_clean(st)
