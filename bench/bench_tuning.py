"""Measured trade-offs for the tuning guide: pool size x policy, page size, chunked-prefill size.

Parts:

* ``pool``: hit rate vs pool size for each eviction policy, replaying a trace through the cache
  alone (no model): a few hot system prompts (Zipf popularity) asked many questions, interleaved
  with one-off long documents that are never reused (a "scan" that pollutes an LRU cache).
* ``page``: the same trace with an unbounded pool at page sizes 1, 4, 16, 64: hit rate lost to
  page alignment, trie size, and the median cost of match and insert; also a trace of short (20-60 token) shared prefixes,
  where alignment costs more.
* ``chunk``: the engine on radixkv-tiny, one long prompt arriving with a batch of short ones, for
  several ``chunked_prefill_size`` values: time to first token of the short requests vs of the
  long one, and total time.
* ``kvdtype``: the engine on radixkv-tiny (bf16) with a KV budget that holds about 60% of a hot
  set of system prompts in bf16 pages, for each ``kv_cache_dtype``: pages, hit rate, time to
  first token, and how many greedy outputs match those of bf16 pages in a pool that holds
  everything.

Writes bench/results/bench_tuning.json and prints tables. ``--quick`` shrinks every part.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import statistics
import time
from array import array
from pathlib import Path
from typing import Any

from make_report import machine_description
from peerkit import results_path, write_json

from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache

VOCAB = 32_000
NUM_HOT = 32


def make_trace(
    num_requests: int, *, num_hot: int = NUM_HOT, doc_share: float = 0.4, seed: int = 0
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(prompt, output) pairs: hot system prompts + unique questions, and one-off documents.

    System prompt lengths are drawn around 1,000 tokens (not page multiples, so page alignment
    costs something); questions 64 tokens; outputs 64 tokens; documents 1,000 tokens + question.
    Hot prompt i is chosen with probability proportional to 1 / (i + 1) (Zipf). Also returns
    the total length of the hot prompts in tokens (the "hot set").
    """
    rng = random.Random(seed)

    def run(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    hot = [run(rng.randrange(900, 1100)) for _ in range(num_hot)]
    weights = [1.0 / (i + 1) for i in range(num_hot)]
    trace = []
    for _ in range(num_requests):
        if rng.random() < doc_share:
            prompt = run(rng.randrange(900, 1100)) + run(64)
        else:
            prompt = rng.choices(hot, weights)[0] + run(64)
        trace.append((prompt, run(64)))
    return trace, sum(len(h) for h in hot)


def replay(trace: list[tuple[list[int], list[int]]], *, num_pages: int, page_size: int,
           policy: str) -> dict[str, Any]:  # fmt: skip
    """Serve every request the way the engine does, through the cache alone.

    match (capped at len - 1) -> lock -> alloc the rest -> insert prompt + output full pages ->
    free the private partial page -> unlock. Returns hit counts and median op times (us).
    """
    pool = PagePool(num_pages)
    cache = RadixCache(pool, page_size=page_size, policy=policy)
    hit = total = 0
    t_match: list[float] = []
    t_insert: list[float] = []
    for prompt_list, output in trace:
        prompt = array("q", prompt_list)  # the documented fast path for token ids
        t0 = time.perf_counter()
        m = cache.match_prefix(prompt[:-1])
        t_match.append(time.perf_counter() - t0)
        hit += m.num_tokens
        total += len(prompt)
        cache.lock(m.node)
        full = prompt + array("q", output)
        need = math.ceil(len(full) / page_size) - len(m.pages)
        pages = list(m.pages) + cache.alloc(need)
        n_full = len(full) // page_size
        t0 = time.perf_counter()
        cache.insert(full[: n_full * page_size], pages[:n_full])
        t_insert.append(time.perf_counter() - t0)
        if len(pages) > n_full:
            pool.free(pages[n_full:])  # the partial last page was private to the request
        cache.unlock(m.node)
    cache.check_invariants()
    return {
        "hit_rate": hit / total,
        "hit_tokens": hit,
        "prompt_tokens": total,
        "cached_pages": cache.num_cached_pages,
        "nodes": sum(1 for _ in cache.iter_nodes()),
        "evicted_pages": int(getattr(cache.stats, "evicted_pages", 0)),
        "match_us": 1e6 * statistics.median(t_match),
        "insert_us": 1e6 * statistics.median(t_insert),
    }


def _enough(trace: list[tuple[list[int], list[int]]], page_size: int) -> int:
    """A pool that never evicts: every page any request could ever need."""
    return sum(math.ceil((len(p) + len(o)) / page_size) for p, o in trace) + 1


def bench_pool(
    trace: list[tuple[list[int], list[int]]], page_size: int, hot_pages: int
) -> list[dict[str, Any]]:
    """Hit rate per policy for pools from a quarter of the hot set to 8x it."""
    max_pages = max(math.ceil((len(p) + len(o)) / page_size) for p, o in trace)
    unbounded = replay(
        trace, num_pages=_enough(trace, page_size), page_size=page_size, policy="lru"
    )
    rows = []
    for mult in (0.25, 0.5, 1.0, 2.0, 4.0, 8.0):
        num_pages = max(int(hot_pages * mult), 2 * max_pages)
        for policy in ("lru", "lfu"):
            r = replay(trace, num_pages=num_pages, page_size=page_size, policy=policy)
            rows.append({
                "policy": policy, "pool_vs_hot_set": mult, "pool_pages": num_pages,
                "hit_rate": round(r["hit_rate"], 4),
                "ideal_hit_rate": round(unbounded["hit_rate"], 4),
                "evicted_pages": r["evicted_pages"],
            })  # fmt: skip
    return rows


def make_short_trace(num_requests: int, seed: int = 2) -> list[tuple[list[int], list[int]]]:
    """Short shared prefixes: 64 few-shot style prompts of 20-60 tokens, 16-token questions."""
    rng = random.Random(seed)
    hot = [[rng.randrange(VOCAB) for _ in range(rng.randrange(20, 60))] for _ in range(64)]
    return [
        (rng.choice(hot) + [rng.randrange(VOCAB) for _ in range(16)],
         [rng.randrange(VOCAB) for _ in range(16)])
        for _ in range(num_requests)
    ]  # fmt: skip


def bench_page(workloads: dict[str, list[tuple[list[int], list[int]]]]) -> list[dict[str, Any]]:
    """Per workload and page size, with a pool that never evicts: what alignment costs."""
    rows = []
    for name, trace in workloads.items():
        base = None
        for ps in (1, 4, 16, 64):
            r = replay(trace, num_pages=_enough(trace, ps), page_size=ps, policy="lru")
            base = r["hit_rate"] if base is None else base
            rows.append({
                "workload": name, "page_size": ps, "hit_rate": round(r["hit_rate"], 4),
                "hit_rate_lost_to_alignment": round(base - r["hit_rate"], 4),
                "nodes": r["nodes"], "cached_pages": r["cached_pages"],
                "match_us_median": round(r["match_us"], 2),
                "insert_us_median": round(r["insert_us"], 2),
                "mean_partial_page_tokens": (ps - 1) / 2,
            })  # fmt: skip
    return rows


CLOCK = time.perf_counter  # --clock cpu: time.process_time (and one torch thread)


def bench_chunk(quick: bool) -> list[dict[str, Any]]:
    """Engine: a long prompt arrives while short requests are decoding, per chunk size.

    Short requests start first and decode; then a long prompt arrives. Each step runs the
    shorts' decode tokens together with (a chunk of) the long prefill, so a large chunk makes
    one long step: a stall in the shorts' token stream. Reported: the shorts' worst gap between
    two tokens, the long prompt's time to first token, and the total time.
    """
    rng = random.Random(1)
    long_len, n_short = (1024, 4) if quick else (4096, 8)
    # plain byte ids: valid for radixkv-tiny's byte-level vocabulary (special ids lie above)
    long_prompt = [rng.randrange(3, 256) for _ in range(long_len)]
    shorts = [[rng.randrange(3, 256) for _ in range(32)] for _ in range(n_short)]
    rows = []
    for chunk in (256, 512, 1024, 2048, 4096):
        if chunk > long_len:
            continue
        # best of two runs per setting: timings on a shared 2-core machine are noisy
        runs = [_chunk_run(chunk, long_prompt, shorts) for _ in range(1 if quick else 2)]
        best = {k: min(r[k] for r in runs) for k in runs[0]}
        rows.append({
            "chunked_prefill_size": chunk, "long_prompt_tokens": long_len,
            "short_requests": n_short, **{k: round(v, 4) for k, v in best.items()},
        })  # fmt: skip
    return rows


def _chunk_run(chunk: int, long_prompt: list[int], shorts: list[list[int]]) -> dict[str, float]:
    """One run: shorts decoding, then the long prompt arrives; times in seconds."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    engine = Engine("radixkv-tiny", chunked_prefill_size=chunk, max_prefill_tokens=8192,
                    enable_prefix_cache=False, seed=0)  # fmt: skip
    short_ids = [
        engine.add_request(p, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        for p in shorts
    ]
    for _ in range(2):  # the shorts are decoding before the long prompt arrives
        engine.step()
    t_arrive = CLOCK()
    long_id = engine.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    last_token = dict.fromkeys(short_ids, t_arrive)
    gaps: list[float] = []
    long_ttft = None
    while engine.has_unfinished():
        outs = engine.step()
        now = CLOCK()
        for o in outs:
            if o.request_id in last_token and o.outputs[0].delta_token_ids:
                gaps.append(now - last_token[o.request_id])
                last_token[o.request_id] = now
            if o.request_id == long_id and long_ttft is None and o.token_ids:
                long_ttft = now - t_arrive
    return {
        "short_max_token_gap_s": max(gaps),
        "short_median_token_gap_s": statistics.median(gaps),
        "long_ttft_s": long_ttft or float("nan"),
        "total_s": CLOCK() - t_arrive,
    }


def bench_kv_dtype(quick: bool) -> list[dict[str, Any]]:
    """Engine: ``kv_cache_dtype`` under a KV budget too small for the hot set in bf16.

    ``num_sys`` system prompts of ~1,000 tokens each get a 64-token question in turn (round
    robin, one request at a time, ``rounds`` times), so a prompt comes back after all the
    others: it is still cached only if the whole hot set fits. The budget holds about 60% of
    it in bf16 pages, all of it in fp8. Outputs (16 greedy tokens) are compared with a bf16
    run whose pool holds everything (the reference: fp8 rounds K/V, so some differ).
    """
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    rng = random.Random(3)
    num_sys, rounds = (6, 2) if quick else (12, 4)
    systems = [[rng.randrange(3, 256) for _ in range(rng.randrange(960, 1088))]
               for _ in range(num_sys)]  # fmt: skip
    prompts = [sys_p + [rng.randrange(3, 256) for _ in range(64)]
               for _ in range(rounds) for sys_p in systems]  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # bf16 bytes of the hot set (2 bytes x K and V x layers x kv heads x head dim per token)
    probe = Engine("radixkv-tiny", dtype="bfloat16", num_pages=8)
    per_token = probe.kv_pool.bytes_per_page // probe.kv_pool.page_size
    hot_bytes = sum(len(p) for p in systems) * per_token
    budget = int(hot_bytes * 0.6)

    def run(kvd: str, memory: int) -> tuple[dict[str, Any], list[list[int]]]:
        eng = Engine("radixkv-tiny", dtype="bfloat16", kv_cache_dtype=kvd,
                     kv_cache_memory=memory, seed=0)  # fmt: skip
        ttfts, outs = [], []
        t0 = CLOCK()
        for p in prompts:
            (o,) = eng.generate([p], params, use_tqdm=False)
            ttfts.append(o.metrics.ttft)
            outs.append(list(o.outputs[0].token_ids))
        total = CLOCK() - t0
        eng.check_invariants()
        st = eng.stats()
        ttfts.sort()
        row = {
            "kv_cache_dtype": kvd, "kv_cache_memory_bytes": memory,
            "pool_tokens": eng.kv_pool.num_pages * eng.kv_pool.page_size,
            "hot_set_tokens": sum(len(p) for p in systems),
            "hit_rate": round(st.prefix_cache_hit_tokens / max(1, st.prompt_tokens), 4),
            "ttft_mean_s": round(statistics.mean(ttfts), 4),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 4),
            "total_s": round(total, 3),
        }  # fmt: skip
        return row, outs

    _, ref = run("auto", hot_bytes * 4)
    rows = []
    for kvd in ("auto", "fp8_e4m3", "fp8_e5m2"):
        row, outs = run(kvd, budget)
        same = sum(a == b for a, b in zip(outs, ref, strict=True))
        agree = sum(x == y for a, b in zip(outs, ref, strict=True) for x, y in zip(a, b))
        row["identical_outputs"] = f"{same}/{len(ref)}"
        row["token_agreement"] = round(agree / sum(map(len, ref)), 4)
        rows.append(row)
    rows[0]["kv_cache_dtype"] = "auto (bfloat16)"
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument(
        "--parts", default="pool,page,chunk,kvdtype", help="comma list of pool,page,chunk,kvdtype"
    )
    ap.add_argument("--out", type=Path, default=results_path("bench_tuning"))
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu: time the engine parts by this process's CPU time on one torch thread "
        "(stable on a busy machine; about the wall time of an idle single core)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.clock == "cpu":
        import torch

        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    parts = set(args.parts.split(","))
    n = 300 if args.quick else 2000
    trace, hot_tokens = make_trace(n)
    # running a subset of parts keeps the other parts' last results
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    result: dict[str, Any] = {
        k: v
        for k, v in old.items()
        if k in ("pool_policy", "page_size", "chunk_size", "chunk_size_clock", "kv_cache_dtype")
    }
    result |= {
        "machine": machine_description(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "trace": f"{n} requests: {NUM_HOT} Zipf-hot ~1000-token system prompts + 64-token question, "
        "40% one-off ~1000-token documents; 64 output tokens each",
    }
    if "pool" in parts:
        result["pool_policy"] = bench_pool(trace, page_size=16, hot_pages=hot_tokens // 16)
        _print("hit rate vs pool size (page_size 16)", result["pool_policy"])
    if "page" in parts:
        shared = {"long prefixes (trace above)": trace, "short prefixes": make_short_trace(n)}
        result["page_size"] = bench_page(shared)
        _print("page size (unbounded pool)", result["page_size"])
    if "chunk" in parts:
        result["chunk_size"] = bench_chunk(args.quick)
        result["chunk_size_clock"] = (
            "process CPU time, 1 torch thread" if args.clock == "cpu" else "wall clock"
        )
        _print("chunked prefill size (radixkv-tiny, cache off)", result["chunk_size"])
    if "kvdtype" in parts:
        result["kv_cache_dtype"] = bench_kv_dtype(args.quick)
        _print("KV cache dtype, budget ~60% of the hot set in bf16 (radixkv-tiny, bf16)",
               result["kv_cache_dtype"])  # fmt: skip
    write_json(args.out, result)
    return 0


def _print(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    cols = list(rows[0])
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>14}" for c in cols))


if __name__ == "__main__":
    raise SystemExit(main())
