"""Cascade (shared-prefix) decode attention vs plain paged decode, on the torch backend (CPU).

Part 1, attention only: B requests share a P-token prefix (one trie node) and each has S unique
tokens; one decode step's attention for one layer, on radixkv-tiny's head shape by default (one
query head, one KV head of 64 dims). The plain baseline is the model's torch backend decode
(``TorchAttention``: a batched gather of every request's pages plus SDPA), the same code the
engine runs without cascade. Cascade is the plan the engine's planner builds, run by
``TorchCascadeAttention``. Both include writing the step's new K/V into the pool. Reported beside
the ideal bytes ratio ``(B*P + sum S) / (P + sum S)``, and whether ``cascade="auto"`` picks the
faster of the two (``auto_right``).

Part 2, end to end: a tree-of-thought workload on radixkv-tiny: one shared prompt, N branches
(each the prompt + a few tokens of its own) decoding greedily; decode time with the engine's
cascade off vs ``auto``. The two engines run the same workload in lockstep, one step each in
turn (which goes first alternates), so load from other processes on a shared machine hits both
alike; the whole workload is repeated ``--e2e-reps`` times and the speedup is the median of the
repetitions' ratios of summed decode-step times.

``--dtype bfloat16`` runs both parts in bf16 (the KV pool, and end to end the model too: what
``dtype="auto"`` picks on a CPU with bf16 matrix units) and writes bench_cascade_bf16.json. In
fp32 the two sides' greedy outputs are identical; in bf16 they agree until a near tie between two
logits that the two summation orders round apart (``outputs_equal`` counts whole outputs equal).

Timing: every repetition times both sides back to back (alternating which goes first); the
statistic is the median over repetitions (``--timer cpu``: one thread and that thread's CPU time,
which other processes cannot inflate by taking the CPU away). On a small shared VM one
configuration's times also vary between processes (up to 20% on 2 cores: how the OpenMP worker
is woken between kernels), so the issue's point, B=32 on a 4,096-token prefix, is also run
alone in ``--headline-procs`` fresh processes (``headline``: every process's speedup and their
median).

    python bench/bench_cascade.py [--quick] [--dtype float32|bfloat16] [--out FILE]
        [--headline-procs N] [--only B,P]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peerkit import load_average, results_path, write_json

from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention
from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry


class _Node:
    """A one-node trie path (root -> prompt node) for the attention-only part."""

    def __init__(self, num_tokens: int) -> None:
        self.parent = None
        self.num_tokens = num_tokens


# wall clock by default; ``--timer cpu`` runs on one thread and counts that thread's CPU time,
# which other processes on a shared machine cannot inflate (scheduling waits are not counted)
TIMER: Callable[[], float] = time.perf_counter


def _time_pair(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Medians over ``reps`` repetitions, each timing ``a`` and ``b`` back to back (which goes
    first alternates): interleaved, so load from other processes hits both alike."""
    a()  # warm up
    b()
    ta, tb = [], []
    for i in range(reps):
        for fn, out in ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta)):
            t0 = TIMER()
            fn()
            out.append(TIMER() - t0)
    return statistics.median(ta), statistics.median(tb)


def _plain_backend(pool: Any, h_q: int, h_kv: int, d: int, tables, lens) -> Callable[..., Any]:
    """The model's torch backend decode, or the one-level cascade plan if it is missing."""
    try:
        from radixkv.attention.base import BatchLayout
        from radixkv.attention.torch_backend import TorchAttention
    except ImportError:
        attn = TorchCascadeAttention(CascadePlan.plain(tables, lens, pool.page_size), pool.device)
        return lambda q, k, v: attn(q, pool.k[0], pool.v[0])
    backend = TorchAttention(pool, h_q, h_kv, d)
    backend.plan(BatchLayout.build(tables, [n - 1 for n in lens], [1] * len(lens)))
    return lambda q, k, v: backend.forward(0, q, k, v)


