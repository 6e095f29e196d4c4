"""What a hostile or careless client does below the API: bodies nested thousands deep, bodies
that are not JSON by type, foreign Host headers (DNS rebinding), requests sent halfway, and a
bug in a route. Each is a clean error in the route's own shape, logged at most once, and the
keep-alive connection stays usable (issue 47, findings 3 and 8)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, assert_clean, live_server

from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.hosts import HostCheck, host_name
from radixkv.server.state import ServerState

KEY = "transport-key-01"
DEEP = b'{"model": "radixkv-tiny", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"  # ~2 KB


class Errors(logging.Handler):
    """ERROR records of every logger (uvicorn's "Exception in ASGI application" included)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: dict[int, logging.LogRecord] = {}  # by id: a record can reach two loggers
        self.loggers = [logging.getLogger(n) for n in ("", "radixkv", "uvicorn", "uvicorn.error")]

    @property
    def records(self) -> list[logging.LogRecord]:
        return list(self.seen.values())

    def emit(self, record: logging.LogRecord) -> None:
        self.seen[id(record)] = record

    def __enter__(self) -> Errors:
        for lg in self.loggers:
            lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for lg in self.loggers:
            lg.removeHandler(self)

    def tracebacks(self) -> int:
        return sum(r.exc_info is not None for r in self.records)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(ServerConfig(default_max_tokens=2)) as s:
        yield s


def _connection(r: httpx.Response) -> Any:
    """The client side (address, port) of the connection a response came on."""
    return r.extensions["network_stream"].get_extra_info("client_addr")


def openai_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def anthropic_error(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def native_error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert err["code"] == r.status_code  # SGLang's shape: code is the HTTP status
    return err


# every JSON POST route, how its errors look, and a good body to follow up with
ROUTES: list[tuple[str, Any, dict[str, Any]]] = [
    ("/v1/completions", openai_error, {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    (
        "/v1/chat/completions",
        openai_error,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    ),
    ("/v1/responses", openai_error, {"model": MODEL, "input": "hi", "max_output_tokens": 1}),
    ("/tokenize", openai_error, {"model": MODEL, "prompt": "hi"}),
    ("/detokenize", openai_error, {"model": MODEL, "tokens": [5, 6]}),
    (
        "/v1/score",
        openai_error,
        {"model": MODEL, "query": "a", "items": ["b"], "label_token_ids": [5]},
    ),
    (
        "/v1/messages",
        anthropic_error,
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    ),
    (
        "/v1/messages/count_tokens",
        anthropic_error,
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ),
    ("/generate", native_error, {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
]
JSON = {"content-type": "application/json"}


# ------------------------------------------------------------------ nesting and parse errors


@pytest.mark.parametrize(("path", "shape", "good"), ROUTES, ids=[r[0] for r in ROUTES])
def test_deep_nesting_is_a_400_in_the_routes_shape_and_the_connection_lives(
    server: tuple[BackgroundServer, ServerState], path: str, shape: Any, good: dict[str, Any]
) -> None:
    """Before: 500 RecursionError (OpenAI-shaped on /v1/messages too), two tracebacks, and the
    connection reset under the next pooled request."""
    srv, _ = server
    with Errors() as logs, httpx.Client(base_url=srv.url, timeout=60) as c:
        for body in (DEEP, b'{"model": ' + b"{" * 5000, b"\xff{"):  # deep, deep and cut, bad
            r = c.post(path, content=body, headers=JSON)
            assert r.status_code == 400, r.text
            assert "connection" not in r.headers  # not "close"
            assert "Invalid JSON body" in shape(r)["message"]
            first = _connection(r)
            ok = c.post(path, json=good)  # the same keep-alive connection serves the next one
            assert ok.status_code == 200, ok.text
            assert _connection(ok) == first
    assert logs.records == []


def test_json_depth_is_exact_on_valid_json() -> None:
    cases: list[Any] = [1, "[[[", [], [[["{"]]], {"a": [{"b": ']]]\\"'}]}, [[1], [[2]], 3]]
    for value in cases:
        text = json.dumps(value).encode()

        def depth(v: Any) -> int:
            if isinstance(v, list):
                return 1 + max(map(depth, v), default=0)
            if isinstance(v, dict):
                return 1 + max(map(depth, v.values()), default=0)
            return 0

        assert P.json_depth(text) == depth(value), text
    at_limit = {"model": "m", "prompt": "x", "logit_bias": None}
    body = json.dumps(at_limit).encode()[:-1] + b', "x": ' + b"[" * 127 + b"]" * 127 + b"}"
    assert P.json_depth(body) == P.MAX_JSON_DEPTH  # still decoded: the limit is inclusive
    P.decode_request(body, P.CompletionRequest)
    with pytest.raises(P.ProtocolError, match="nested 129 levels deep; the limit is 128"):
        P.decode_request(body.replace(b"[", b"[[", 1).replace(b"]", b"]]", 1), P.CompletionRequest)


def test_a_bug_in_a_route_is_one_traceback_and_keeps_the_connection(
    server: tuple[BackgroundServer, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception is a 500 naming its type, logged once with its traceback; the
    keep-alive connection serves the next request (Starlette re-raises it to uvicorn, which
    logged it again and reset the connection)."""
    srv, st = server

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("injected detokenizer bug")

    with Errors() as logs, httpx.Client(base_url=srv.url, timeout=60) as c:
        with monkeypatch.context() as m:
            m.setattr(st.tokenizer, "decode", broken)
            r = c.post("/detokenize", json={"model": MODEL, "tokens": [5]})
        assert r.status_code == 500
        assert openai_error(r)["message"] == "Internal server error: RuntimeError"
        ok = c.post("/detokenize", json={"model": MODEL, "tokens": [5]})
        assert ok.status_code == 200 and _connection(ok) == _connection(r)
    assert logs.tracebacks() == 1 and len(logs.records) == 1
    assert_clean(st)


# ------------------------------------------------------------------ content type


@pytest.mark.parametrize(("path", "shape", "good"), ROUTES, ids=[r[0] for r in ROUTES])
def test_json_routes_need_a_json_content_type(
    server: tuple[BackgroundServer, ServerState], path: str, shape: Any, good: dict[str, Any]
) -> None:
    """A web page can send text/plain, a form, or an untyped body to any origin without the
    server's consent; JSON it cannot. Before: all three were served."""
    srv, st = server
    body = json.dumps(good).encode()
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
            r = c.post(path, content=body, headers={"content-type": ctype})
            assert r.status_code == 415, r.text
            assert ctype in shape(r)["message"]
        r = c.post(path, content=body)  # no Content-Type at all
        assert r.status_code == 415 and "none" in shape(r)["message"]
        for ctype in ("application/json; charset=utf-8", "application/vnd.api+json"):
            assert c.post(path, content=body, headers={"content-type": ctype}).status_code == 200
    assert_clean(st)


# ------------------------------------------------------------------ Host header


def test_host_names() -> None:
    assert host_name("LocalHost:8000") == "localhost"
    assert host_name("[::1]:8000") == "::1" and host_name("::1") == "::1"
    assert host_name("example.com.") == "example.com" and host_name("10.0.0.1") == "10.0.0.1"


def test_a_keyless_server_answers_only_its_own_host_names() -> None:
    """DNS rebinding: a page on evil.example re-resolved to 127.0.0.1 sends Host:
    evil.example. Before: served."""
    config = ServerConfig(allowed_hosts=("models.internal",), default_max_tokens=1)
    with live_server(config) as (srv, _), httpx.Client(timeout=60) as c:
        url = srv.url + "/v1/chat/completions"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for host in ("evil.example", f"evil.example:{srv.port}", "127.0.0.1.evil.example"):
            r = c.post(url, json=chat, headers={"Host": host})
            assert r.status_code == 400 and openai_error(r)["code"] == "invalid_host", host
            assert c.get(srv.url + "/health", headers={"Host": host}).status_code == 400
        r = c.post(srv.url + "/v1/messages", json={}, headers={"Host": "evil.example"})
        assert r.status_code == 400 and "allowed-hosts" in anthropic_error(r)["message"]
        r = c.post(srv.url + "/generate", json={}, headers={"Host": "evil.example"})
        assert r.status_code == 400 and "DNS rebinding" in native_error(r)["message"]
        for host in (f"127.0.0.1:{srv.port}", "localhost", f"LOCALHOST:{srv.port}", "[::1]:80",
                     "models.internal:8000"):  # fmt: skip
            assert c.post(url, json=chat, headers={"Host": host}).status_code == 200, host
    with live_server(ServerConfig(api_keys={KEY: "t"})) as (srv, _), httpx.Client() as c:
        r = c.get(
            srv.url + "/v1/models",
            headers={"Host": "evil.example", "Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 200  # with keys the page cannot get in anyway
    with live_server(ServerConfig(allowed_hosts=("*",))) as (srv, _), httpx.Client() as c:
        assert c.get(srv.url + "/v1/models", headers={"Host": "any.example"}).status_code == 200


def test_the_address_a_request_came_in_on_is_allowed() -> None:
    """A server bound to every interface is reached at the address of one: the connection's
    local address (ASGI's ``server``) is allowed, other addresses are not."""
    check = HostCheck(None, allowed_hosts=(), active=lambda: True, reject=lambda p, e: e.response())  # type: ignore[arg-type]
    assert check.allows("10.1.2.3:8000", ("10.1.2.3", 8000))
    assert not check.allows("10.1.2.4:8000", ("10.1.2.3", 8000))
    assert check.allows("[fe80::1]:8000", ("fe80::1", 8000))
    assert not check.allows("fe80::1.evil.example", ("fe80::1", 8000))


# ------------------------------------------------------------------ read timeouts


def _read_all(s: socket.socket, limit: float) -> bytes:
    s.settimeout(limit)
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit} s: {out!r}") from None
    return out


def test_half_sent_requests_time_out() -> None:
    """Before: 300 of 300 half-sent requests were still open after 70 s."""
    config = ServerConfig(header_timeout_s=0.5, body_timeout_s=0.5)
    with live_server(config) as (srv, st):
        addr = (srv.host, srv.port)
        t0 = time.monotonic()
        with socket.create_connection(addr) as s:  # headers never finished
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
            reply = _read_all(s, 10)
        assert reply.startswith(b"HTTP/1.1 408 ") and 0.4 < time.monotonic() - t0 < 5
        with socket.create_connection(addr) as s:  # opened, nothing sent: closed silently
            assert _read_all(s, 10) == b""
        t0 = time.monotonic()
        with socket.create_connection(addr) as s:  # the body never finished
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            reply = _read_all(s, 10)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"connection: close" in reply.lower()
        assert b"Request body not received within 0.5 s" in reply
        assert time.monotonic() - t0 < 5
        # a keep-alive connection between requests, and an answer slower than both
        # deadlines, are not cut
        real_stats = st.engine.stats

        async def slow_stats() -> Any:
            await asyncio.sleep(1.2)
            return await real_stats()

        with httpx.Client(base_url=srv.url, timeout=60) as c:
            first = c.get("/health")
            time.sleep(0.3)
            st.engine.stats = slow_stats  # type: ignore[method-assign]
            try:
                r = c.get("/health")
            finally:
                del st.engine.stats
            assert r.status_code == 200 and _connection(r) == _connection(first)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and _connection(r) == _connection(first)
        assert_clean(st)
