"""Benchmark of the radix prefix cache on SGLang's generated-shared-prefix workload.

64 groups x 16 prompts (1,024 requests, shuffled); each group shares a 2,048-token system
prompt, each request adds a 128-token question and, when it finishes, 256 output tokens.
Vocabulary 150,000. Each request runs the engine's flow: match the prompt, lock the match,
alloc pages for the uncached rest, insert prompt + output (whole pages) on finish, unlock.
Then half of the cache is evicted. Measured per page size (1, 16, 64): mean and p99 of
match, insert, lock+unlock and eviction (per page), the hit rate (ideal 0.882), and bytes of
trie metadata per cached token (tracemalloc over a replay of the same inserts).

    python bench/bench_cache.py            # full run, writes bench/results/bench_cache.json
    python bench/bench_cache.py --quick    # small smoke run (seconds), prints only
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
import tracemalloc
from array import array
from typing import Any

import numpy as np
from peerkit import load_average, results_path, utc_now, write_json

from radixkv.cache import PagePool, RadixCache

TARGETS_PS16 = {
    "match_us": 8.0,
    "insert_us": 25.0,
    "evict_us_per_page": 1.0,
    "bytes_per_token": 16.0,
}


def make_workload(
    groups: int, prompts: int, sys_len: int, q_len: int, out_len: int, vocab: int, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, output) token arrays per request, shuffled."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(groups):
        system = rng.integers(0, vocab, sys_len, dtype=np.int64)
        for _ in range(prompts):
            q = rng.integers(0, vocab, q_len, dtype=np.int64)
            out = rng.integers(0, vocab, out_len, dtype=np.int64)
            reqs.append((np.concatenate([system, q]), out))
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def as_container(a: np.ndarray, kind: str) -> Any:
    if kind == "array":
        out = array("q")
        out.frombytes(a.tobytes())
        return out
    return a.tolist()


def stats_us(ns: list[int], per: list[int] | None = None) -> dict[str, float]:
    """mean/p50/p99 in microseconds (per item when ``per`` is given).

    ``mean_clean`` leaves out samples slower than 20x the median and 200 us: on a shared
    2-core machine those are preemptions by other processes (a scheduler slice is ~4 ms),
    not cache work. ``outliers`` counts them; on a quiet machine the two means agree.
    """
    v = np.asarray(ns, dtype=np.float64) / 1e3
    if per is not None:
        v = v / np.maximum(np.asarray(per, dtype=np.float64), 1)
    if v.size == 0:
        nan = float("nan")
        return {"mean": nan, "mean_clean": nan, "p50": nan, "p99": nan, "n": 0, "outliers": 0}
    p50 = float(np.percentile(v, 50))
    raw = np.asarray(ns, dtype=np.float64) / 1e3
    slow = raw > max(20 * float(np.percentile(raw, 50)), 200.0)
    return {
        "mean": float(v.mean()),
        "mean_clean": float(v[~slow].mean()) if (~slow).any() else float("nan"),
        "p50": p50,
        "p99": float(np.percentile(v, 99)),
        "n": int(v.size),
        "outliers": int(slow.sum()),
    }


def run_one(reqs: list[tuple[Any, Any]], page_size: int, kind: str) -> dict[str, Any]:
    """Replay the request flow once, timing every cache call."""
    total_tokens = sum(len(p) + len(o) for p, o in reqs)
    pool = PagePool(total_tokens // page_size + 1024)  # big enough: nothing evicted mid-run
    cache = RadixCache(pool, page_size=page_size)
    prompts = [as_container(p, kind) for p, _ in reqs]
    fulls = [as_container(np.concatenate([p, o]), kind) for p, o in reqs]
    t_match: list[int] = []
    t_insert: list[int] = []
    t_lock: list[int] = []
    clock = time.perf_counter_ns
    gc.collect()
    # GC stays on (as in an application); its pauses are recorded so that they can be told
    # apart from preemptions by other processes.
    gc_pauses: list[int] = []
    gc_start = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = clock()
        else:
            gc_pauses.append(clock() - gc_start[0])

    gc.callbacks.append(on_gc)
    for prompt, full in zip(prompts, fulls):
        t0 = clock()
        m = cache.match_prefix(prompt)
        t1 = clock()
        cache.lock(m.node)
        t2 = clock()
        n_whole = len(full) // page_size
        n_total = -(-len(full) // page_size)  # the request's page table covers every token
        new = cache.alloc(n_total - len(m.pages))
        keep = n_whole - len(m.pages)
        pages = m.pages + new[:keep]
        tokens = full[: n_whole * page_size]
        t3 = clock()
        cache.insert(tokens, pages)
        t4 = clock()
        cache.unlock(m.node)
        t5 = clock()
        if len(new) > keep:
            pool.free(new[keep:])  # the partial last page stays private: freed
        t_match.append(t1 - t0)
        t_insert.append(t4 - t3)
        t_lock.append((t2 - t1) + (t5 - t4))
    gc.callbacks.remove(on_gc)
    st = cache.stats
    hit_rate = st.hit_rate
    cache.check_invariants()
    cached = cache.num_cached_pages
    # evict half the cache in request-sized chunks (the pages one finished request adds)
    chunk = max(1, (len(reqs[0][0]) - 2048 + len(reqs[0][1])) // page_size) if reqs else 1
    target = cached // 2
    t_evict: list[int] = []
    n_evict: list[int] = []
    freed_total = 0
    while freed_total < target:
        k = min(chunk, target - freed_total)
        t0 = clock()
        freed = cache.evict(k)
        t1 = clock()
        t_evict.append(t1 - t0)
        n_evict.append(freed)
        freed_total += freed
        if freed == 0:
            break
    cache.check_invariants()
    return {
        "match_us": stats_us(t_match),
        "insert_us": stats_us(t_insert),
        "lock_unlock_us": stats_us(t_lock),
        "evict_us_per_page": stats_us(t_evict, n_evict),
        "evict_chunk_pages": chunk,
        "gc_pauses_during_replay": {
            "count": len(gc_pauses),
            "total_us": sum(gc_pauses) / 1e3,
            "max_us": max(gc_pauses, default=0) / 1e3,
        },
        "evicted_pages": freed_total,
        "hit_rate": hit_rate,
        "cached_pages": cached,
        "cached_tokens": cached * page_size,
        "num_nodes": st.num_nodes,
    }


def metadata_bytes(reqs: list[tuple[Any, Any]], page_size: int) -> dict[str, float]:
    """Bytes the trie allocates per cached token (tracemalloc; inputs built beforehand)."""
    total_tokens = sum(len(p) + len(o) for p, o in reqs)
    pool = PagePool(total_tokens // page_size + 1024)
    fulls = [as_container(np.concatenate([p, o]), "array") for p, o in reqs]
    page_lists = []
    for full in fulls:
        n = len(full) // page_size
        page_lists.append((full[: n * page_size], n))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = RadixCache(pool, page_size=page_size)
    for tokens, n in page_lists:
        m = cache.match_prefix(tokens)
        new = cache.alloc(n - len(m.pages))
        cache.insert(tokens, m.pages + new)
        del m, new
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    # Live blocks allocated by the trie's code (nodes, keys, page lists, child dicts, the
    # eviction index); the pool's own free list and the page-id ints it holds are not counted.
    snap = tracemalloc.take_snapshot().filter_traces(
        [
            tracemalloc.Filter(True, "*radixkv/cache/*"),
            tracemalloc.Filter(False, "*radixkv/cache/page_pool.py"),
        ]
    )
    tracemalloc.stop()
    trie_bytes = sum(st.size for st in snap.statistics("filename"))
    cached_tokens = cache.num_cached_pages * page_size
    return {
        "trie_bytes": trie_bytes,
        "process_delta_bytes": after - before,
        "cached_tokens": cached_tokens,
        "bytes_per_token": trie_bytes / max(cached_tokens, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workload, for smoke tests")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat", type=int, default=3, help="replays per setting; the fastest is reported"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="JSON path (default bench/results/bench_cache.json; --quick writes none)",
    )
    args = ap.parse_args(argv)
    load_at_start = load_average()  # other processes' load skews wall-clock timings
    groups, prompts = (8, 4) if args.quick else (64, 16)
    cfg = dict(groups=groups, prompts=prompts, sys_len=2048, q_len=128, out_len=256, vocab=150_000)
    reqs = make_workload(**cfg, seed=args.seed)
    ideal = (groups * (prompts - 1) * cfg["sys_len"]) / (
        groups * prompts * (cfg["sys_len"] + cfg["q_len"])
    )
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    results: dict[str, Any] = {}
    rows = []
    for ps in page_sizes:
        kinds = ["array", "list"] if ps == 16 else ["array"]
        for kind in kinds:
            # Best of N replays: the machine is shared, so the fastest replay is the one
            # least disturbed by other processes (every replay does identical work).
            runs = [run_one(reqs, ps, kind) for _ in range(max(1, args.repeat))]
            r = min(runs, key=lambda x: x["match_us"]["mean_clean"] + x["insert_us"]["mean_clean"])
            r["replays"] = len(runs)
            if kind == "array":
                r["metadata"] = metadata_bytes(reqs, ps)
            results[f"ps{ps}_{kind}"] = r
            rows.append((ps, kind, r))

    hdr = (
        f"{'page':>4} {'input':>5} | {'match mean/p99 us':>18} | {'insert mean/p99 us':>18} | "
        f"{'lock+unlock us':>15} | {'evict us/page':>14} | {'hit':>5} | {'B/token':>7} | nodes"
    )
    print(f"radix cache bench: {groups} groups x {prompts} prompts, ideal hit rate {ideal:.3f}")
    print("means leave out preemptions by other processes (see stats_us); raw means in the JSON")
    print(hdr)
    print("-" * len(hdr))
    for ps, kind, r in rows:
        meta = r.get("metadata", {}).get("bytes_per_token")
        print(
            f"{ps:>4} {kind:>5} | {r['match_us']['mean_clean']:8.2f} / {r['match_us']['p99']:7.2f} | "
            f"{r['insert_us']['mean_clean']:8.2f} / {r['insert_us']['p99']:7.2f} | "
            f"{r['lock_unlock_us']['mean_clean']:6.2f} / {r['lock_unlock_us']['p99']:6.2f} | "
            f"{r['evict_us_per_page']['mean_clean']:5.3f} / {r['evict_us_per_page']['p99']:6.3f} | "
            f"{r['hit_rate']:.3f} | {meta if meta is None else f'{meta:7.2f}'} | {r['num_nodes']}"
        )
    ref = results.get("ps16_array")
    verdict = {}
    if ref is not None:
        got = {
            "match_us": ref["match_us"]["mean_clean"],
            "insert_us": ref["insert_us"]["mean_clean"],
            "evict_us_per_page": ref["evict_us_per_page"]["mean_clean"],
            "bytes_per_token": ref["metadata"]["bytes_per_token"],
        }
        verdict = {
            k: {"value": got[k], "target": t, "met": got[k] <= t} for k, t in TARGETS_PS16.items()
        }
        print("targets at page_size 16 (array('q') input):")
        for k, v in verdict.items():
            print(
                f"  {k:<18} {v['value']:8.3f}  <= {v['target']:<5}  {'ok' if v['met'] else 'MISSED'}"
            )
    summary = [
        {
            "page_size": ps,
            "input": kind,
            "match_mean_us": r["match_us"]["mean_clean"],
            "match_p99_us": r["match_us"]["p99"],
            "insert_mean_us": r["insert_us"]["mean_clean"],
            "insert_p99_us": r["insert_us"]["p99"],
            "lock_unlock_mean_us": r["lock_unlock_us"]["mean_clean"],
            "lock_unlock_p99_us": r["lock_unlock_us"]["p99"],
            "evict_mean_us_per_page": r["evict_us_per_page"]["mean_clean"],
            "evict_p99_us_per_page": r["evict_us_per_page"]["p99"],
            "hit_rate": r["hit_rate"],
            "metadata_bytes_per_token": r.get("metadata", {}).get("bytes_per_token"),
            "nodes": r["num_nodes"],
        }
        for ps, kind, r in rows
    ]
    out = {
        "benchmark": "bench_cache",
        "date": utc_now(),
        "summary": summary,
        "workload": {
            **cfg,
            "requests": groups * prompts,
            "ideal_hit_rate": ideal,
            "quick": args.quick,
        },
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {load_at_start:.1f} at start",
        "results": results,
        "targets_ps16": verdict,
    }
    if args.quick and not args.out:
        return 0  # a smoke run does not overwrite the full results
    write_json(args.out or results_path("bench_cache"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
