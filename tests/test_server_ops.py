"""Operating the server: the metrics operators look for (every series labelled with model_name;
docs/serving.md maps them to vLLM's and SGLang's), clients that vanish while sending a body,
no trailing-slash redirects, API keys revoked without a restart (file change, a second's
recheck, or SIGHUP) and closed when the key file breaks, and ``metrics_require_key``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import assert_clean, in_loop, live_server, metric_values, wait_drained

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import auth as auth_mod
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.cli import install_sighup_reload
from radixkv.server.config import ServerConfig
from radixkv.server.protocol import CompletionRequest
from radixkv.server.state import MAX_WARNED_FIELDS

NAME = "tiny-ops"


class Records(logging.Handler):
    """Collects the records of the loggers it is attached to."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._loggers = [logging.getLogger(n) for n in names]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        for lg in self._loggers:
            lg.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for lg in self._loggers:
            lg.removeHandler(self)

    def errors(self) -> list[str]:
        return [
            r.getMessage() + (" (with traceback)" if r.exc_info else "")
            for r in self.records
            if r.levelno >= logging.ERROR
        ]


def _scrape(url: str, **kw: Any) -> dict[str, float]:
    r = httpx.get(url + "/metrics", **kw)
    assert r.status_code == 200, r.text
    return metric_values(r.text, NAME)


# ------------------------------------------------------------------ metrics


def test_metrics_pages_aborts_preemptions_queue_time() -> None:
    # 24 pages of 16 tokens: two streams of 160 + 200 tokens cannot both fit, so one is preempted
    config = ServerConfig(model_name=NAME)
    with live_server(config, num_pages=24, page_size=16) as (srv, st):
        body = {"model": NAME, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(base_url=srv.url, timeout=60) as a,
            httpx.Client(base_url=srv.url, timeout=60) as b,
        ):
            with (
                a.stream("POST", "/v1/completions", json={**body, "prompt": "a" * 160}) as ra,
                b.stream("POST", "/v1/completions", json={**body, "prompt": "b" * 160}) as rb,
            ):
                la, lb = ra.iter_lines(), rb.iter_lines()
                next(la), next(lb)
                during = _scrape(srv.url)
                assert during["radixkv_kv_pages_locked"] > 0  # the prompts' cached pages
                assert during["radixkv_kv_pages_private"] > 0  # their partial last pages
                assert during["radixkv_num_requests_running"] >= 1
                deadline = time.monotonic() + 60
                while in_loop(st, st.engine.stats).num_preemptions == 0:
                    assert time.monotonic() < deadline, "no preemption happened"
                    next(la)
                # leave b mid-stream: its request is aborted
            stats = wait_drained(st)
        after = _scrape(srv.url)
        assert after["radixkv_num_preemptions_total"] == stats.num_preemptions > 0
        assert after["radixkv_num_aborted_requests_total"] == stats.num_aborted >= 1
        assert after['radixkv_client_closed_requests_total{phase="streaming"}'] >= 1
        assert after["radixkv_kv_pages_locked"] == 0 and after["radixkv_kv_pages_private"] == 0
        ok = httpx.post(
            srv.url + "/v1/completions", json={"model": NAME, "prompt": "q", "max_tokens": 2}
        )
        assert ok.status_code == 200
        final = _scrape(srv.url)
        assert final["radixkv_request_queue_time_seconds_count"] >= 1
        assert final["radixkv_request_queue_time_seconds_sum"] >= 0
        assert_clean(st)


# ------------------------------------------------------------------ robustness


def _asgi_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 40000),
    }


def test_disconnect_while_sending_body_is_a_closed_connection() -> None:
    """ASGI level: the body's first half, then http.disconnect (what uvicorn delivers when the
    socket closes): no exception escapes, no 500, nothing logged as an error, counted."""
    engine = AsyncEngine("radixkv-tiny", num_pages=64)
    app = build_app(engine, ServerConfig(model_name=NAME), owns_engine=True)
    st = app.state.radixkv
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": b'{"model": "tiny-ops", "pro', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # pragma: no cover - nothing more ever arrives
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def call() -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"4000")]
        for path in ("/v1/completions", "/v1/chat/completions"):
            messages[:] = [
                {"type": "http.request", "body": b'{"model": "x", "pro', "more_body": True},
                {"type": "http.disconnect"},
            ]
            await app(_asgi_scope(path, headers), receive, send)
        await engine.shutdown()

    with Records("radixkv", "uvicorn", "fastapi") as logs:
        asyncio.run(call())
    starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert starts == [499, 499]
    assert logs.errors() == []
    values = metric_values(st.metrics.render().decode(), NAME)
    assert values['radixkv_client_closed_requests_total{phase="body"}'] == 2
    assert not any(k.startswith("radixkv_http_errors_total") for k in values)


