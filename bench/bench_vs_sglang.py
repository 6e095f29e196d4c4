"""radixkv's RadixCache against SGLang's own radix caches, side by side in one run.

The trace is bench_cache.py's: SGLang's generated-shared-prefix workload, 64 groups x 16
prompts (1,024 requests, shuffled), 2,048-token system prompt per group, a 128-token question
and 256 output tokens per request, page size 16. Each request runs a scheduler's flow on each
cache: match the prompt, lock the match, insert prompt + output (page-aligned) with KV slots
for the uncached rest, unlock. Three caches replay it, interleaved request by request (the
order goes through every permutation of the caches, so a noisy moment hits all three alike,
and each runs right after each other equally often: a radixkv runs about 10% faster right
after another radixkv, warm from the same Python code, which rotations alone left lopsided):

* radixkv: ``RadixCache.match_prefix(tokens)`` / ``insert(tokens, pages)``;
* SGLang Python: SGLang's pure-Python ``RadixCache`` (radix_cache.py of the wheel);
* SGLang Rust: SGLang's production tree core, a Rust crate, called straight through its PyO3
  binding (``RustUnifiedTreeCoreBinding.match_prefix`` / ``insert``), without the Python
  adapter and ``UnifiedRadixCache`` layers SGLang's server puts on top of it.

Same work: every cache gets the same ``array('q')`` token keys and slot lists, built before
any timing; KV events are off in all three (radixkv has no listener), so none computes page
hashes; each insert detects the pages already cached (radixkv frees them into its pool,
SGLang returns them for its allocator to free). The walk results are checked equal: every
request matches the same number of tokens in all three. All three matches return the matched
node and length; the prefix's pages (KV slots) take one more step in each: reading
``MatchResult.pages`` in radixkv (built on first read), a second call in SGLang's two. The
third op, ``match+slots``, times match plus that step in all three. What each call does
beyond that is listed in docs/benchmarks.md (the section's notes).

Timing: ``perf_counter_ns`` around each call; the replay is repeated ``--repeat`` times with
fresh caches, the GC is off while timing (collected between replays), and each request's op
time is the minimum over the repeats (min-of-N: a preemption by another process on this shared
machine only ever adds time); mean and p99 are then over the 1,024 requests. The median over
repeats of each replay's plain mean is reported too.

    python bench/bench_vs_sglang.py            # downloads sglang's wheel once (~40 MB)
    python bench/bench_vs_sglang.py --quick    # 8 groups x 4 prompts, prints only

``--chat`` replays chat streams instead, at page size ``--page-size`` (1 by default,
SGLang's) and each of ``--sizes`` cached tokens (1K, 10K, 100K, 1M): conversations on a
shared system prompt whose turns extend the conversation so far (ChatTrace), in batches
whose answers' pages are allocated one decode step at a time across the batch, as in an
engine, so a request's pages are not one run. The caches are warmed to the size untimed,
then match and insert are timed per request; results go to
bench/results/bench_vs_sglang_chat_ps<page>.json. ``--base DIR`` adds another checkout's
radixkv/cache (a worktree of main, say) as a fourth cache in the same run, for before/after
rows (both modes).

    python bench/bench_vs_sglang.py --chat --page-size 1 --base ../main-checkout

Not part of CI (it downloads); ``nox -s bench_vs_sglang`` runs it and rebuilds the report.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import platform
import time
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import sglang_peer
from bench_cache import make_workload
from peerkit import load_average, results_path, utc_now, write_json

from radixkv.cache import PagePool, RadixCache

PAGE = 16
NAMES = ("radixkv", "sglang_python", "sglang_rust")
OPS = ("match", "insert", "match+slots")  # targets are on the first two
TARGETS = {"sglang_python": 3.0, "sglang_rust": 1.0}  # required peer time / radixkv time


class Trace:
    """The requests' keys, built once before any timing."""

    def __init__(self, reqs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.prompts: list[array] = []
        self.fulls: list[array] = []  # prompt + output, whole pages only
        for p, o in reqs:
            full = np.concatenate([p, o])
            full = full[: len(full) // PAGE * PAGE]
            self.prompts.append(array("q", p.tobytes()))
            self.fulls.append(array("q", full.tobytes()))

    def __len__(self) -> int:
        return len(self.prompts)


class RadixKV:
    """radixkv's RadixCache; KV slots are its page ids."""

    def __init__(
        self, trace: Trace, page: int = PAGE, num_pages: int | None = None, impl: Any = None
    ) -> None:
        if num_pages is None:
            num_pages = sum(len(f) for f in trace.fulls) // page + 1024
        pool_cls, cache_cls = (PagePool, RadixCache) if impl is None else impl
        self.pool = pool_cls(num_pages)
        self.cache = cache_cls(self.pool, page_size=page)
        self.trace = trace

    def match(self, i: int) -> Any:
        return self.cache.match_prefix(self.trace.prompts[i])

    def matched(self, m: Any) -> int:
        return m.num_tokens

    def slots(self, m: Any) -> Any:
        return m.pages  # built here, on first read

    def prepare_insert(self, i: int, m: Any, slots: Any) -> Any:
        assert len(slots) * PAGE == m.num_tokens
        self.cache.lock(m.node)
        full = self.trace.fulls[i]
        new = self.cache.alloc(len(full) // PAGE - len(slots))
        return (full, slots + new, m)

    def insert(self, args: Any) -> Any:
        return self.cache.insert(args[0], args[1])

    def finish(self, args: Any, r: Any) -> None:
        self.cache.unlock(args[2].node)

    def check(self) -> None:
        self.cache.check_invariants()


class SGLangPython:
    """SGLang's pure-Python RadixCache; KV slots are token-level int64 tensors (as in SGLang).

    Keys are wrapped in RadixKey and the call parameters built outside timing (they hold
    references only); the slot tensor for an insert is the matched prefix's slots plus fresh
    ones, built outside timing too.
    """

    def __init__(self, trace: Trace, rc: Any, bp: Any, page: int = PAGE) -> None:
        import torch

        self.torch = torch
        self.rc, self.bp = rc, bp
        self.cache = rc.RadixCache.create_simulated(page_size=page)
        self.trace = trace
        self.next_slot = 0
        self.mparams = [bp.MatchPrefixParams(key=rc.RadixKey(p)) for p in trace.prompts]

    def match(self, i: int) -> Any:
        return self.cache.match_prefix(self.mparams[i])

    def matched(self, m: Any) -> int:
        return m.device_prefix_len

    def slots(self, m: Any) -> Any:
        return self.cache.path_device_indices(m.last_device_node)[: m.device_prefix_len]

    def prepare_insert(self, i: int, m: Any, prefix: Any) -> Any:
        assert len(prefix) == m.device_prefix_len
        torch = self.torch
        node = m.last_device_node
        self.cache.inc_lock_ref(node)
        full = self.trace.fulls[i]
        n_new = len(full) - m.device_prefix_len
        fresh = torch.arange(self.next_slot, self.next_slot + n_new, dtype=torch.int64)
        self.next_slot += n_new
        params = self.bp.InsertParams(key=self.rc.RadixKey(full), value=torch.cat([prefix, fresh]))
        return (params, node)

    def insert(self, args: Any) -> Any:
        return self.cache.insert(args[0])

    def finish(self, args: Any, r: Any) -> None:
        self.cache.dec_lock_ref(args[1])

    def check(self) -> None:
        assert self.cache.protected_size() == 0


class SGLangRust:
    """SGLang's Rust tree core through its PyO3 binding; KV slots as for SGLang Python.

    The binding's parameter objects are built inside timing: the key is handed to the core
    there (as radixkv's encoding of the query is part of its calls).
    """

    def __init__(self, trace: Trace, rs: Any, page: int = PAGE) -> None:
        import torch

        self.torch = torch
        self.rs = rs
        init = rs.TreeCoreInitParamsBinding(eviction_policy="lru", page_size=page, device="cpu")
        self.core = rs.RustUnifiedTreeCoreBinding(init, [0])  # ComponentType.FULL only
        self.root = self.core.root_node_handle()
        self.trace = trace
        self.next_slot = 0
        self.MatchParams = rs.MatchParamsBinding
        self.InsertParams = rs.InsertParamsBinding

    def match(self, i: int) -> Any:
        return self.core.match_prefix(self.MatchParams(key=self.trace.prompts[i]))

    def matched(self, m: Any) -> int:
        return m.device_prefix_len

    def slots(self, m: Any) -> Any:
        return self.core.collect_full_device_indices(m.last_device_node_id, self.root)

    def prepare_insert(self, i: int, m: Any, prefix: Any) -> Any:
        assert len(prefix) == m.device_prefix_len
        torch = self.torch
        node = m.last_device_node_id
        receipt = self.core.inc_lock_ref(node)
        full = self.trace.fulls[i]
        n_new = len(full) - m.device_prefix_len
        fresh = torch.arange(self.next_slot, self.next_slot + n_new, dtype=torch.int64)
        self.next_slot += n_new
        return (full, torch.cat([prefix, fresh]), node, receipt)

    def insert(self, args: Any) -> Any:
        return self.core.insert(self.InsertParams(key=args[0], value=args[1]))

    def finish(self, args: Any, r: Any) -> None:
        receipt = args[3]
        self.core.dec_lock_ref(
            args[2],
            self.rs.DecLockRefParamsBinding(
                node_id=receipt.node_id,
                skipped_lock_components=list(receipt.skipped_lock_components),
                component_lock_uuids=dict(receipt.component_lock_uuids),
                component_host_lock_uuids=dict(receipt.component_host_lock_uuids),
            ),
        )

    def check(self) -> None:
        assert self.core.protected_size() == 0


# ----------------------------------------------------------------------------- chat streams
CHAT_SYSTEM = 256  # tokens of the system prompt every conversation starts with
CHAT_TURNS = 12  # turns per conversation; then it ends and a new one starts
CHAT_BATCH = 8  # sequences decoding together (real turns plus stand-ins)
CHAT_CONV_TOKENS = 2048  # one live conversation per this many cached tokens


class ChatTrace:
    """One chat-shaped stream: conversations whose turns extend the previous turn's full text.

    ``max(1, size // CHAT_CONV_TOKENS)`` conversations are live at once, each starting with
    the shared system prompt; a turn adds a user message of 16-64 tokens and an answer of
    32-128 (so a prompt is the conversation so far, up to ~2.5K tokens, whatever the size);
    after CHAT_TURNS turns a conversation ends and a new one starts. Requests come in batches
    of up to CHAT_BATCH distinct conversations. The stream warms the caches until they hold
    ``size`` tokens (untimed), then ``timed`` batches are timed: the cache grows by about a
    quarter of ``size`` while timed (at least one batch).
    """

    def __init__(self, size: int, page: int, seed: int, vocab: int = 150_000) -> None:
        rng = np.random.default_rng(seed)
        system = rng.integers(0, vocab, CHAT_SYSTEM, dtype=np.int64)
        nconv = max(1, size // CHAT_CONV_TOKENS)
        convs: list[list[Any]] = [[system, 0] for _ in range(nconv)]  # history, turns
        self.prompts: list[array] = []
        self.fulls: list[array] = []
        self.batches: list[list[int]] = []
        cached = 0  # tokens the caches will hold (an estimate: shared prefixes count once)
        seen_system = False
        timed_tokens = 0
        self.first_timed = -1
        while True:
            pick = rng.choice(nconv, size=min(CHAT_BATCH, nconv), replace=False)
            batch = []
            for c in pick:
                hist, turns = convs[c]
                q = rng.integers(0, vocab, int(rng.integers(16, 65)), dtype=np.int64)
                o = rng.integers(0, vocab, int(rng.integers(32, 129)), dtype=np.int64)
                prompt = np.concatenate([hist, q])
                full = np.concatenate([prompt, o])
                whole = len(full) // page * page
                added = whole - (len(hist) // page * page if turns else 0)
                if not turns and seen_system:
                    added -= CHAT_SYSTEM // page * page
                seen_system = True
                if self.first_timed >= 0:
                    timed_tokens += added
                else:
                    cached += added
                batch.append(len(self.prompts))
                self.prompts.append(array("q", prompt.tobytes()))
                self.fulls.append(array("q", full[:whole].tobytes()))
                convs[c] = [full, turns + 1] if turns + 1 < CHAT_TURNS else [system, 0]
            self.batches.append(batch)
            if self.first_timed < 0 and cached >= size:
                self.first_timed = len(self.batches)
            elif (
                self.first_timed >= 0
                and timed_tokens >= size // 4
                and len(self.prompts) - self.batches[self.first_timed][0] >= 8
            ):
                break
        self.size = size
        self.page = page

    def __len__(self) -> int:
        return len(self.prompts)


class ChatRadixKV(RadixKV):
    """radixkv on a chat stream: the pages of a batch's answers are allocated one decode step
    at a time across the batch (stand-in sequences fill a batch to CHAT_BATCH and free their
    pages after it), so a request's pages interleave with other sequences' as in an engine."""

    def __init__(self, trace: ChatTrace, impl: Any = None) -> None:
        page = trace.page
        total = sum(len(f) for f in trace.fulls) // page
        super().__init__(trace, page, total + 64 * CHAT_BATCH + 1024, impl)  # type: ignore[arg-type]
        self.page = page

    def alloc_batch(self, batch: list[int], matches: list[Any]) -> list[list[int]]:
        """Every request's whole pages (matched prefix, prompt, answer), in decode order."""
        page = self.page
        alloc = self.cache.alloc
        pages: list[list[int]] = []
        need: list[int] = []
        for i, m in zip(batch, matches):
            self.cache.lock(m.node)
            nfull = len(self.trace.fulls[i]) // page
            nprompt = min(-(-len(self.trace.prompts[i]) // page), nfull)
            own = m.pages + alloc(max(0, nprompt - len(m.pages)))
            pages.append(own)
            need.append(nfull - len(own))
        stand_ins: list[int] = []
        extra = CHAT_BATCH - len(batch)
        for _ in range(max(need, default=0)):
            for j, own in enumerate(pages):
                if need[j] > 0:
                    own += alloc(1)
                    need[j] -= 1
            for _ in range(extra):
                stand_ins += alloc(1)
        self.cache.pool.free(stand_ins)
        return pages


def load_base(checkout: Path) -> tuple[Any, Any]:
    """(PagePool, RadixCache) of another checkout's radixkv/cache (say, main's), imported as
    a package of its own beside this checkout's radixkv, for before/after rows in one run."""
    import importlib
    import shutil
    import sys
    import tempfile

    src = checkout / "radixkv" / "cache"
    if not src.is_dir():
        raise SystemExit(f"--base: no radixkv/cache under {checkout}")
    tmp = Path(tempfile.mkdtemp(prefix="radixkv-base-"))
    dst = tmp / "radixkv_base_cache"
    shutil.copytree(src, dst)
    for f in dst.rglob("*.py"):
        f.write_text(f.read_text().replace("radixkv.cache", "radixkv_base_cache"))
    sys.path.insert(0, str(tmp))
    mod = importlib.import_module("radixkv_base_cache")
    return mod.PagePool, mod.RadixCache


def _slots(pages: list[int], page: int, torch: Any) -> Any:
    t = torch.tensor(pages, dtype=torch.int64)
    if page == 1:
        return t
    return (t[:, None] * page + torch.arange(page, dtype=torch.int64)).reshape(-1)


def chat_replay(
    trace: ChatTrace, rc: Any, bp: Any, rs: Any, rotation: int, base: Any = None
) -> tuple[dict[str, dict[str, list[int]]], int]:
    """One replay of a chat stream on fresh caches; per cache and op the timed requests' call
    times (ns), and the tokens radixkv held when timing began."""
    import torch

    page = trace.page
    rkv = ChatRadixKV(trace)
    spy = SGLangPython(trace, rc, bp, page) if rc is not None else None
    srs = SGLangRust(trace, rs, page) if rs is not None else None
    rkb = ChatRadixKV(trace, base) if base is not None else None
    peers = {"radixkv": rkv, "radixkv_base": rkb, "sglang_python": spy, "sglang_rust": srs}
    names = [n for n, p in peers.items() if p is not None]
    # Every order of the caches in turn, not only rotations: a cache runs faster right after
    # one that ran the same Python code (warm instruction caches and branch predictors; about
    # 10% for a radixkv right after another radixkv), so each must follow each equally often.
    perms = list(itertools.permutations(names))
    times: dict[str, dict[str, list[int]]] = {n: {"match": [], "insert": []} for n in names}
    clock = time.perf_counter_ns
    held_at_start = 0
    gc.collect()
    gc.disable()
    try:
        for b, batch in enumerate(trace.batches):
            timed = b >= trace.first_timed
            if b == trace.first_timed:
                held_at_start = rkv.cache.num_cached_pages * page
            order = perms[perm_index(b, rotation, len(names))]
            matches: dict[str, list[Any]] = {}
            for name in order:
                peer = peers[name]
                ms = []
                for i in batch:
                    t0 = clock()
                    m = peer.match(i)
                    t1 = clock()
                    ms.append(m)
                    if timed:
                        times[name]["match"].append(t1 - t0)
                matches[name] = ms
            ref = [m.num_tokens for m in matches["radixkv"]]
            for name in names:
                got = [
                    m.num_tokens if name.startswith("radixkv") else m.device_prefix_len
                    for m in matches[name]
                ]
                if got != ref:
                    raise AssertionError(f"batch {b}: radixkv matched {ref}, {name} {got}")
            # the radixkv pools allocate in the timing order too (the pages are the same)
            args: dict[str, list[Any]] = {}
            for name in order:
                if name.startswith("radixkv"):
                    ms = matches[name]
                    own_pages = peers[name].alloc_batch(batch, ms)
                    args[name] = [
                        (trace.fulls[i], own, m) for i, m, own in zip(batch, ms, own_pages)
                    ]
            pages = [a[1] for a in args["radixkv"]]
            if rkb is not None and [a[1] for a in args["radixkv_base"]] != pages:
                raise AssertionError(f"batch {b}: the base checkout allocated other pages")
            slots = [_slots(own, page, torch) for own in pages]
            if spy is not None:
                args["sglang_python"] = []
                for i, m, v in zip(batch, matches["sglang_python"], slots):
                    node = m.last_device_node
                    spy.cache.inc_lock_ref(node)
                    p = bp.InsertParams(key=rc.RadixKey(trace.fulls[i]), value=v)
                    args["sglang_python"].append((p, node))
            if srs is not None:
                args["sglang_rust"] = []
                for i, m, v in zip(batch, matches["sglang_rust"], slots):
                    node = m.last_device_node_id
                    receipt = srs.core.inc_lock_ref(node)
                    args["sglang_rust"].append((trace.fulls[i], v, node, receipt))
            for name in order:
                peer = peers[name]
                for a in args[name]:
                    t0 = clock()
                    r = peer.insert(a)
                    t1 = clock()
                    if timed:
                        times[name]["insert"].append(t1 - t0)
                    peer.finish(a, r)
    finally:
        gc.enable()
    for name in names:
        peers[name].check()
    return times, held_at_start


def run_chat(args: Any, rc: Any, bp: Any, rs: Any) -> dict[str, Any]:
    """The chat streams at every size; prints a table, returns the JSON section."""
    out: dict[str, Any] = {}
    base = load_base(args.base) if args.base is not None else None
    print(
        f"chat stream, page {args.page_size}: match and insert per request (us, per-request "
        f"min over {args.repeat} replays, then mean); ratios: peer / radixkv"
    )
    print(f"{'size':>8} {'held':>8} {'reqs':>5} {'op':>6} | {'radixkv':>8} | {'base':>8} | "
          f"{'SGL py':>8} | {'SGL rust':>8} | {'rust/rkv':>8} | {'base/rkv':>8}")  # fmt: skip
    for size in args.sizes:
        trace = ChatTrace(size, args.page_size, args.seed)
        samples: dict[str, dict[str, list[list[int]]]] = {}
        held = 0
        for r in range(max(1, args.repeat)):
            times, held = chat_replay(trace, rc, bp, rs, r, base)
            for n, ops in times.items():
                for op, v in ops.items():
                    samples.setdefault(n, {}).setdefault(op, []).append(v)
        stats = {n: {op: summarize(v) for op, v in ops.items()} for n, ops in samples.items()}
        ntimed = sum(len(b) for b in trace.batches[trace.first_timed :])
        for op in ("match", "insert"):
            cols = ("radixkv", "radixkv_base", "sglang_python", "sglang_rust")
            row = [stats[n][op]["mean"] if n in stats else float("nan") for n in cols]
            print(
                f"{size:>8} {held:>8} {ntimed:>5} {op:>6} | {row[0]:8.2f} | {row[1]:8.2f} | "
                f"{row[2]:8.2f} | {row[3]:8.2f} | {row[3] / row[0]:7.2f}x | "
                f"{row[1] / row[0]:7.2f}x"
            )
        out[str(size)] = {"held_tokens_at_start": held, "timed_requests": ntimed, "us": stats}
    return out


def perm_index(i: int, rotation: int, n: int) -> int:
    """Which of the ``n!`` orders (itertools.permutations, lexicographic) step ``i`` of replay
    ``rotation`` runs: over ``n`` replays each cache comes first once at every step (the
    orders that start with a given cache are consecutive there), and further replays shift
    to the next orders."""
    total = math.factorial(n)
    return (i + (rotation % n) * (total // n) + rotation // n) % total


def replay(trace: Trace, peers: dict[str, Any], rotation: int) -> dict[str, dict[str, list[int]]]:
    """One interleaved replay; per cache, per op, the time of every request's call (ns)."""
    clock = time.perf_counter_ns
    names = list(peers)
    perms = list(itertools.permutations(names))  # each cache after each other (chat_replay)
    times = {n: {op: [0] * len(trace) for op in OPS} for n in names}
    matched: dict[str, list[int]] = {n: [0] * len(trace) for n in names}
    gc.collect()
    gc.disable()
    try:
        for i in range(len(trace)):
            for name in perms[perm_index(i, rotation, len(names))]:
                peer = peers[name]
                t0 = clock()
                m = peer.match(i)
                t1 = clock()
                slots = peer.slots(m)
                t2 = clock()
                args = peer.prepare_insert(i, m, slots)
                t3 = clock()
                r = peer.insert(args)
                t4 = clock()
                peer.finish(args, r)
                times[name]["match"][i] = t1 - t0
                times[name]["match+slots"][i] = t2 - t0
                times[name]["insert"][i] = t4 - t3
                matched[name][i] = peer.matched(m)
    finally:
        gc.enable()
    ref = matched[names[0]]
    for n in names[1:]:
        if matched[n] != ref:
            bad = next(i for i, (a, b) in enumerate(zip(ref, matched[n])) if a != b)
            raise AssertionError(
                f"request {bad}: {names[0]} matched {ref[bad]} tokens, {n} {matched[n][bad]}"
            )
    for p in peers.values():
        p.check()
    return times


def summarize(samples: list[list[int]]) -> dict[str, float]:
    """Per request the minimum over repeats; mean, p50, p99 over requests (us)."""
    a = np.asarray(samples, dtype=np.float64) / 1e3  # repeats x requests
    best = a.min(axis=0)
    return {
        "mean": float(best.mean()),
        "p50": float(np.percentile(best, 50)),
        "p99": float(np.percentile(best, 99)),
        "median_replay_mean": float(np.median(a.mean(axis=1))),
    }


def timer_overhead_ns(n: int = 200_000) -> float:
    clock = time.perf_counter_ns
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(n):
            clock()
        best = min(best, (clock() - t0) / n)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 groups x 4 prompts, prints only")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved replays (min-of-N)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sglang-version", default=sglang_peer.SGLANG_VERSION)
    ap.add_argument("--cache-dir", type=Path, default=sglang_peer.DEFAULT_CACHE)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/...)")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="chat streams at --sizes cached tokens instead of the shared-prefix trace",
    )
    ap.add_argument("--page-size", type=int, default=1, help="page size of --chat")
    ap.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1_000, 10_000, 100_000, 1_000_000],
        help="cached tokens of --chat, comma-separated",
    )
    ap.add_argument("--no-sglang-python", action="store_true", help="--chat without it")
    ap.add_argument(
        "--base",
        type=Path,
        default=None,
        help="--chat: also time this checkout's radixkv/cache (e.g. a worktree of main)",
    )
    args = ap.parse_args(argv)
    load_at_start = load_average()

    wheel = sglang_peer.fetch_wheel(args.sglang_version, args.cache_dir)
    root = sglang_peer.extract(wheel, args.cache_dir)
    rc = sglang_peer.load_python_cache(root)
    bp = sglang_peer.load_python_params(root)
    rs = sglang_peer.load_rust_core(root)
    if args.chat:
        chat = run_chat(args, None if args.no_sglang_python else rc, bp, rs)
        if args.quick and not args.out:
            return 0
        out = {
            "benchmark": "bench_vs_sglang_chat",
            "date": utc_now(),
            "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}, load average {load_at_start:.1f} at start",
            "sglang": f"sglang {args.sglang_version} wheel ({wheel.name})",
            "page_size": args.page_size,
            "repeat": args.repeat,
            "sizes": chat,
        }
        name = f"bench_vs_sglang_chat_ps{args.page_size}"
        write_json(args.out or results_path(name), out)
        return 0

    groups, prompts = (8, 4) if args.quick else (64, 16)
    cfg = dict(groups=groups, prompts=prompts, sys_len=2048, q_len=128, out_len=256, vocab=150_000)
    trace = Trace(make_workload(**cfg, seed=args.seed))

    base = load_base(args.base) if args.base is not None else None
    names = (*NAMES, "radixkv_base") if base is not None else NAMES
    samples: dict[str, dict[str, list[list[int]]]] = {n: {op: [] for op in OPS} for n in names}
    cpu0 = time.process_time()
    for r in range(max(1, args.repeat)):
        peers = {
            "radixkv": RadixKV(trace),
            "sglang_python": SGLangPython(trace, rc, bp),
            "sglang_rust": SGLangRust(trace, rs),
        }
        if base is not None:
            peers["radixkv_base"] = RadixKV(trace, impl=base)
        times = replay(trace, peers, rotation=r)
        for n in names:
            for op in OPS:
                samples[n][op].append(times[n][op])
        del peers
    cpu = time.process_time() - cpu0

    stats = {n: {op: summarize(samples[n][op]) for op in OPS} for n in names}
    rows = []
    for op in OPS:
        for stat in ("mean", "p99"):
            mine = stats["radixkv"][op][stat]
            row: dict[str, Any] = {"op": op, "stat": stat, "radixkv_us": mine}
            for peer in NAMES[1:]:
                row[f"{peer}_us"] = stats[peer][op][stat]
            for peer in NAMES[1:]:
                row[f"vs_{peer}"] = stats[peer][op][stat] / mine
            rows.append(row)
    verdict = {
        f"{r['op']}_{r['stat']}_vs_{peer}": {
            "ratio": r[f"vs_{peer}"],
            "target": t,
            "met": r[f"vs_{peer}"] >= t,
        }
        for r in rows
        if r["op"] != "match+slots"
        for peer, t in TARGETS.items()
    }

    print(
        f"radixkv vs SGLang {args.sglang_version}: {groups} groups x {prompts} prompts, page "
        f"{PAGE}, {args.repeat} interleaved replays (per-request min), times in us"
    )
    hdr = f"{'op':>11} {'stat':>4} | {'radixkv':>8} | {'SGL py':>8} | {'SGL rust':>8} | "
    print(hdr + f"{'py/rkv':>7} | {'rust/rkv':>8}")
    for r in rows:
        print(
            f"{r['op']:>11} {r['stat']:>4} | {r['radixkv_us']:8.2f} | {r['sglang_python_us']:8.2f} | "
            f"{r['sglang_rust_us']:8.2f} | {r['vs_sglang_python']:6.2f}x | "
            f"{r['vs_sglang_rust']:7.2f}x"
        )
    for k, v in verdict.items():
        print(f"  {k:<32} {v['ratio']:5.2f}x >= {v['target']}x  {'ok' if v['met'] else 'MISSED'}")
    if base is not None:
        for op in OPS:
            b, a = stats["radixkv_base"][op]["mean"], stats["radixkv"][op]["mean"]
            print(f"  {op:>11} mean: base {b:.2f} us, this checkout {a:.2f} us: {b / a:.2f}x")

    out = {
        "benchmark": "bench_vs_sglang",
        "date": utc_now(),
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {load_at_start:.1f} at start",
        "sglang": f"sglang {args.sglang_version} wheel ({wheel.name})",
        "method": (
            f"perf_counter_ns per call; {args.repeat} interleaved replays with fresh caches, "
            "GC off while timing; per request the minimum over replays, then mean / p99 over "
            f"requests; timer overhead {timer_overhead_ns():.0f} ns per call, not subtracted"
        ),
        "summary": rows,
        "workload": {
            **cfg,
            "page_size": PAGE,
            "requests": len(trace),
            "input": "array('q') keys built before timing",
        },
        "detail_us": stats,
        "targets": verdict,
        "cpu_seconds_all_replays": cpu,
    }
    if args.quick and not args.out:
        return 0
    write_json(args.out or results_path("bench_vs_sglang"), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
