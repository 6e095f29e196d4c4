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
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixkv.cache.tiers import WRITE_POLICIES
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.pages import pages_for

TARGETS = {"hit_rate_vs_unbounded": 0.95, "ttft_speedup": 2.0, "load_vs_recompute": 10.0}


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
    args = ap.parse_args()
    if args.quick:
        args.convs, args.turns, args.system = 8, 3, 256
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
                "conversations": args.convs,
                "turns": args.turns,
                "system_tokens": args.system,
                "user_tokens": args.user,
                "answer_tokens": args.answer,
                "page_size": args.page_size,
                "working_set_pages": working_set,
                "device_pages": device,
                "host_bytes": host_bytes,
            },
            "machine": platform.platform(),
            "targets": TARGETS,
            "results": results,
            "checks": checks,
        }
        path = Path(__file__).parent / "results" / args.out
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