def bench_attention(
    batch: int,
    prefix: int,
    suffix: int,
    h_q: int,
    h_kv: int,
    d: int,
    ps: int,
    reps: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    from radixkv.kv.kv_pool import KVPool

    n_shared = prefix // ps
    n_own = -(-suffix // ps)
    num_pages = n_shared + batch * n_own + 1
    pool = KVPool(1, num_pages, ps, h_kv, d, dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g))
    ids = list(range(num_pages))
    random.Random(0).shuffle(ids)  # realistic: pages of a sequence are not contiguous
    shared, rest = ids[:n_shared], ids[n_shared:]
    tables = [shared + rest[i * n_own : (i + 1) * n_own] for i in range(batch)]
    lens = [prefix + suffix] * batch
    node = _Node(prefix)
    entries = [DecodeEntry(node, t, n, n_shared) for t, n in zip(tables, lens)]
    decision = CascadePlanner(ps, mode="on").plan(entries)  # cascade whenever anything is shared
    # what the engine picks by default for this head shape (K+V values per token and layer)
    auto_min = CascadePlanner.min_step_tokens_for(2 * h_kv * d, dtype.itemsize)
    auto = CascadePlanner(ps, mode="auto", min_step_saved_tokens=auto_min).plan(entries)
    cascade = TorchCascadeAttention(decision.plan, "cpu")
    plain = _plain_backend(pool, h_q, h_kv, d, tables, lens)
    slots = torch.tensor([t[(n - 1) // ps] * ps + (n - 1) % ps for t, n in zip(tables, lens)])

    q = torch.randn(batch, h_q, d, generator=g).to(dtype)
    k_new = torch.randn(batch, h_kv, d, generator=g).to(dtype)
    v_new = torch.randn(batch, h_kv, d, generator=g).to(dtype)

    def run_cascade() -> torch.Tensor:
        pool.write(0, slots, k_new, v_new)
        return cascade(q, pool.k[0], pool.v[0])

    out_plain = plain(q, k_new, v_new)
    out_casc = run_cascade()
    err = (out_plain[list(decision.order)] - out_casc).abs().max().item()
    if decision.use_cascade:
        t_plain, t_casc = _time_pair(lambda: plain(q, k_new, v_new), run_cascade, reps)
    else:  # nothing shared (B=1): the engine runs plain decode
        t_plain, _ = _time_pair(lambda: plain(q, k_new, v_new), lambda: None, reps)
        t_casc = t_plain
    bytes_ratio = (batch * prefix + batch * suffix) / (prefix + batch * suffix)
    return {
        "batch": batch,
        "prefix_len": prefix,
        "suffix_len": suffix,
        "plain_ms": round(t_plain * 1e3, 3),
        "cascade_ms": round(t_casc * 1e3, 3),
        "speedup": round(t_plain / t_casc, 2),
        "bytes_ratio": round(bytes_ratio, 2),
        "auto_uses_cascade": auto.use_cascade,
        "speedup_auto": round(t_plain / t_casc, 2) if auto.use_cascade else 1.0,
        # auto chose the faster side (a tie within 5% is no wrong choice)
        "auto_right": auto.use_cascade == (t_casc < t_plain) or abs(t_plain / t_casc - 1) < 0.05,
        "kv_tokens_plain": decision.kv_tokens_plain,
        "kv_tokens_cascade": decision.kv_tokens_cascade,
        "max_abs_diff": err,
    }


def _e2e_engines(
    prompt: list[int], prompts: list[list[int]], params: Any, page_size: int, dtype: str
) -> dict[str, Any]:
    """Both engines with the trunk cached and every branch queued."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.loader import load_model

    lm = load_model("radixkv-tiny", dtype=dtype)
    engines = {}
    for mode in ("off", "auto"):
        eng = Engine(lm, page_size=page_size, cascade=mode, seed=0)
        eng.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # cache the trunk
        for p in prompts:
            eng.add_request(p, params, stream=False)
        engines[mode] = eng
    return engines


def bench_end_to_end(
    prompt_len: int, branches: int, unique: int, gen: int, page_size: int, reps: int, dtype: str
) -> dict[str, Any]:
    """Tree-of-thought: one shared prompt, ``branches`` greedy branches of ``gen`` tokens, each
    on the prompt + ``unique`` tokens of its own; off and auto in lockstep (module docstring)."""
    from radixkv.engine.params import SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
    prompts = [prompt + [rng.randrange(1, 250) for _ in range(unique)] for _ in range(branches)]
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    modes = ("off", "auto")
    rep_rows = []
    texts: dict[str, list[Any]] = {}
    stats: dict[str, Any] = {}
    for rep in range(reps):
        engines = _e2e_engines(prompt, prompts, params, page_size, dtype)
        t_decode = dict.fromkeys(modes, 0.0)
        steps = dict.fromkeys(modes, 0)
        tokens = dict.fromkeys(modes, 0)
        finished: dict[str, list[Any]] = {m: [] for m in modes}
        i = 0
        while any(e.has_unfinished() for e in engines.values()):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                eng = engines[mode]
                if not eng.has_unfinished():
                    continue
                before = eng.stats()
                t0 = TIMER()
                outs = eng.step()
                dt_ = TIMER() - t0
                after = eng.stats()
                if after.prefill_tokens_computed == before.prefill_tokens_computed:  # decode
                    t_decode[mode] += dt_
                    steps[mode] += 1
                    tokens[mode] += after.generated_tokens - before.generated_tokens
                finished[mode].extend(o for o in outs if o.finished)
            i += 1
        rep_rows.append(
            {
                "rep": rep,
                "decode_s_off": round(t_decode["off"], 4),
                "decode_s_auto": round(t_decode["auto"], 4),
                "decode_steps": steps["auto"],
                "speedup": round(t_decode["off"] / t_decode["auto"], 3),
            }
        )
        for mode in modes:  # by prompt: both engines got the same prompts in the same order
            texts[mode] = [
                tuple(o.token_ids) for o in sorted(finished[mode], key=lambda o: o.prompt_token_ids)
            ]
            stats[mode] = engines[mode].stats()
            stats[f"tok_{mode}"] = tokens[mode]
        print(
            f"  e2e rep {rep}: decode {t_decode['off']:.3f} s off, {t_decode['auto']:.3f} s "
            f"auto: {rep_rows[-1]['speedup']}x",
            flush=True,
        )
    med = {m: statistics.median(r[f"decode_s_{m}"] for r in rep_rows) for m in modes}
    st_auto = stats["auto"]
    return {
        "prompt_len": prompt_len,
        "branches": branches,
        "unique_tokens": unique,
        "gen_tokens": gen,
        "page_size": page_size,
        "reps": reps,
        "statistic": "median over repetitions of lockstep-interleaved runs",
        "decode_s_off": round(med["off"], 4),
        "decode_s_auto": round(med["auto"], 4),
        "decode_tok_per_s_off": round(stats["tok_off"] / med["off"], 1),
        "decode_tok_per_s_auto": round(stats["tok_auto"] / med["auto"], 1),
        "speedup": statistics.median(r["speedup"] for r in rep_rows),
        "speedup_min": min(r["speedup"] for r in rep_rows),
        "speedup_max": max(r["speedup"] for r in rep_rows),
        "cascade_steps_auto": st_auto.cascade_steps,
        "kv_bytes_ratio": round(
            st_auto.kv_bytes_read_plain / max(1, st_auto.kv_bytes_read_cascade), 2
        ),
        "outputs_identical": texts["auto"] == texts["off"],
        # greedy outputs equal token for token, of ``branches`` (bf16 rounds differently)
        "outputs_equal": sum(a == b for a, b in zip(texts["auto"], texts["off"], strict=True)),
        "repetitions": rep_rows,
    }


# the issue's attention-only point: 32 requests on a 4,096-token prefix
HEADLINE = (32, 4096)


def headline_in_processes(procs: int, dtype: str, timer: str) -> dict[str, Any]:
    """``HEADLINE`` run alone (``--only``) in ``procs`` fresh processes, one after another."""
    import subprocess
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(procs):
            out = Path(tmp) / f"p{i}.json"
            cmd = [sys.executable, __file__, "--only", f"{HEADLINE[0]},{HEADLINE[1]}"]
            cmd += ["--skip-e2e", "--dtype", dtype, "--timer", timer, "--out", str(out)]
            subprocess.run(cmd, check=True, capture_output=True)
            rows.append(json.loads(out.read_text())["attention"][0])
    speedups = [r["speedup"] for r in rows]
    return {
        "batch": HEADLINE[0],
        "prefix_len": HEADLINE[1],
        "processes": procs,
        "speedups": speedups,
        "median_speedup": statistics.median(speedups),
        "plain_ms": [r["plain_ms"] for r in rows],
        "cascade_ms": [r["cascade_ms"] for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer configurations and repetitions")
    ap.add_argument("--out", default=None, help="default bench/results/bench_cascade[_bf16].json")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="KV (and, end to end, model) dtype; radixkv-tiny's checkpoint is float32",
    )
    ap.add_argument("--heads", type=int, default=1, help="query heads (radixkv-tiny: 1)")
    ap.add_argument("--kv-heads", type=int, default=1, help="KV heads (radixkv-tiny: 1)")
    ap.add_argument("--head-dim", type=int, default=64, help="(radixkv-tiny: 64)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None, help="default 5 quick, 15 full")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument(
        "--headline-procs",
        type=int,
        default=None,
        help=f"fresh processes running B,P = {HEADLINE} alone (default 0 quick, 5 full)",
    )
    ap.add_argument("--only", default=None, help="B,P: run this grid point alone")
    ap.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: wall clock, torch's default threads; cpu: 1 thread, its CPU time",
    )
    ap.add_argument("--e2e-prompt", type=int, default=4096, help="shared prompt tokens")
    ap.add_argument("--e2e-branches", type=int, default=32, help="branches decoding together")
    ap.add_argument("--e2e-unique", type=int, default=8, help="tokens of each branch's own")
    ap.add_argument("--e2e-gen", type=int, default=48, help="greedy tokens per branch")
    ap.add_argument("--e2e-reps", type=int, default=None, help="default 1 quick, 5 full")
    args = ap.parse_args()
    global TIMER
    if args.timer == "cpu":
        torch.set_num_threads(1)
        TIMER = time.thread_time
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    if args.out is None:
        suffix = "" if dtype == torch.float32 else "_bf16"
        args.out = str(results_path(f"bench_cascade{suffix}"))
    batches = [1, 4, 32] if args.quick else [1, 2, 4, 8, 16, 32, 64]
    prefixes = [512, 4096] if args.quick else [256, 1024, 4096]
    if args.only:
        b_only, p_only = (int(x) for x in args.only.split(","))
        batches, prefixes = [b_only], [p_only]
    reps = args.reps or (5 if args.quick else 15)
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    hdr = f"{'B':>4} {'P':>5} {'plain ms':>9} {'cascade ms':>10} {'speedup':>8} {'bytes ratio':>11}"
    print(hdr)
    for p in prefixes:
        for b in batches:
            r = bench_attention(
                b, p, args.suffix, args.heads, args.kv_heads, args.head_dim, args.page_size, reps,
                dtype=dtype,
            )  # fmt: skip
            rows.append(r)
            print(
                f"{b:>4} {p:>5} {r['plain_ms']:>9.3f} {r['cascade_ms']:>10.3f} "
                f"{r['speedup']:>7.2f}x {r['bytes_ratio']:>10.2f}x"
                + ("" if r["auto_uses_cascade"] else "  (auto: plain)")
                + ("" if r["auto_right"] else "  AUTO PICKS THE SLOWER SIDE")
            )
    result: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} threads".strip(),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "config": {
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "page_size": args.page_size,
            "dtype": args.dtype,
            "device": "cpu",
            "timer": args.timer,
            "threads": torch.get_num_threads(),
            "statistic": f"median over {reps} interleaved repetitions",
            "load_average_at_start": load_average(),
        },
        "attention": rows,
        "auto_right_everywhere": all(r["auto_right"] for r in rows),
    }
    procs = args.headline_procs if args.headline_procs is not None else (0 if args.quick else 5)
    if procs > 0 and not args.only:
        result["headline"] = headline_in_processes(procs, args.dtype, args.timer)
        h = result["headline"]
        print(
            f"B={HEADLINE[0]} P={HEADLINE[1]} alone in {procs} fresh processes: speedups "
            f"{h['speedups']}, median {h['median_speedup']}x"
        )
    if not args.skip_e2e:
        e2e = bench_end_to_end(
            prompt_len=args.e2e_prompt,
            branches=args.e2e_branches,
            unique=args.e2e_unique,
            gen=args.e2e_gen,
            page_size=args.page_size,
            reps=args.e2e_reps or (1 if args.quick else 5),
            dtype=args.dtype,
        )
        result["end_to_end"] = e2e
        print(
            f"tree-of-thought ({e2e['branches']} branches x {e2e['gen_tokens']} tokens on a "
            f"{e2e['prompt_len']}-token prompt): decode {e2e['decode_tok_per_s_off']} tok/s "
            f"off, {e2e['decode_tok_per_s_auto']} tok/s cascade=auto ({e2e['speedup']}x, "
            f"repetitions {e2e['speedup_min']}-{e2e['speedup_max']}x; KV bytes read "
            f"{e2e['kv_bytes_ratio']}x fewer), outputs identical: {e2e['outputs_identical']} "
            f"({e2e['outputs_equal']}/{e2e['branches']} equal)"
        )
    result["config"]["load_average_at_end"] = load_average()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
