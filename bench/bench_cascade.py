"""Cascade (shared-prefix) decode attention vs plain paged decode, on the torch backend (CPU).

Part 1, attention only: B requests share a P-token prefix (one trie node) and each has S unique
tokens; one decode step's attention for one layer. The plain baseline is the model's torch
backend decode (``TorchAttention``: a batched gather of every request's pages plus SDPA), the
same code the engine runs without cascade. Cascade is the plan the engine's planner builds,
run by ``TorchCascadeAttention``. Both include writing the step's new K/V into the pool.
Reported beside the ideal bytes ratio ``(B*P + sum S) / (P + sum S)``.

Part 2, end to end: a tree-of-thought workload on radixkv-tiny: one shared prompt, N branches
decoding greedily; decode throughput with the engine's cascade on vs off (skipped with a note if
the engine does not support ``cascade=``).

    python bench/bench_cascade.py [--quick] [--out bench/results/bench_cascade.json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention  # noqa: E402
from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry  # noqa: E402


class _Node:
    """A one-node trie path (root -> prompt node) for the attention-only part."""

    def __init__(self, num_tokens: int) -> None:
        self.parent = None
        self.num_tokens = num_tokens


# wall clock by default; ``--timer cpu`` runs on one thread and counts that thread's CPU time,
# which other processes on a shared machine cannot inflate (scheduling waits are not counted)
TIMER: Callable[[], float] = time.perf_counter


def _time(fn: Callable[[], Any], reps: int) -> float:
    """Best of ``reps`` runs: the machine is shared, so the minimum is the stable statistic."""
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = TIMER()
        fn()
        times.append(TIMER() - t0)
    return min(times)


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
    batch: int, prefix: int, suffix: int, h_q: int, h_kv: int, d: int, ps: int, reps: int
) -> dict[str, Any]:
    from radixkv.kv.kv_pool import KVPool

    n_shared = prefix // ps
    n_own = -(-suffix // ps)
    num_pages = n_shared + batch * n_own + 1
    pool = KVPool(1, num_pages, ps, h_kv, d, torch.float32, "cpu")
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
    auto = CascadePlanner(ps, mode="auto").plan(entries)  # what the engine picks by default
    cascade = TorchCascadeAttention(decision.plan, "cpu")
    plain = _plain_backend(pool, h_q, h_kv, d, tables, lens)
    slots = torch.tensor([t[(n - 1) // ps] * ps + (n - 1) % ps for t, n in zip(tables, lens)])

    q = torch.randn(batch, h_q, d, generator=g)
    k_new = torch.randn(batch, h_kv, d, generator=g)
    v_new = torch.randn(batch, h_kv, d, generator=g)

    def run_cascade() -> torch.Tensor:
        pool.write(0, slots, k_new, v_new)
        return cascade(q, pool.k[0], pool.v[0])

    out_plain = plain(q, k_new, v_new)
    out_casc = run_cascade()
    err = (out_plain[list(decision.order)] - out_casc).abs().max().item()
    # interleave the two so that load from other processes hits both alike
    t_plain, t_casc = float("inf"), float("inf")
    for _ in range(3):
        t_plain = min(t_plain, _time(lambda: plain(q, k_new, v_new), reps))
        if decision.use_cascade:
            t_casc = min(t_casc, _time(run_cascade, reps))
    if not decision.use_cascade:  # nothing shared (B=1): the engine runs plain decode
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
        "kv_tokens_plain": decision.kv_tokens_plain,
        "kv_tokens_cascade": decision.kv_tokens_cascade,
        "max_abs_diff": err,
    }


def bench_end_to_end(
    prompt_len: int, branches: int, gen: int, page_size: int
) -> dict[str, Any] | None:
    """Tree-of-thought: one shared prompt, ``branches`` greedy branches of ``gen`` tokens."""
    try:
        from radixkv.engine.engine import Engine
        from radixkv.engine.params import SamplingParams
    except ImportError as e:
        print(f"end-to-end part skipped: {e}", file=sys.stderr)
        return None
    rng = random.Random(0)
    prompt = [rng.randrange(1, 250) for _ in range(prompt_len)]
    # each branch: the shared prompt + a short branch-specific instruction
    prompts = [prompt + [rng.randrange(1, 250) for _ in range(8)] for _ in range(branches)]
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    out: dict[str, Any] = {
        "prompt_len": prompt_len,
        "branches": branches,
        "gen_tokens": gen,
        "page_size": page_size,
    }
    texts = {}
    for mode in ("off", "auto"):
        try:
            eng = Engine("radixkv-tiny", page_size=page_size, cascade=mode, seed=0)
        except TypeError as e:
            print(f"end-to-end part skipped (engine has no cascade=): {e}", file=sys.stderr)
            return None
        eng.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # cache the trunk
        for p in prompts:
            eng.add_request(p, params, stream=False)
        decode_tokens = 0
        t_decode = 0.0
        finished: list[Any] = []
        while eng.has_unfinished():
            before = eng.stats()
            t0 = TIMER()
            outs = eng.step()
            dt_ = TIMER() - t0
            after = eng.stats()
            if after.prefill_tokens_computed == before.prefill_tokens_computed:  # decode-only
                t_decode += dt_
                decode_tokens += after.generated_tokens - before.generated_tokens
            finished.extend(o for o in outs if o.finished)
        stats = eng.stats()
        texts[mode] = sorted(tuple(o.token_ids) for o in finished)
        out[f"decode_tok_per_s_{mode}"] = round(decode_tokens / max(t_decode, 1e-9), 1)
        out[f"decode_s_{mode}"] = round(t_decode, 3)
        out[f"kv_bytes_read_plain_{mode}"] = stats.kv_bytes_read_plain
        out[f"kv_bytes_read_cascade_{mode}"] = stats.kv_bytes_read_cascade
        out[f"cascade_steps_{mode}"] = stats.cascade_steps
    out["speedup"] = round(out["decode_tok_per_s_auto"] / out["decode_tok_per_s_off"], 2)
    out["kv_bytes_ratio"] = round(
        out["kv_bytes_read_plain_auto"] / max(1, out["kv_bytes_read_cascade_auto"]), 2
    )
    out["outputs_identical"] = texts["auto"] == texts["off"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer configurations and repetitions")
    ap.add_argument("--out", default=str(ROOT / "bench/results/bench_cascade.json"))
    ap.add_argument(
        "--heads",
        type=int,
        default=4,
        help="query heads (default: a small GQA layer; radixkv-tiny has 1)",
    )
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads (radixkv-tiny has 1)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--suffix", type=int, default=128)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument(
        "--timer",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: wall clock, torch's default threads; cpu: 1 thread, its CPU time",
    )
    ap.add_argument("--e2e-prompt", type=int, default=2048, help="shared prompt tokens")
    ap.add_argument("--e2e-branches", type=int, default=None, help="default 16 quick, 32 full")
    ap.add_argument("--e2e-gen", type=int, default=None, help="default 32 quick, 128 full")
    args = ap.parse_args()
    global TIMER
    if args.timer == "cpu":
        torch.set_num_threads(1)
        TIMER = time.thread_time
    torch.manual_seed(0)
    batches = [1, 4, 32] if args.quick else [1, 4, 16, 32, 64]
    prefixes = [512, 4096]
    reps = 3 if args.quick else 7
    rows = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    hdr = f"{'B':>4} {'P':>5} {'plain ms':>9} {'cascade ms':>10} {'speedup':>8} {'bytes ratio':>11}"
    print(hdr)
    for p in prefixes:
        for b in batches:
            r = bench_attention(
                b, p, args.suffix, args.heads, args.kv_heads, args.head_dim, args.page_size, reps
            )
            rows.append(r)
            print(
                f"{b:>4} {p:>5} {r['plain_ms']:>9.2f} {r['cascade_ms']:>10.2f} "
                f"{r['speedup']:>7.2f}x {r['bytes_ratio']:>10.2f}x"
                + ("" if r["auto_uses_cascade"] else "  (auto mode: plain)")
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
            "dtype": "float32",
            "device": "cpu",
            "timer": args.timer,
            "threads": torch.get_num_threads(),
            "statistic": "min over repetitions",
        },
        "attention": rows,
    }
    if not args.skip_e2e:
        e2e = bench_end_to_end(
            prompt_len=args.e2e_prompt,
            branches=args.e2e_branches or (16 if args.quick else 32),
            gen=args.e2e_gen or (32 if args.quick else 128),
            page_size=args.page_size,
        )  # fmt: skip
        if e2e is not None:
            result["end_to_end"] = e2e
            print(
                f"tree-of-thought ({e2e['branches']} branches x {e2e['gen_tokens']} tokens on a "
                f"{e2e['prompt_len']}-token prompt): decode {e2e['decode_tok_per_s_off']} tok/s "
                f"off, {e2e['decode_tok_per_s_auto']} tok/s cascade=auto ({e2e['speedup']}x; KV "
                f"bytes read {e2e['kv_bytes_ratio']}x fewer), outputs "
                f"identical: {e2e['outputs_identical']}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
