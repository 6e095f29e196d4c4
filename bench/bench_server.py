"""HTTP server benchmark: radixkv serve (in-process, 127.0.0.1) under concurrent streaming load.

Workload: C concurrent streaming clients x R requests each; every prompt is one of G shared
system prompts plus a short unique question (the chat-with-system-prompt shape). Run with the
prefix cache on and off. Reports request latency and TTFT p50/p99 (client side, through HTTP and
SSE), throughput, and the engine's token hit rate; then the tenant-isolation timing check (TTFT
of a cold prompt, a same-tenant hit, and another tenant sending the same prompt).

    python bench/bench_server.py [--clients 32] [--requests 4] [--groups 4] [--system-tokens 1024]

Writes bench/results/bench_server.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from typing import Any

import httpx
from peerkit import results_path, write_json

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig

MODEL = "radixkv-tiny"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def one_client(
    http: httpx.AsyncClient,
    i: int,
    args: argparse.Namespace,
    systems: list[str],
    out: list[dict[str, float]],
) -> None:
    for r in range(args.requests):
        body = {
            "model": MODEL,
            "prompt": systems[(i + r) % len(systems)] + f" User {i} asks question {r}?",
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        t0 = time.perf_counter()
        ttft = None
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and ttft is None:
                    ttft = time.perf_counter() - t0
        out.append({"latency": time.perf_counter() - t0, "ttft": ttft or float("nan")})


async def load(url: str, args: argparse.Namespace, systems: list[str]) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await asyncio.gather(
            *(one_client(http, i, args, systems, out) for i in range(args.clients))
        )
    return out


def run_load(args: argparse.Namespace, cache_on: bool) -> dict[str, Any]:
    systems = [
        (f"[{g}] system prompt: be helpful and brief. " * 200)[: args.system_tokens]
        for g in range(args.groups)
    ]
    engine = AsyncEngine(
        MODEL, num_pages=8192, enable_prefix_cache=cache_on, max_running_requests=args.clients
    )
    app = build_app(engine, ServerConfig(max_queue=100_000), owns_engine=True)
    with BackgroundServer(app) as srv:
        t0 = time.perf_counter()
        res = asyncio.run(load(srv.url, args, systems))
        wall = time.perf_counter() - t0
        stats = httpx.get(srv.url + "/metrics").text
    hit_rate = next(  # the series carries labels: radixkv_prefix_cache_hit_rate{model_name=...}
        float(line.split()[-1])
        for line in stats.splitlines()
        if line.startswith(("radixkv_prefix_cache_hit_rate ", "radixkv_prefix_cache_hit_rate{"))
    )
    lat = [r["latency"] for r in res]
    ttft = [r["ttft"] for r in res]
    n = len(res)
    return {
        "prefix_cache": "on" if cache_on else "off",
        "requests": n,
        "wall_s": round(wall, 2),
        "req_per_s": round(n / wall, 2),
        "output_tok_per_s": round(n * args.max_tokens / wall, 1),
        "latency_p50_ms": round(pct(lat, 0.5) * 1e3, 1),
        "latency_p99_ms": round(pct(lat, 0.99) * 1e3, 1),
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttft, 0.99) * 1e3, 1),
        "hit_rate": round(hit_rate, 3),
    }


def tenant_timing(args: argparse.Namespace) -> dict[str, Any]:
    keys = {"bench-key-alice": "alice", "bench-key-bob00": "bob"}
    app = build_app(
        AsyncEngine(MODEL, num_pages=8192), ServerConfig(api_keys=keys), owns_engine=True
    )
    times: dict[str, list[float]] = {
        "cold": [],
        "same_tenant_hit": [],
        "other_tenant_same_prompt": [],
    }
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:

        def ttft(key: str, prompt: str) -> tuple[float, int]:
            t0 = time.perf_counter()
            r = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}"},
            )
            r.raise_for_status()
            return time.perf_counter() - t0, int(r.headers["x-cached-tokens"])

        for k in range(args.tenant_tries):
            secret = (f"{k:03d} alice's secret document. " * 400)[: args.system_tokens]
            t, _ = ttft("bench-key-alice", secret)
            times["cold"].append(t)
            t, c = ttft("bench-key-alice", secret)
            assert c > 0
            times["same_tenant_hit"].append(t)
            t, c = ttft("bench-key-bob00", secret)
            assert c == 0
            times["other_tenant_same_prompt"].append(t)
    return {f"{k}_median_ms": round(statistics.median(v) * 1e3, 1) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--groups", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tenant-tries", type=int, default=5)
    ap.add_argument("--out", default=str(results_path("bench_server")))
    args = ap.parse_args()

    rows = [run_load(args, cache_on=False), run_load(args, cache_on=True)]
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    tenant = tenant_timing(args)
    print("tenant isolation TTFT (ms):", tenant)
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cpus)".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": vars(args) | {"out": None},
        "load": rows,
        "tenant_isolation": tenant,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
