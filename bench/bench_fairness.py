"""Fair admission benchmark: one tenant floods the server, another sends a few requests.

Two API keys on one in-process radixkv server (127.0.0.1, radixkv-tiny on this machine). At t=0
tenant "flood" sends one request with ``--flood-prompts`` prompts and ``--flood-requests``
more requests of ``--flood-batch`` prompts each (non-streaming, ``--flood-tokens`` tokens per
prompt). Once its sequences fill the engine's running slots (``--max-running``) and the rest
wait, tenant "other" sends ``--other-requests`` streaming requests at once (``--other-tokens``
tokens each) and measures each one's time to its first token, which is its queue wait plus one
prefill step. The same run is made with fair admission on (the
default: the engine interleaves tenants, the one running fewer first) and off
(``--disable-fair-admission``: the schedule policy's order over the whole queue), alternating
``--repeats`` times, so both sides see the same machine load.

Reports per side: the other tenant's TTFT (median and max over its requests), the flood's
time to its first answer and to its last, and the wall time; so the price of fairness (the
flood's delay) is there next to its gain.

    python bench/bench_fairness.py [--flood-prompts 256] [--other-requests 4] [--repeats 2]

Writes bench/results/bench_fairness.json.
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
from radixkv.server.state import ServerState

MODEL = "radixkv-tiny"
KEYS = {"bench-key-flood": "flood", "bench-key-other": "other"}


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _flood_request(
    http: httpx.AsyncClient, prompts: list[str], args: argparse.Namespace, t0: float
) -> float:
    """Seconds from t0 until this flood request's whole answer came back."""
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": args.flood_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = await http.post("/v1/completions", json=body, headers=_headers("bench-key-flood"))
    r.raise_for_status()
    return time.perf_counter() - t0


async def _other_request(http: httpx.AsyncClient, i: int, args: argparse.Namespace) -> float:
    """The other tenant's streaming request: seconds to its first token."""
    body = {
        "model": MODEL,
        "prompt": f"Request {i} of the other tenant: tell me something new.",
        "max_tokens": args.other_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    async with http.stream(
        "POST", "/v1/completions", json=body, headers=_headers("bench-key-other")
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


async def _running(st: ServerState, tenant: str, least: int, timeout: float) -> None:
    """Until ``tenant`` has at least ``least`` sequences running and more waiting (its flood
    holds the engine's running slots and is queued behind them)."""
    deadline = time.perf_counter() + timeout
    while True:
        load = st.tenants.load().get(tenant)
        if load is not None and load.running >= least and load.waiting > 0:
            return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{tenant} never had {least} sequences running: {load}")
        await asyncio.sleep(0.005)


async def _workload(url: str, st: ServerState, args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.flood_requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        t0 = time.perf_counter()
        big = [f"Flood {k}: write a long story about the sea." for k in range(args.flood_prompts)]
        flood = [asyncio.create_task(_flood_request(http, big, args, t0))]
        for j in range(args.flood_requests):
            prompts = [
                f"Flood batch {j} item {k}: describe a city." for k in range(args.flood_batch)
            ]
            flood.append(asyncio.create_task(_flood_request(http, prompts, args, t0)))
        await _running(st, "flood", args.max_running, timeout=120)
        queued_at = time.perf_counter() - t0
        other = await asyncio.gather(
            *(_other_request(http, i, args) for i in range(args.other_requests))
        )
        done = await asyncio.gather(*flood)
        wall = time.perf_counter() - t0
    return {
        "other_ttft_median_ms": round(statistics.median(other) * 1e3, 1),
        "other_ttft_max_ms": round(max(other) * 1e3, 1),
        "flood_first_done_s": round(min(done), 2),
        "flood_last_done_s": round(max(done), 2),
        "flood_queued_after_s": round(queued_at, 2),
        "wall_s": round(wall, 2),
    }


def run(args: argparse.Namespace, fair: bool) -> dict[str, Any]:
    engine = AsyncEngine(
        MODEL,
        num_pages=args.num_pages,
        max_running_requests=args.max_running,
        fair_admission=fair,
    )
    flood_seqs = args.flood_prompts + args.flood_requests * args.flood_batch
    config = ServerConfig(
        api_keys=KEYS,
        max_queue=4 * flood_seqs,
        tenant_max_prompts=flood_seqs,
        tenant_max_waiting=2 * flood_seqs,
    )
    app = build_app(engine, config, owns_engine=True)
    with BackgroundServer(app) as srv:
        row = asyncio.run(_workload(srv.url, app.state.radixkv, args))
    return {"fair_admission": "on" if fair else "off", **row}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--flood-prompts", type=int, default=256, help="prompts of the big request")
    ap.add_argument("--flood-requests", type=int, default=16, help="more flood requests")
    ap.add_argument("--flood-batch", type=int, default=8, help="prompts per further request")
    ap.add_argument("--flood-tokens", type=int, default=16, help="tokens per flood prompt")
    ap.add_argument("--other-requests", type=int, default=4)
    ap.add_argument("--other-tokens", type=int, default=8)
    ap.add_argument("--max-running", type=int, default=32, help="the engine's running slots")
    ap.add_argument("--num-pages", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternating")
    ap.add_argument("--out", default=str(results_path("bench_fairness")))
    args = ap.parse_args()

    runs = [run(args, fair) for _ in range(args.repeats) for fair in (False, True)]
    rows = []
    for side in ("off", "on"):
        mine = [r for r in runs if r["fair_admission"] == side]
        row: dict[str, Any] = {"fair_admission": side, "runs": len(mine)}
        for k in mine[0]:
            if k != "fair_admission":
                row[k] = round(statistics.median(r[k] for r in mine), 2)
        rows.append(row)
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    off, on = rows
    print(
        f"other tenant's median TTFT: {off['other_ttft_median_ms']} ms without fair admission, "
        f"{on['other_ttft_median_ms']} ms with it; the flood's last answer after "
        f"{off['flood_last_done_s']} s vs {on['flood_last_done_s']} s"
    )
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cpus)".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": vars(args) | {"out": None},
        "summary": rows,
        "runs": runs,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