def test_socket_closed_mid_body_over_http() -> None:
    with (
        live_server(ServerConfig(model_name=NAME)) as (srv, st),
        Records("", "radixkv", "uvicorn") as logs,
    ):
        for _ in range(2):
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
                    b'{"model": "tiny-ops", "prompt": "half a bo'
                )
                time.sleep(0.2)  # let the server start reading the body
        deadline = time.monotonic() + 20
        while True:
            values = _scrape(srv.url)
            if values['radixkv_client_closed_requests_total{phase="body"}'] == 2:
                break
            assert time.monotonic() < deadline, values
            time.sleep(0.05)
        assert not any(k.startswith("radixkv_http_errors_total") for k in values), values
        r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "ok"})
        assert r.status_code == 200
        assert_clean(st)
    assert logs.errors() == []


def test_trailing_slash_is_404_and_never_echoes_host() -> None:
    config = ServerConfig(
        model_name=NAME, admin_key="admin-key-0123", allowed_hosts=("attacker.example",)
    )  # allowed: a Host the keyless server refuses never gets as far as the router
    with live_server(config) as (srv, _):
        for method, path in (("POST", "/reset_prefix_cache/"), ("GET", "/v1/models/")):
            r = httpx.request(
                method, srv.url + path, headers={"Host": "attacker.example"}, follow_redirects=False
            )
            assert r.status_code == 404 and "location" not in r.headers
            assert "attacker.example" not in r.text
            assert path.rstrip("/") in r.json()["error"]["message"]  # a hint, not a redirect


def test_unknown_field_warnings_are_bounded() -> None:
    with live_server(ServerConfig(model_name=NAME)) as (_, st), Records("radixkv") as logs:
        body = {"model": NAME, "prompt": "x", **{f"made_up_{i}": i for i in range(100)}}
        for _ in range(2):
            st.decode(json.dumps(body).encode(), CompletionRequest)
    warnings = [r.getMessage() for r in logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == MAX_WARNED_FIELDS + 1
    assert "no longer logging" in warnings[-1]


# ------------------------------------------------------------------ keys

ALICE, BOB, CAROL = "key-alice-000", "key-bob-00000", "key-carol-000"


def _write_keys(path: Path, keys: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(keys))
    os.replace(tmp, path)  # atomic, as an operator's tooling would do it


def _status(url: str, key: str) -> int:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": NAME, "prompt": "k", "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}"},
    )
    return r.status_code


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[BackgroundServer, Any, Path]]:
    path = tmp_path / "keys.json"
    _write_keys(path, {ALICE: "alice", BOB: "bob"})
    engine = AsyncEngine("radixkv-tiny", num_pages=256)
    app = build_app(
        engine, ServerConfig(model_name=NAME, api_keys_file=str(path)), owns_engine=True
    )
    with BackgroundServer(app) as srv:
        yield srv, app, path


def test_removed_key_gets_401_without_restart(keyed: tuple[BackgroundServer, Any, Path]) -> None:
    srv, _, path = keyed
    assert _status(srv.url, ALICE) == 200 and _status(srv.url, BOB) == 200
    _write_keys(path, {BOB: "bob", CAROL: "carol"})
    assert _status(srv.url, ALICE) == 401  # revoked: refused from the next request on
    assert _status(srv.url, BOB) == 200 and _status(srv.url, CAROL) == 200
    _write_keys(path, {ALICE: "alice"})
    assert _status(srv.url, ALICE) == 200 and _status(srv.url, BOB) == 401


def _broken_by(kind: str, path: Path) -> None:
    if kind == "invalid JSON":
        path.write_text("{not json")
    elif kind == "empty":
        path.write_text("")
    elif kind == "no keys":
        path.write_text("{}")
    elif kind == "deleted":
        path.unlink()
    else:  # unreadable (a directory where the file was: unreadable even for root)
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("kind", ["invalid JSON", "empty", "no keys", "deleted", "unreadable"])
def test_broken_key_file_revokes_every_key(
    keyed: tuple[BackgroundServer, Any, Path], kind: str
) -> None:
    """Revocation fails closed: whatever breaks the file, no old key works until it is fixed
    (before: every old key stayed in force until a restart); the admin key still does; the
    log says why, once."""
    srv, _, path = keyed
    assert _status(srv.url, ALICE) == 200 and _status(srv.url, BOB) == 200
    with Records("radixkv") as logs:
        _broken_by(kind, path)
        assert _status(srv.url, ALICE) == 401 and _status(srv.url, BOB) == 401
        assert _status(srv.url, ALICE) == 401
    revoked = [m for m in logs.errors() if "API keys revoked" in m]
    assert len(revoked) == 1 and str(path) in revoked[0], logs.errors()
    if path.is_dir():
        path.rmdir()
    _write_keys(path, {CAROL: "carol"})
    assert _status(srv.url, CAROL) == 200 and _status(srv.url, ALICE) == 401


