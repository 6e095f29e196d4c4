"""Bounded load: 64 concurrent streaming clients x 8 requests with shared prefixes, some
cancelled midway. Afterwards every request was answered ([DONE]) or cleanly cancelled, the
engine drained with invariants intact, every lock count is zero and pages are conserved.
p50/p99 latencies are printed (reported, not asserted).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from server_helpers import MODEL, assert_clean, in_loop, live_server, wait_drained

from radixkv.server.config import ServerConfig

CLIENTS = 64
PER_CLIENT = 8
SYSTEMS = [
    f"[{g}] You are assistant number {g}; answer briefly and politely. " * 3 for g in range(4)
]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _client(http: httpx.AsyncClient, i: int, results: list[dict[str, object]]) -> None:
    for r in range(PER_CLIENT):
        cancel = (i * PER_CLIENT + r) % 6 == 0
        body = {
            "model": MODEL,
            "prompt": SYSTEMS[(i + r) % len(SYSTEMS)] + f"User {i} asks question {r}?",
            "max_tokens": 8,
            "temperature": 0.7,
            "seed": i * 100 + r,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        ttft = None
        done = False
        usage = None
        finishes = 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: ")
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    if c["text"] and ttft is None:
                        ttft = time.perf_counter() - t0
                    if c["finish_reason"]:
                        finishes += 1
                if cancel and ttft is not None:
                    break  # leave mid-stream: closing the response disconnects
        results.append(
            {
                "cancelled": cancel and not done,
                "done": done,
                "latency": time.perf_counter() - t0,
                "ttft": ttft,
                "usage": usage,
                "finishes": finishes,
            }
        )


async def _load(url: str) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        await asyncio.gather(*(_client(http, i, results) for i in range(CLIENTS)))
    return results


def test_load_streaming_with_cancellations() -> None:
    with live_server(ServerConfig(max_queue=4096), num_pages=4096, max_running_requests=64) as (
        srv,
        st,
    ):
        before = in_loop(st, st.engine.stats)
        t0 = time.perf_counter()
        results = asyncio.run(_load(srv.url))
        wall = time.perf_counter() - t0
        stats = wait_drained(st)
        assert len(results) == CLIENTS * PER_CLIENT
        cancelled = [r for r in results if r["cancelled"]]
        answered = [r for r in results if r["done"]]
        assert len(cancelled) + len(answered) == len(results)  # nothing hung or half-answered
        assert cancelled, "some requests should have been cancelled midway"
        for r in answered:
            assert r["finishes"] == 1
            usage = r["usage"]
            assert isinstance(usage, dict) and usage["completion_tokens"] == 8
        # every submission ended in the engine: finished or aborted (a cancel may lose the race
        # with a request that had just finished)
        assert stats.num_requests - before.num_requests == len(results)
        aborted = stats.num_aborted - before.num_aborted
        assert aborted <= len(cancelled)
        hit_tokens = stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        query_tokens = stats.prefix_cache_query_tokens - before.prefix_cache_query_tokens
        assert hit_tokens > 0.5 * query_tokens  # shared prefixes hit
        assert_clean(st)
        lat = [float(r["latency"]) for r in answered]  # type: ignore[arg-type]
        ttft = [float(r["ttft"]) for r in results if r["ttft"] is not None]  # type: ignore[arg-type]
        print(
            f"\nload: {len(results)} requests ({len(cancelled)} cancelled, {aborted} aborted in the engine) "
            f"in {wall:.1f}s; latency p50 {_pct(lat, 0.5) * 1e3:.0f} ms p99 {_pct(lat, 0.99) * 1e3:.0f} ms; "
            f"TTFT p50 {_pct(ttft, 0.5) * 1e3:.0f} ms p99 {_pct(ttft, 0.99) * 1e3:.0f} ms; "
            f"hit rate {hit_tokens / max(1, query_tokens):.2f}"
        )
