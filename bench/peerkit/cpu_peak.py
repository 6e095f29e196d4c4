"""How close to the CPU's limit radixkv runs: the machine's matmul peak (the best of square and
model-shaped matmuls, fp32 and bf16) and radixkv-tiny's 4,096-token prefill as a share of it,
sampled round robin, best of ``repeats``; on all cores and on one thread."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch


def cpu_limit(repeats: int) -> dict[str, Any]:
    """Matmul peak (fp32, bf16) and radixkv-tiny's 4,096-token prefill against it."""
    from radixkv.kv.kv_pool import KVPool
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner, SeqInput
    from radixkv.onednn import linear

    total = 4096
    cfg = load_model("radixkv-tiny").config
    h, a, akv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (2 * h * a + 2 * h * akv + 3 * h * cfg.intermediate_size)
    # causal attention: q.k and p.v over total^2 / 2 pairs, per layer
    attention = 2 * cfg.num_layers * total * total * a
    flops = total * per_token + attention + 2 * h * cfg.vocab_size  # lm_head: last row only
    shapes = {"square 2048": (2048, 2048, 2048), "square 4096": (4096, 4096, 4096),
              "tiny MLP 4096x512x3072": (total, h, cfg.intermediate_size),
              "tiny MLP 4096x3072x512": (total, cfg.intermediate_size, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (total,), generator=gen).tolist()
    pages = list(range(total // 16))
    tasks: dict[str, Callable[[], object]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        dn = str(dtype).removeprefix("torch.")
        for sname, (m, k, n) in shapes.items():
            x = torch.randn(m, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen).to(dtype)
            tasks[f"matmul {sname} {dn}"] = lambda x=x, w=w: torch.nn.functional.linear(x, w)
            if dtype == torch.float32:  # the oneDNN matmul the model runs (radixkv/onednn.py)
                tasks[f"matmul {sname} {dn} onednn"] = lambda x=x, w=w: linear(x, w, None)
        lm = load_model("radixkv-tiny", dtype=dtype)
        kv = KVPool(cfg.num_layers, len(pages) + 1, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
        runner = ModelRunner(lm.model, kv)
        tasks[f"prefill {dn}"] = lambda r=runner: r.forward([SeqInput(ids, pages, 0)])
    threads = torch.get_num_threads()
    out: dict[str, Any] = {"prefill_tokens": total, "prefill_gflop": flops / 1e9,
                           "repeats": repeats}  # fmt: skip
    # all cores (what the benchmarks run with), then one thread: a core's own efficiency, which
    # the other jobs of a shared machine disturb less (no thread waits for a preempted sibling)
    for label, n_threads in (("all_cores", threads), ("one_thread", 1)):
        if label == "one_thread" and threads == 1:
            break
        torch.set_num_threads(n_threads)
        try:
            best = _best_of(tasks, repeats)
        finally:
            torch.set_num_threads(threads)
        part: dict[str, Any] = {"threads": n_threads}
        for dtype in ("float32", "bfloat16"):
            # the peak is the fastest matmul PyTorch has for the dtype (fp32: MKL or oneDNN)
            rates = {f"{s}{lib}": 2 * m * k * n / best[f"matmul {s} {dtype}{lib}"] / 1e9
                     for s, (m, k, n) in shapes.items()
                     for lib in ("", " onednn") if f"matmul {s} {dtype}{lib}" in best}  # fmt: skip
            peak = max(rates.values())
            rate = flops / best[f"prefill {dtype}"] / 1e9
            part[dtype] = {"matmul_gflops": rates, "peak_gflops": peak,
                           "prefill_s": best[f"prefill {dtype}"], "prefill_gflops": rate,
                           "prefill_share_of_peak": rate / peak}  # fmt: skip
        out[label] = part
    return out


def _best_of(tasks: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest time of each task, sampled round robin (a slow spell hits every task alike)."""
    best = {k: math.inf for k in tasks}
    with torch.inference_mode():
        for fn in tasks.values():
            fn()  # warm-up
        for _ in range(repeats):
            for k, fn in tasks.items():
                t0 = time.perf_counter()
                fn()
                best[k] = min(best[k], time.perf_counter() - t0)
    return best
