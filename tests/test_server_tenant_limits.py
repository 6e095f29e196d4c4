"""Per-tenant limits (server/tenant_limits.py) and fair admission through the server: the
excess of one tenant gets 429 with Retry-After and the limit named, in each route's own error
shape, while another tenant keeps being served (and is admitted ahead of the flood's queue);
the per-tenant series count it, labelled by tenant name, never by key."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, checked_http, in_loop, live_server, wait_drained

from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.metrics import TenantLabels
from radixkv.server.state import ServerState
from radixkv.server.tenant_limits import (
    TenantLimiter,
    TenantLimitExceeded,
    TenantLimitValues,
)

KEYS = {"key-alice-000": "alice", "key-bob-00000": "bob"}
ALICE = {"authorization": "Bearer key-alice-000"}
BOB = {"authorization": "Bearer key-bob-00000"}
CMPL = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}


# ------------------------------------------------------------------ the limiter on its own
def test_limiter_counts_waiting_running_and_tokens() -> None:
    lim = TenantLimiter()
    cap = TenantLimitValues(max_prompts=4, max_waiting=6, max_queued_tokens=100)
    t1 = lim.admit("a", cap, seqs=4, prompts=2, n=2, tokens=30, param="n")
    t2 = lim.admit("a", cap, seqs=2, prompts=2, n=1, tokens=20, param="prompt")
    with pytest.raises(TenantLimitExceeded) as e:  # 6 waiting: one more is too many
        lim.admit("a", cap, seqs=1, prompts=1, n=1, tokens=1, param="prompt")
    assert e.value.status == 429 and e.value.limit == "tenant_max_waiting"
    assert e.value.headers["retry-after"] == "1"
    assert "tenant_max_waiting=6" in e.value.message
    lim.admit("b", cap, seqs=1, prompts=1, n=1, tokens=1, param="prompt")  # b is not a
    t1.started(2, 15)  # one prompt (n=2) of 15 tokens produced its first output
    load = lim.load()["a"]
    assert (load.waiting, load.running, load.queued_tokens) == (4, 2, 35)
    with pytest.raises(TenantLimitExceeded) as e:
        lim.admit("a", cap, seqs=2, prompts=1, n=2, tokens=70, param="prompt")
    assert e.value.limit == "tenant_max_queued_tokens"
    with pytest.raises(TenantLimitExceeded) as e:
        lim.admit("a", cap, seqs=5, prompts=5, n=1, tokens=5, param="prompt")
    assert e.value.limit == "tenant_max_prompts" and e.value.param == "prompt"
    t1.release()
    t1.release()  # once
    t2.release()
    assert "a" not in lim.load() and lim.load()["b"].waiting == 1


def test_default_limits_only_bind_with_several_tenants() -> None:
    cfg = ServerConfig(max_queue=100)
    assert cfg.tenant_limits(0) == TenantLimitValues(None, None, None)
    assert cfg.tenant_limits(1) == TenantLimitValues(None, None, None)
    assert cfg.tenant_limits(2) == TenantLimitValues(50, 50, None)
    own = ServerConfig(max_queue=100, tenant_max_waiting=7, tenant_max_queued_tokens=9)
    assert own.tenant_limits(0) == TenantLimitValues(None, 7, 9)
    with pytest.raises(ValueError, match="tenant_max_prompts"):
        ServerConfig(tenant_max_prompts=0)


def test_tenant_labels_are_capped() -> None:
    labels = TenantLabels(most=2)
    assert [labels("x"), labels(""), labels("y"), labels("x")] == ["x", "-", "other", "x"]


# ------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    cfg = ServerConfig(
        api_keys=KEYS, tenant_max_prompts=4, tenant_max_waiting=6, tenant_max_queued_tokens=400
    )
    with live_server(cfg, max_running_requests=2) as s:
        yield s


@pytest.fixture
def http(server: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with checked_http(server) as c:
        yield c


def _openai_429(r: httpx.Response, limit: str) -> dict[str, Any]:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == limit
    assert limit in err["message"]
    return err


def test_prompts_per_request_is_a_429_on_openai_routes(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={**CMPL, "prompt": ["a", "b", "c"], "n": 2}, headers=ALICE
    )
    err = _openai_429(r, "tenant_max_prompts")
    assert err["param"] == "prompt" and "3 prompts x n=2" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    err = _openai_429(
        http.post("/v1/chat/completions", json={**chat, "n": 5}, headers=BOB), "tenant_max_prompts"
    )
    assert err["param"] == "n"
    # within the limit: served
    assert http.post("/v1/chat/completions", json={**chat, "n": 4}, headers=BOB).status_code == 200


def test_queued_tokens_is_a_429_in_anthropic_shape_on_messages(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "word " * 500}],  # > 400 prompt tokens
    }
    r = http.post("/v1/messages", json=body, headers={"x-api-key": "key-alice-000"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    got = r.json()
    assert got["type"] == "error" and got["error"]["type"] == "rate_limit_error"
    assert "tenant_max_queued_tokens=400" in got["error"]["message"]
    body["messages"] = [{"role": "user", "content": "hi"}]
    assert (
        http.post("/v1/messages", json=body, headers={"x-api-key": "key-alice-000"}).status_code
        == 200
    )


def test_waiting_limit_is_a_429_naming_it_and_frees_when_released(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = server[1]
    cap = replace(st.config.tenant_limits(st.auth.num_tenants), max_prompts=None)

    async def hold() -> Any:  # alice's 5 sequences waiting, as a flood would leave them
        return st.tenants.admit("alice", cap, seqs=5, prompts=5, n=1, tokens=10, param="prompt")

    ticket = in_loop(st, hold)
    try:
        r = http.post("/v1/completions", json={**CMPL, "prompt": ["a", "b"]}, headers=ALICE)
        err = _openai_429(r, "tenant_max_waiting")
        assert "5 sequences waiting" in err["message"]
        r = http.post(
            "/generate",
            json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}},
            headers=ALICE,
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "tenant_max_waiting=6" in r.json()["error"]["message"]  # SGLang's shape
        assert http.post("/v1/completions", json=CMPL, headers=BOB).status_code == 200
        assert http.post("/v1/completions", json=CMPL, headers=ALICE).status_code == 200  # 6
    finally:
        in_loop(st, lambda: _release(ticket))
    assert (
        http.post("/v1/completions", json={**CMPL, "prompt": ["a", "b"]}, headers=ALICE).status_code
        == 200
    )
    metrics = http.get("/metrics", headers=BOB).text
    assert (
        'radixkv_tenant_rejected_requests_total{limit="tenant_max_waiting",model_name="radixkv-tiny",tenant="alice"} 2.0'
        in metrics
    )
    assert "key-alice" not in metrics and "key-bob" not in metrics


async def _release(ticket: Any) -> None:
    ticket.release()


def test_two_keys_flood_and_the_other_tenant_goes_first(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    """Alice's request of 4 prompts x 48 tokens waits behind the engine's 2 running slots;
    Bob's request, sent once Alice's wait, is admitted at the next free slot (fair admission:
    Bob runs fewer), so it ends before Alice's, and the gauges show both tenants meanwhile."""
    st = server[1]
    flood = {
        **CMPL,
        "prompt": ["one", "two", "three", "four"],
        "max_tokens": 48,
        "ignore_eos": True,
    }
    done: dict[str, float] = {}

    def alice() -> None:
        r = http.post("/v1/completions", json=flood, headers=ALICE)
        assert r.status_code == 200, r.text
        done["alice"] = time.monotonic()

    t = threading.Thread(target=alice)
    t.start()
    deadline = time.monotonic() + 20
    while st.tenants.load().get("alice") is None or st.tenants.load()["alice"].running < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    seen = st.tenants.load()["alice"]
    assert seen.waiting == 2 and seen.running == 2
    metrics = http.get("/metrics", headers=BOB).text
    assert (
        'radixkv_tenant_num_requests_waiting{model_name="radixkv-tiny",tenant="alice"} 2.0'
        in metrics
    )
    r = http.post("/v1/completions", json={**CMPL, "max_tokens": 8}, headers=BOB)
    assert r.status_code == 200
    done["bob"] = time.monotonic()
    t.join(60)
    assert done["bob"] < done["alice"]
    wait_drained(st)
    assert st.tenants.load() == {}