def test_admin_key_survives_a_broken_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    _write_keys(path, {ALICE: "alice"})
    config = ServerConfig(model_name=NAME, api_keys_file=str(path), admin_key="admin-key-0123")
    with live_server(config) as (srv, _):
        path.write_text("{}")
        assert _status(srv.url, ALICE) == 401
        r = httpx.post(
            srv.url + "/reset_prefix_cache", headers={"Authorization": "Bearer admin-key-0123"}
        )
        assert r.status_code == 200


def test_rewrite_that_looks_unchanged_applies_within_a_second(
    keyed: tuple[BackgroundServer, Any, Path],
) -> None:
    """An edit in place that keeps size, inode and mtime (no stat can tell) is read within a
    second, without SIGHUP."""
    srv, _, path = keyed
    assert _status(srv.url, BOB) == 200
    new_bob = _rewrite_unseen(path, BOB)
    deadline = time.monotonic() + 1.0 + 0.5  # RECHECK_S, plus one request's time
    while _status(srv.url, BOB) == 200:
        assert time.monotonic() < deadline, "the rewrite was not applied within a second"
        time.sleep(0.05)
    assert time.monotonic() < deadline
    assert _status(srv.url, new_bob) == 200


def _rewrite_unseen(path: Path, old_key: str) -> str:
    """Replace ``old_key`` in the file in place, keeping size, inode and mtime."""
    before = path.stat()
    new_key = old_key[:-5] + "11111"
    assert len(new_key) == len(old_key) and new_key != old_key
    with open(path, "r+") as f:
        text = f.read()
        f.seek(0)
        f.write(text.replace(old_key, new_key))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    return new_key


def test_sighup_reloads_keys(
    keyed: tuple[BackgroundServer, Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, app, path = keyed
    monkeypatch.setattr(auth_mod, "RECHECK_S", 3600.0)  # only SIGHUP can tell, then
    assert _status(srv.url, BOB) == 200
    new_bob = _rewrite_unseen(path, BOB)
    assert _status(srv.url, BOB) == 200  # the file looks unchanged
    old = signal.getsignal(signal.SIGHUP)
    try:
        assert install_sighup_reload(app)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)  # the handler runs in the main thread, between bytecodes
        assert _status(srv.url, BOB) == 401 and _status(srv.url, new_bob) == 200
    finally:
        signal.signal(signal.SIGHUP, old)


def test_metrics_require_key() -> None:
    with pytest.raises(ValueError, match="metrics_require_key"):
        ServerConfig(metrics_require_key=True)
    config = ServerConfig(
        model_name=NAME,
        api_keys={ALICE: "alice"},
        admin_key="admin-key-0123",
        metrics_require_key=True,
    )
    with live_server(config) as (srv, _):
        assert httpx.get(srv.url + "/metrics").status_code == 401
        bad = {"Authorization": "Bearer key-mallory-0"}
        assert httpx.get(srv.url + "/metrics", headers=bad).status_code == 401
        for key in (ALICE, "admin-key-0123"):
            _scrape(srv.url, headers={"Authorization": f"Bearer {key}"})
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness stays open
    keyed = ServerConfig(model_name=NAME, api_keys={ALICE: "alice"})
    with live_server(keyed) as (srv, _):
        # on by default once keys are configured (before: open to anyone), probes too
        assert keyed.metrics_key_required
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/health_generate").status_code == 401
        auth = {"Authorization": f"Bearer {ALICE}"}
        _scrape(srv.url, headers=auth)
        assert httpx.get(srv.url + "/health_generate", headers=auth).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness stays open
    opened = ServerConfig(model_name=NAME, api_keys={ALICE: "alice"}, metrics_require_key=False)
    with live_server(opened) as (srv, _):
        _scrape(srv.url)  # turned off explicitly
        assert httpx.get(srv.url + "/health_generate").status_code == 200
    with live_server(ServerConfig(model_name=NAME)) as (srv, _):
        _scrape(srv.url)  # no keys: nothing to check
