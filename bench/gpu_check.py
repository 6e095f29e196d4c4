"""GPU check (run by hand on a CUDA machine, never in CI): the FlashInfer backends against the
torch backend, plus timings. On a lent machine run it from the GPU kit (docs/gpu.md):

    bash .gpu-kit/run.sh               # = PYTHONPATH=<kit> python3 bench/gpu_check.py

What it checks (exit status 1 if anything fails; sections are independent, a crash in one is
recorded and the others still run):

* ``paged``: :class:`FlashInferAttention` vs the torch backend in fp32 on the same values, for
  bf16 and fp16, page sizes 1 and 16, decode-only, prefill-only (fresh prompts and chunks on a
  cached prefix) and mixed batches; outputs within bf16 2e-2 / fp16 2e-3, written K/V equal;
* ``cascade``: :class:`FlashInferCascadeAttention` (2 levels; 3 levels where every row reads
  every level; 3 levels nested/partial) vs the torch cascade in fp32, outputs and LSEs, both
  dtypes, page sizes 1 and 16;
* ``timings`` (bf16, page size 16): decode B=32 at context 2048, a 4096-token prefill, a
  128-token chunk on 3968 cached tokens (flashinfer and torch backends, per layer, plus plan
  time), and cascade vs plain decode attention at B=32 on a shared prefix of 4096 and 32768
  tokens (the engine's two paths: :class:`CascadeDecodeBackend` and the plain flashinfer
  backend, each including the step's K/V write);
* ``tiny_model``: radixkv-tiny (bf16) end to end, prefill, a chunk and decode steps, logits vs
  the torch backend;
* ``engine_tiers``: radixkv-tiny through ``Engine`` (flashinfer, bf16, cascade off so only the
  kit's kernels run): multi-turn chats whose working set is 4x a small device pool, with the
  host tier (CUDA side-stream copies, pinned host memory) against an unbounded device pool:
  the same hit rate and token-identical greedy outputs, host loads seen, invariants and locks
  clean, and the same outputs with host loads layer by layer (per-layer events) and all at
  once (``host_layerwise_load`` "on" vs "off"); a file storage tier across an engine restart
  (outputs equal, prefix from storage);
  ``dtype="auto"`` gives bf16 on the GPU for the float32 tiny checkpoint;
* ``sampling``, ``prompt_logprobs``, ``speculative``, ``lora``, ``moe`` (a mixture-of-experts
  model), ``overlap`` (the next step scheduled while the device runs this one: outputs and
  locks with overlap on vs off, and the decode step time of both): those engine features on
  the GPU (each function's docstring says what it compares).

Results: ``$OUT/gpu_check.json`` and a short table ``$OUT/gpu_check.md`` (``bench/results/``
when OUT is unset). The attention shapes it runs are :func:`kernel_variants`; bench/gpu_kit.py
compiles exactly the FlashInfer kernels those need, and run.sh forbids compiling anything else.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radixkv.attention.base import BatchLayout  # noqa: E402
from radixkv.attention.cascade_plan import CascadeLevel, CascadePlan  # noqa: E402
from radixkv.attention.registry import get_backend  # noqa: E402
from radixkv.kv.kv_pool import KVPool  # noqa: E402
from radixkv.pages import pages_for, window_start_page  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
LSE_TOL = 1e-2
DTYPES = (torch.bfloat16, torch.float16)
PAGE_SIZES = (1, 16)
HQ, HKV, D = 32, 8, 128  # a Llama-3-8B layer: GQA group 4
TINY_DTYPE = torch.bfloat16
TIMING_DTYPE = torch.bfloat16
DEV = "cuda"


# Sliding-window and soft-capped attention (check_window, check_hybrid): a window every batch of
# _random_batch outgrows, and Gemma 2's cap of attention scores, in one dtype (each variant is
# FlashInfer kernels of its own: minutes of nvcc per variant for the kit)
WINDOW = 256
SOFTCAP = 50.0
WINDOW_DTYPE = torch.bfloat16
# case -> (each layer's window, 0 = full; soft cap): Mistral-style (a full and a windowed layer)
# and Gemma 2-style (the same, every score soft-capped)
WINDOW_CASES: dict[str, tuple[tuple[int, ...], float | None]] = {
    "window": ((0, WINDOW), None),
    "window_softcap": ((0, WINDOW), SOFTCAP),
}

# (dtype, num_qo_heads, num_kv_heads, head_dim, sliding window, logits soft cap): the attention
# shapes and the two kernel switches FlashInfer compiles separately
Variant = tuple[torch.dtype, int, int, int, bool, bool]


def kernel_variants() -> list[Variant]:
    """Every attention this check runs: the kernel comparisons, cascade and timings in both
    dtypes, radixkv-tiny end to end, and the window cases' layers (windowed or not, capped or
    not). bench/gpu_kit.py compiles exactly the kernels these need."""
    from radixkv.model.tiny import tiny_config

    tiny = tiny_config()
    out: list[Variant] = [(dt, HQ, HKV, D, False, False) for dt in DTYPES]
    out.append((TINY_DTYPE, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim, False, False))
    for windows, softcap in WINDOW_CASES.values():
        for w in windows:
            v = (WINDOW_DTYPE, HQ, HKV, D, w > 0, softcap is not None)
            if v not in out:
                out.append(v)
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rand(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=DEV).to(dtype)


def _pool(
    page_size: int, num_pages: int, dtype: torch.dtype, seed: int, num_layers: int = 1
) -> KVPool:
    kv = KVPool(num_layers, num_pages, page_size, HKV, D, dtype, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen, device=DEV))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen, device=DEV))
    return kv


# ------------------------------------------------------------------------------------------------
# paged backend vs torch
def _random_batch(
    kind: str, page_size: int, seed: int
) -> tuple[list[list[int]], list[int], list[int], int]:
    rng = random.Random(seed)
    past, new = [], []
    for _ in range(12):
        pick = {"decode": 2, "prefill": rng.choice((0, 1)), "mixed": rng.choice((0, 1, 2))}[kind]
        if pick == 0:  # fresh prompt
            past.append(0)
            new.append(rng.randint(1, 300))
        elif pick == 1:  # chunk on a cached prefix, not page aligned
            past.append(rng.randint(1, 700))
            new.append(rng.randint(2, 200))
        else:  # decode
            past.append(rng.randint(1, 1500))
            new.append(1)
    needs = [-(-(p + n) // page_size) for p, n in zip(past, new)]
    ids = list(range(sum(needs)))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in needs:
        tables.append(ids[used : used + n])
        used += n
    return tables, past, new, len(ids)


def check_paged(kind: str, dtype: torch.dtype, page_size: int, seed: int = 0) -> dict[str, Any]:
    tables, past, new, num_pages = _random_batch(kind, page_size, seed)
    layout = BatchLayout.build(tables, past, new)
    t = layout.num_tokens
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    q, k, v = (
        _rand((t, HQ, D), gen, dtype),
        _rand((t, HKV, D), gen, dtype),
        _rand((t, HKV, D), gen, dtype),
    )
    fi_kv = _pool(page_size, num_pages, dtype, seed)
    ref_kv = KVPool(1, num_pages, page_size, HKV, D, torch.float32, DEV)
    ref_kv.k.copy_(fi_kv.k)
    ref_kv.v.copy_(fi_kv.v)
    ref = get_backend("torch", ref_kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    ref.plan(layout)
    ref_out = ref.forward(0, q.float(), k.float(), v.float())
    fi = get_backend("flashinfer", fi_kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    fi.plan(layout)
    fi_out = fi.forward(0, q, k, v).float()
    diff = (ref_out - fi_out).abs().max().item()
    kv_equal = torch.equal(ref_kv.k.to(dtype), fi_kv.k) and torch.equal(ref_kv.v.to(dtype), fi_kv.v)
    return {
        "kind": kind, "dtype": _name(dtype), "page_size": page_size, "num_seqs": len(new),
        "num_tokens": t, "max_abs_diff": diff, "tolerance": TOL[dtype],
        "kv_written_equal": kv_equal, "ok": diff <= TOL[dtype] and kv_equal and math.isfinite(diff),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# sliding windows and soft caps, and hybrid window KV, vs torch
def _window_inputs(
    kind: str, page_size: int, seed: int, num_layers: int
) -> tuple[BatchLayout, list[list[int]], list[int], list[int], int, list[tuple[torch.Tensor, ...]]]:
    tables, past, new, num_pages = _random_batch(kind, page_size, seed)
    layout = BatchLayout.build(tables, past, new)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    t = layout.num_tokens
    qkv = [
        (_rand((t, HQ, D), gen, WINDOW_DTYPE), _rand((t, HKV, D), gen, WINDOW_DTYPE),
         _rand((t, HKV, D), gen, WINDOW_DTYPE))
        for _ in range(num_layers)
    ]  # fmt: skip
    return layout, tables, past, new, num_pages, qkv


def _layers_diff(
    fi: Any, ref: Any, layout: BatchLayout, qkv: list[tuple[torch.Tensor, ...]]
) -> float:
    """Largest difference of every layer's output, FlashInfer against the fp32 torch backend
    (both plan the same layout; each forward also writes the layer's new K/V)."""
    fi.plan(layout)
    ref.plan(layout)
    worst = 0.0
    for layer, (q, k, v) in enumerate(qkv):
        want = ref.forward(layer, q.float(), k.float(), v.float())
        got = fi.forward(layer, q, k, v).float()
        worst = max(worst, (want - got).abs().max().item())
    return worst


def check_window(case: str, kind: str, page_size: int, seed: int = 0) -> dict[str, Any]:
    """A full layer and a windowed one (``WINDOW_CASES``), soft-capped or not, on FlashInfer's
    kernels planned with ``window_left``/``logits_soft_cap`` against the torch backend's banded
    attention: the paths of Mistral-, Gemma 2- and Gemma 3-style models."""
    windows, softcap = WINDOW_CASES[case]
    layout, _, past, new, num_pages, qkv = _window_inputs(kind, page_size, seed, len(windows))
    fi_kv = _pool(page_size, num_pages, WINDOW_DTYPE, seed, len(windows))
    ref_kv = KVPool(len(windows), num_pages, page_size, HKV, D, torch.float32, DEV)
    ref_kv.k.copy_(fi_kv.k)
    ref_kv.v.copy_(fi_kv.v)
    kw = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, layer_windows=windows, softcap=softcap)
    diff = _layers_diff(get_backend("flashinfer", fi_kv, **kw), get_backend("torch", ref_kv, **kw),
                        layout, qkv)  # fmt: skip
    tol = TOL[WINDOW_DTYPE]
    longest = max(p + n for p, n in zip(past, new, strict=True))
    return {
        "case": case, "kind": kind, "dtype": _name(WINDOW_DTYPE), "page_size": page_size,
        "window": WINDOW, "softcap": softcap, "longest": longest, "max_abs_diff": diff,
        "tolerance": tol, "ok": longest > WINDOW and diff <= tol and math.isfinite(diff),
    }  # fmt: skip


def check_hybrid(kind: str, page_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Hybrid window KV on FlashInfer: the windowed layer's K/V live in window slots (a shuffle
    of the pages its windows read, so slot ids are not page ids), planned on slot tables by a
    backend of its own; outputs as the torch backend's over one pool holding every layer."""
    from radixkv.kv.hybrid_pool import HybridKVPool

    windows, softcap = WINDOW_CASES["window"]
    layout, tables, past, new, num_pages, qkv = _window_inputs(kind, page_size, seed, 2)
    hybrid = HybridKVPool.build(windows, num_pages, num_pages, page_size, HKV, D, WINDOW_DTYPE, DEV)
    need = {
        pt[i]
        for pt, p, n in zip(tables, past, new, strict=True)
        for i in range(window_start_page(p, WINDOW, page_size), pages_for(p + n, page_size))
    }
    order = sorted(need)
    random.Random(seed).shuffle(order)
    hybrid.slots.attach(order)
    ref_kv = KVPool(2, num_pages, page_size, HKV, D, torch.float32, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    ref_kv.k.copy_(torch.randn(ref_kv.k.shape, generator=gen, device=DEV).to(WINDOW_DTYPE))
    ref_kv.v.copy_(torch.randn(ref_kv.v.shape, generator=gen, device=DEV).to(WINDOW_DTYPE))
    hybrid.full.k[0].copy_(ref_kv.k[0])
    hybrid.full.v[0].copy_(ref_kv.v[0])
    slots = torch.tensor([hybrid.slots.slot_of[p] for p in order], device=DEV)
    pages = torch.tensor(order, device=DEV)
    hybrid.window.k[0, slots] = ref_kv.k[1, pages].to(WINDOW_DTYPE)
    hybrid.window.v[0, slots] = ref_kv.v[1, pages].to(WINDOW_DTYPE)
    kw = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, layer_windows=windows, softcap=softcap)
    fi = get_backend("flashinfer", hybrid, **kw)
    fi.check_layouts = True  # slot tables checked against the slot pool
    diff = _layers_diff(fi, get_backend("torch", ref_kv, **kw), layout, qkv)
    tol = TOL[WINDOW_DTYPE]
    return {
        "case": "hybrid", "kind": kind, "dtype": _name(WINDOW_DTYPE), "page_size": page_size,
        "window": WINDOW, "slots": len(order), "pages": num_pages, "max_abs_diff": diff,
        "tolerance": tol, "ok": diff <= tol and math.isfinite(diff),
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# cascade vs torch cascade
def cascade_plan(
    case: str, page_size: int, batch: int, prefix: int, suffix: int, seed: int = 0
) -> tuple[CascadePlan, list[list[int]], list[int], int]:
    """A cascade plan in row order, the rows' full page tables and lengths, and the pages used.

    ``two_level``: one ``prefix``-token trunk read by all ``batch`` rows, then each row's own
    ``suffix`` (+ up to a page) tokens. ``three_level``: the trunk, then two branches of
    ``prefix // 4`` tokens (first half of the rows, second half), then own tokens.
    ``three_partial``: nested and partial: a quarter of the rows read trunk + branch, a quarter
    the trunk only, the rest nothing shared (those read only their own pages).
    """
    rng = random.Random(seed)
    ps = page_size
    branch = max(ps, (prefix // 4) // ps * ps)
    n_pages = (prefix + 2 * branch) // ps + batch * (-(-(suffix + ps) // ps))
    free = list(range(n_pages))
    rng.shuffle(free)

    def take(n_tok: int) -> list[int]:
        return [free.pop() for _ in range(-(-n_tok // ps))]

    trunk, br_a, br_b = take(prefix), take(branch), take(branch)
    half, quarter = batch // 2, batch // 4
    if case == "two_level":
        paths: list[list[tuple[list[int], int]]] = [[(trunk, prefix)]] * batch
    elif case == "three_level":
        paths = [[(trunk, prefix), (br_a, branch)]] * half + [[(trunk, prefix), (br_b, branch)]] * (
            batch - half
        )
    elif case == "three_partial":
        paths = [[(trunk, prefix), (br_a, branch)]] * quarter + [[(trunk, prefix)]] * quarter
        paths += [[]] * (batch - 2 * quarter)
    else:
        raise ValueError(case)
    own_lens = [suffix + rng.randrange(ps) for _ in range(batch)]
    own = [take(n) for n in own_lens]
    levels = []
    for depth in range(max(len(p) for p in paths)):
        segs: list[tuple[int, list[int], int]] = []
        for p in paths:
            pages, n_tok = p[depth] if len(p) > depth else ([], 0)
            if segs and n_tok and segs[-1][1] is pages:
                segs[-1] = (segs[-1][0] + 1, pages, n_tok)
            else:
                segs.append((1, pages, n_tok))
        levels.append(CascadeLevel.from_segments(ps, segs))
    levels.append(CascadeLevel.from_segments(ps, [(1, o, n) for o, n in zip(own, own_lens)]))
    tables = [[pg for pages, _ in p for pg in pages] + o for p, o in zip(paths, own)]
    lens = [sum(n for _, n in p) + n for p, n in zip(paths, own_lens)]
    return CascadePlan(ps, batch, tuple(levels)), tables, lens, n_pages


def check_cascade(case: str, dtype: torch.dtype, page_size: int) -> dict[str, Any]:
    from radixkv.attention.cascade import TorchCascadeAttention
    from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention

    plan, _, _, n_pages = cascade_plan(case, page_size, batch=12, prefix=1024, suffix=40)
    gen = torch.Generator(device=DEV).manual_seed(2)
    k32 = torch.randn(n_pages, page_size, HKV, D, generator=gen, device=DEV)
    v32 = torch.randn(n_pages, page_size, HKV, D, generator=gen, device=DEV)
    q = torch.randn(plan.num_queries, HQ, D, generator=gen, device=DEV).to(dtype)
    k, v = k32.to(dtype), v32.to(dtype)
    ref, ref_lse = TorchCascadeAttention(plan, DEV).forward(
        q.float(), k.float(), v.float(), return_lse=True
    )
    fi = FlashInferCascadeAttention(DEV)
    fi.plan(plan, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, q_data_type=dtype)
    out, lse = fi.forward(q, k, v, return_lse=True)
    err = (out.float() - ref).abs().max().item()
    lse_err = (lse.float() - ref_lse).abs().max().item()
    return {
        "case": case, "levels": len(plan.levels), "mode": fi._mode, "dtype": _name(dtype),
        "page_size": page_size, "max_abs_diff": err, "lse_max_abs_diff": lse_err,
        "tolerance": TOL[dtype], "ok": err <= TOL[dtype] and lse_err <= LSE_TOL,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# timings
def _time_cuda(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Milliseconds per call (CUDA events), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def time_paged(dtype: torch.dtype = TIMING_DTYPE) -> dict[str, Any]:
    ps = 16
    rows: dict[str, Any] = {}
    cases = {
        "decode_b32_ctx2048": ([2047] * 32, [1] * 32),
        "prefill_4096": ([0], [4096]),
        "prefill_128_on_3968": ([3968], [128]),
    }
    for case, (past, new) in cases.items():
        needs = [-(-(p + n) // ps) for p, n in zip(past, new)]
        tables, used = [], 0
        for n in needs:
            tables.append(list(range(used, used + n)))
            used += n
        layout = BatchLayout.build(tables, past, new)
        t = sum(new)
        q = torch.randn(t, HQ, D, device=DEV, dtype=dtype)
        k = torch.randn(t, HKV, D, device=DEV, dtype=dtype)
        for name in ("torch", "flashinfer"):
            kv = _pool(ps, used, dtype, 0)
            backend = get_backend(name, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
            backend.plan(layout)
            rows[f"{case}/{name}_ms"] = _time_cuda(
                lambda b=backend, q=q, k=k: b.forward(0, q, k, k)
            )
            t0 = time.perf_counter()
            for _ in range(10):
                backend.plan(layout)
            torch.cuda.synchronize()
            rows[f"{case}/{name}_plan_ms"] = (time.perf_counter() - t0) * 100
    return rows


def time_cascade(prefix: int, dtype: torch.dtype = TIMING_DTYPE, batch: int = 32) -> dict[str, Any]:
    """Cascade vs plain decode attention, one layer, B rows sharing a ``prefix``-token trunk."""
    from radixkv.attention.cascade_backend import CascadeDecodeBackend

    ps, suffix = 16, 128
    plan, tables, lens, n_pages = cascade_plan("two_level", ps, batch, prefix, suffix)
    kv = _pool(ps, n_pages, dtype, 0)
    layout = BatchLayout.build(tables, [n - 1 for n in lens], [1] * batch)
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k_new, v_new = (
        _rand((batch, HQ, D), gen, dtype),
        _rand((batch, HKV, D), gen, dtype),
        _rand((batch, HKV, D), gen, dtype),
    )
    plain = get_backend("flashinfer", kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
    plain.plan(layout)
    cascade = CascadeDecodeBackend(plain)
    cascade.set_plan(plan, list(range(batch)))
    cascade.plan(layout)
    out_plain = plain.forward(0, q, k_new, v_new)
    out_casc = cascade.forward(0, q, k_new, v_new)
    diff = (out_plain.float() - out_casc.float()).abs().max().item()
    t_plain = _time_cuda(lambda: plain.forward(0, q, k_new, v_new))
    t_casc = _time_cuda(lambda: cascade.forward(0, q, k_new, v_new))
    read_plain = sum(lens)
    read_casc = plan.kv_tokens_read()
    return {
        "batch": batch, "prefix": prefix, "suffix": suffix, "dtype": _name(dtype),
        "plain_us": round(t_plain * 1e3, 1), "cascade_us": round(t_casc * 1e3, 1),
        "speedup": round(t_plain / t_casc, 2), "kv_read_ratio": round(read_plain / read_casc, 2),
        "max_abs_diff_vs_plain": diff, "ok": diff <= TOL[dtype],
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# radixkv-tiny end to end
def _logits_by_backend(
    model: Any, ids: list[int], num_pages: int, prefill: int, chunk_end: int, device: str
) -> dict[str, torch.Tensor]:
    """fp32 logits of every position of ``ids`` through ``model`` on the torch and the
    FlashInfer backend: a prefill of ``ids[:prefill]``, a chunk on those cached pages up to
    ``chunk_end``, then one decode step per remaining token (page size 16, ``num_pages``)."""
    from radixkv.model.runner import ModelRunner, SeqInput

    c = model.config
    logits = {}
    for name in ("torch", "flashinfer"):
        kv = KVPool(c.num_layers, num_pages, 16, c.num_kv_heads, c.head_dim, TINY_DTYPE, device)
        runner = ModelRunner(model, kv, backend=name)
        table = list(range(num_pages))
        parts = [runner.forward([SeqInput(ids[:prefill], table, 0)], all_logits=True)]
        parts.append(
            runner.forward([SeqInput(ids[prefill:chunk_end], table, prefill)], all_logits=True)
        )
        for i in range(chunk_end, len(ids)):  # decode steps
            parts.append(runner.forward([SeqInput(ids[i : i + 1], table, i)], all_logits=True))
        logits[name] = torch.cat(parts).float()
    return logits


def _agreeing_tokens(outs: list[list[int]], refs: list[list[int]]) -> tuple[int, int]:
    """(leading tokens of each output that agree with its reference, summed; the references'
    tokens in all)."""
    common = 0
    for x, y in zip(outs, refs, strict=True):
        common += next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return common, sum(len(y) for y in refs)


def _drained_locks(eng: Any) -> int:
    """The engine's invariants checked (raises) and the lock counts left on its trie."""
    eng.check_invariants()
    return sum(n.lock_ref for n in eng.cache.iter_nodes() if n.parent is not None)


def check_tiny_model() -> dict[str, Any]:
    from radixkv.model.loader import load_model

    lm = load_model("radixkv-tiny", device=DEV, dtype=TINY_DTYPE)
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:900]
    logits = _logits_by_backend(lm.model, ids, 64, 500, 890, DEV)
    diff = (logits["torch"] - logits["flashinfer"]).abs().max().item()
    scale = logits["torch"].abs().max().item()
    same = logits["torch"].argmax(-1) == logits["flashinfer"].argmax(-1)
    # greedy tokens must match wherever the reference's top two are further apart than the
    # two backends' logits (random weights in bf16 leave near-ties, where either pick is right)
    top2 = logits["torch"].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
    return {
        "tokens": len(ids), "max_abs_diff": diff, "logit_scale": scale,
        "argmax_agreement": same.float().mean().item(),
        "clear_argmax_positions": int(clear.sum()), "clear_argmax_mismatches": int((clear & ~same).sum()),
        "ok": diff <= 0.05 * scale and not bool((clear & ~same).any()),
    }  # fmt: skip


def check_moe(device: str = DEV) -> dict[str, Any]:
    """A mixture-of-experts model on the GPU: a random Qwen3-MoE layout (8 experts, top 2,
    layer 1 dense; bf16; radixkv-tiny's head shape, so the kit's kernels suffice). Prefill, a
    chunk on cached pages and decode steps through FlashInfer against the torch backend
    (logits within 5% of their scale at 95% of positions, greedy equal wherever the top two are
    clearly apart),
    then the engine on shared-prefix prompts: outputs mixed in one batch against each prompt
    alone (bf16 near-ties may flip: most tokens must agree), invariants and locks clean."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.config import ModelConfig, MoEConfig
    from radixkv.model.llama import LlamaForCausalLM
    from radixkv.model.loader import LoadedModel
    from radixkv.model.tiny import tiny_config, tiny_tokenizer

    t = tiny_config()
    cfg = ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=t.vocab_size, hidden_size=256,
        intermediate_size=512, num_layers=3, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim, max_position_embeddings=4096, qk_norm=True, dtype=TINY_DTYPE,
        moe=MoEConfig(num_experts=8, top_k=2, expert_size=256, dense_layers=(1,)),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg, device=device, dtype=TINY_DTYPE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                w = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=gen)
            else:  # [out, in]: unit-variance outputs for unit-variance inputs
                w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
            p.copy_(w.to(device=device, dtype=TINY_DTYPE))
    model.eval()
    rng = random.Random(0)
    ids = [rng.randrange(3, cfg.vocab_size) for _ in range(600)]
    logits = _logits_by_backend(model, ids, 48, 300, 590, device)
    # per position: a token whose experts' probabilities nearly tie can be routed elsewhere by
    # the backends' bf16 rounding, and its logits (and a few after it) then differ by more than
    # rounding, so the bound is on most positions, and greedy must agree wherever the top two
    # are further apart than that position's difference
    row_diff = (logits["torch"] - logits["flashinfer"]).abs().amax(-1)
    scale = logits["torch"].abs().max().item()
    close = row_diff <= 0.05 * scale
    same = logits["torch"].argmax(-1) == logits["flashinfer"].argmax(-1)
    top2 = logits["torch"].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * row_diff
    eng = Engine(LoadedModel(model, cfg, tiny_tokenizer(), "moe-random"), device=device,
                 dtype=TINY_DTYPE, num_pages=256)  # fmt: skip
    system = [rng.randrange(3, cfg.vocab_size) for _ in range(200)]
    prompts = [system + [rng.randrange(3, cfg.vocab_size) for _ in range(5 + i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    mixed = eng.generate(prompts, params, use_tqdm=False)
    alone = [eng.generate([p], params, use_tqdm=False)[0] for p in prompts]
    common, total = _agreeing_tokens([m.token_ids for m in mixed], [a.token_ids for a in alone])
    locks = _drained_locks(eng)
    hits = eng.stats().prefix_cache_hit_tokens
    return {
        "tokens": len(ids), "max_abs_diff": row_diff.max().item(), "logit_scale": scale,
        "close_positions": close.float().mean().item(),
        "argmax_agreement": same.float().mean().item(),
        "clear_argmax_mismatches": int((clear & ~same).sum()),
        "engine_common_prefix_fraction": common / total, "engine_hit_tokens": hits,
        "ok": close.float().mean().item() >= 0.95 and not bool((clear & ~same).any())
        and common >= 0.9 * total and locks == 0 and hits > 0,
    }  # fmt: skip


def check_sampling(device: str = DEV) -> dict[str, Any]:
    """Logit bias, min_tokens and the penalties on CUDA tensors: adjust_logits there equals it
    on the CPU for the same logits, and the engine on the GPU honours a ban, min_tokens and a
    guided regex."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.logit_adjust import adjust_logits
    from radixkv.engine.params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 3
    ids = [torch.randint(0, 300, (40,), generator=gen).tolist() for _ in range(4)]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(logit_bias={7: 50.0, 9: -100.0}),
        SamplingParams(max_tokens=64, min_tokens=30, stop_token_ids=[11]),
        SamplingParams(),
    ]
    cpu = adjust_logits(logits, params, ids, [20] * 4, eos_token_ids={2})
    gpu = adjust_logits(logits.to(device), params, ids, [20] * 4, eos_token_ids={2}).cpu()
    diff = (cpu - gpu).abs().nan_to_num(posinf=0.0, neginf=0.0).max().item()
    same_inf = bool(torch.equal(torch.isinf(cpu), torch.isinf(gpu)))
    eng = Engine("radixkv-tiny", device=device, dtype=TINY_DTYPE, num_pages=256)
    eos = sorted(eng.eos_token_ids)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100.0})
    short = eng.generate(["def f(x):\n"], greedy, use_tqdm=False)[0].outputs[0]
    held = SamplingParams(
        temperature=0.0, max_tokens=12, logit_bias={eos: 100.0}, min_tokens=5,
        repetition_penalty=1.2, frequency_penalty=0.3,
    )  # fmt: skip
    out = eng.generate(["def f(x):\n"], held, use_tqdm=False)[0].outputs[0]
    # guided decoding: the mask (built on the CPU) lands on the GPU's logits
    pattern = r"[0-9]{3}-[a-z]{4}"
    guided = SamplingParams(temperature=1.0, seed=0, n=4, guided={"regex": pattern})
    texts = [c.text for c in eng.generate(["id: "], guided, use_tqdm=False)[0].outputs]
    guided_ok = all(re.fullmatch(pattern, t) for t in texts)
    eng.check_invariants()
    return {
        "adjust_max_abs_diff": diff, "same_inf": same_inf,
        "eos_first_len": len(short.token_ids), "min_tokens_len": len(out.token_ids),
        "guided_texts": texts,
        "ok": diff <= 1e-5 and same_inf and len(short.token_ids) == 1
        and len(out.token_ids) == 6 and eos not in out.token_ids[:5] and guided_ok,
    }  # fmt: skip


def check_prompt_logprobs(device: str = DEV) -> dict[str, Any]:
    """Prompt logprobs from the engine on the GPU (its auto backend: FlashInfer there, blocks of
    rows through the LM head) against log_softmax of one whole-prompt forward on the same device
    with the torch backend; then scoring after a shared context hits the cached context."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.runner import ModelRunner, SeqInput

    eng = Engine("radixkv-tiny", device=device, dtype=TINY_DTYPE, num_pages=256)
    tok = eng.tokenizer
    context = "The quick brown fox jumps over the lazy dog. " * 12
    ids = tok.encode(context + "And then it slept.")
    (o,) = eng.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    c = eng.model.config
    kv = KVPool(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, TINY_DTYPE, device)
    ref_runner = ModelRunner(eng.model.model, kv, backend="torch")
    logits = ref_runner.forward([SeqInput(ids, list(range(64)), 0)], all_logits=True)
    ref = torch.log_softmax(logits.float(), dim=-1).cpu()  # [P, V]
    pl = o.prompt_logprobs or []
    diffs = [abs(pl[j][ids[j]].logprob - ref[j - 1, ids[j]].item()) for j in range(1, len(ids))]
    start = len(tok.encode(context))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start)
    scored = eng.generate([ids], params, use_tqdm=False)[0]
    eng.check_invariants()
    return {
        "tokens": len(ids), "max_abs_diff": max(diffs), "entries": len(pl),
        "cached_with_start": scored.num_cached_tokens,
        "ok": len(pl) == len(ids) and pl[0] is None and max(diffs) <= 0.1
        and scored.num_cached_tokens > 0 and all(e is None for e in (scored.prompt_logprobs or [0])[:start]),
    }  # fmt: skip


def check_speculative(device: str = DEV) -> dict[str, Any]:
    """Prompt-lookup drafts on the GPU (drafted rows are short prefills in decode batches, so
    FlashInfer's mixed path): greedy outputs against the same engine without drafts. bf16
    rounding differs between a chunk and a decode step, so near-ties may flip: the check asks
    for accepted drafts, fewer steps and the outputs' common prefixes covering most tokens."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    prompts = ["import os\n" * 3 + "def f(x):\n    return x\n" * 4, "for i in range(9):\n" * 3]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs, steps, accepted = {}, {}, 0
    for k in (0, 6):
        eng = Engine("radixkv-tiny", device=device, dtype=TINY_DTYPE, num_pages=256,
                     num_speculative_tokens=k)  # fmt: skip
        outs[k] = [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        steps[k] = eng.stats().num_steps
        accepted = max(accepted, eng.stats().speculative_accepted_tokens)
        eng.check_invariants()
    common, total = _agreeing_tokens(outs[6], outs[0])
    return {
        "steps_plain": steps[0], "steps_spec": steps[6], "accepted": accepted,
        "common_prefix_fraction": common / total,
        "ok": accepted > 0 and steps[6] < steps[0] and common >= 0.9 * total,
    }  # fmt: skip


def _overlap_run(eng: Any, prompts: list[list[int]], params: list[Any]) -> list[Any]:
    """Every prompt to completion, invariants after every step (a step in flight included)."""
    ids = [eng.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_invariants()
    return [done[i] for i in ids]


def check_overlap(device: str = DEV, batch: int = 64, steps: int = 40) -> dict[str, Any]:
    """Overlap (engine/overlap.py) on the device: ``overlap="auto"`` is on there; greedy
    outputs (stop ids, max_tokens, EOS) and seeded sampled ones with overlap on against off
    (bf16 GEMMs may round differently for another batch composition, and the lag keeps a row
    that just finished in the next step: near-ties may flip, so the check asks for the
    outputs' common prefixes to cover 95% of the tokens, and reports whether all are
    identical), locks drained; then the steady decode step time at ``batch`` rows, off vs on
    (radixkv-tiny, its default backend: FlashInfer on a GPU with the kit; the last step's
    forward, in flight when the clock stops, is not counted: at most 1/steps of it)."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 60))]
               for _ in range(48)]  # fmt: skip
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + i % 40, stop_token_ids=[i % 200 + 3])
        if i % 3 else
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=i, max_tokens=32)
        for i in range(len(prompts))
    ]  # fmt: skip
    kw: dict[str, Any] = dict(device=device, dtype=TINY_DTYPE, num_pages=2048, page_size=16)
    outs, engines = {}, {}
    for mode in ("off", "auto" if device == "cuda" else "on"):
        eng = Engine("radixkv-tiny", overlap=mode, **kw)
        engines[mode] = eng
        outs[mode] = [o.outputs[0] for o in _overlap_run(eng, prompts, params)]
    on_mode = "auto" if device == "cuda" else "on"
    auto_on = engines[on_mode].overlap
    toks = {m: [c.token_ids for c in v] for m, v in outs.items()}
    common, total = _agreeing_tokens(toks[on_mode], toks["off"])
    identical = [(c.token_ids, c.finish_reason) for c in outs[on_mode]] == [
        (c.token_ids, c.finish_reason) for c in outs["off"]
    ]
    locks = {m: _drained_locks(e) for m, e in engines.items()}
    for e in engines.values():
        e.close()
    # steady decode: batch rows, ignore_eos, timed after warmup
    times = {}
    for mode in ("off", on_mode):
        eng = Engine("radixkv-tiny", overlap=mode, max_running_requests=batch, **kw)
        steady = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
        for i in range(batch):
            eng.add_request(system + [3 + (i * 7 + j) % 250 for j in range(8 + i % 16)], steady)
        for _ in range(8):
            eng.step()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        times[mode] = (time.perf_counter() - t) / steps * 1e3
        while eng.has_unfinished():
            eng.step()
        eng.close()
    return {
        "auto_on": auto_on, "identical_outputs": identical,
        "common_prefix_fraction": common / total, "locks_left": locks,
        f"decode_b{batch}_off_ms": round(times["off"], 3),
        f"decode_b{batch}_on_ms": round(times[on_mode], 3),
        "on_over_off": round(times[on_mode] / times["off"], 3),
        "ok": auto_on and common >= 0.95 * total and not any(locks.values()),
    }  # fmt: skip


def check_lora(device: str = DEV) -> dict[str, Any]:
    """LoRA adapters on the GPU: one forward of a batch mixing the base model and two random
    adapters (radixkv-tiny, bf16, FlashInfer) against the same forward on the torch backend,
    per row; each adapter must move its rows' logits well past that tolerance. Then the engine
    serves the mix: greedy outputs against each request run alone (bf16 near-ties may flip:
    most tokens must agree), invariants and locks clean after."""
    import tempfile

    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.lora import save_random_adapter
    from radixkv.model.runner import ModelRunner, SeqInput

    eng = Engine("radixkv-tiny", device=device, dtype=TINY_DTYPE, num_pages=512)
    folder = tempfile.mkdtemp()
    for i, name in enumerate(("a", "b")):
        eng.load_lora(name, save_random_adapter(eng.model.config, f"{folder}/{name}", seed=i))
    slots = {None: 0} | {i.name: i.slot for i in eng.list_loras()}
    c = eng.model.config
    kv = KVPool(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, TINY_DTYPE, device)
    ref_runner = ModelRunner(eng.model.model, kv, backend="torch")  # same model: same slots
    ids = eng.tokenizer.encode("def read_lines(path):\n    with open(path) as f:\n")
    plan = [None, "a", "b", "a", None]
    seqs, page = [], 0
    for name in plan:
        n = (len(ids) + 15) // 16
        seqs.append(SeqInput(ids, list(range(page, page + n)), 0, slots[name]))
        page += n
    got = eng.runner.forward(seqs).float()  # flashinfer; pages 0.. of the engine's own pool
    ref = ref_runner.forward(seqs).float()
    diff = (got - ref).abs().max().item()
    moved = min((ref[i] - ref[0]).abs().max().item() for i, n in enumerate(plan) if n)
    prompts = ["import os\n" * 2 + "def f(x):\n", "class A:\n    def g(self):\n"] * 3
    loras = [None, "a", "b", "a", None, "b"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    eng.reset_prefix_cache()
    mixed = eng.generate(prompts, params, use_tqdm=False, lora=loras)
    alone = [eng.generate([p], params, use_tqdm=False, lora=n)[0] for p, n in zip(prompts, loras)]
    common, total = _agreeing_tokens([m.token_ids for m in mixed], [a.token_ids for a in alone])
    locks = _drained_locks(eng)
    return {
        "max_abs_diff": diff, "adapter_moves_logits_by": moved,
        "common_prefix_fraction": common / total, "namespaces": len(eng.cache.namespaces),
        "ok": diff <= 0.1 and moved > 1.0 and common >= 0.9 * total and locks == 0
        and [o.lora for o in mixed] == loras,
    }  # fmt: skip


def check_engine_tiers(device: str = DEV, backend: str = "flashinfer") -> dict[str, Any]:
    """See the module doc; ``device``/``backend`` let the same check run on a CPU (torch)."""
    import tempfile

    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base: dict[str, Any] = dict(device=device, dtype=TINY_DTYPE, attention_backend=backend,
                                cascade="off", page_size=16)  # fmt: skip
    rng = random.Random(0)
    system = [rng.randrange(3, 250) for _ in range(512)]
    convs = [list(system) for _ in range(16)]  # 16 chats x 3 turns, interleaved

    def run(engine: Engine) -> tuple[list[list[int]], dict[str, Any]]:
        hist = [list(c) for c in convs]
        outs = []
        turn_rng = random.Random(1)
        for _ in range(3):
            for i in turn_rng.sample(range(len(hist)), len(hist)):
                hist[i] += [turn_rng.randrange(3, 250) for _ in range(64)]
                (o,) = engine.generate([hist[i]], greedy, use_tqdm=False)
                toks = list(o.outputs[0].token_ids)
                outs.append(toks)
                hist[i] += toks
        if engine.host_kv_pool is not None:
            engine.cache.wait_all()
        engine.check_invariants()
        st = engine.stats()
        return outs, {
            "hit_rate": st.prefix_cache_hit_tokens / max(1, st.prefix_cache_query_tokens),
            "host_hit_tokens": st.prefix_cache_host_hit_tokens,
            "load_back_pages": st.load_back_pages,
            "locked_pages": st.locked_pages,
        }

    working_set = (512 + 16 * 3 * (64 + 16)) // 16  # pages
    unbounded, ref = run(Engine("radixkv-tiny", num_pages=4 * working_set, **base))
    tiered, stats = run(  # host loads layer by layer (per-layer CUDA events)
        Engine(
            "radixkv-tiny",
            num_pages=working_set // 4,
            host_cache_memory=64 << 20,
            host_layerwise_load="on",
            **base,
        )
    )
    whole, _ = run(  # host loads all at once: the same outputs as layer by layer (default)
        Engine(
            "radixkv-tiny",
            num_pages=working_set // 4,
            host_cache_memory=64 << 20,
            host_layerwise_load="off",
            **base,
        )
    )
    same = sum(a == b for a, b in zip(unbounded, tiered))
    n = len(unbounded)
    folder = tempfile.mkdtemp(prefix="radixkv-gpu-storage-")
    prompt = system + [rng.randrange(3, 250) for _ in range(32)]
    with Engine("radixkv-tiny", kv_storage=f"file://{folder}", **base) as first:
        (cold,) = first.generate([prompt], greedy, use_tqdm=False)
    with Engine("radixkv-tiny", kv_storage=f"file://{folder}", **base) as second:
        (warm,) = second.generate([prompt], greedy, use_tqdm=False)
        storage_hits = second.stats().prefix_cache_storage_hit_tokens
    auto = Engine("radixkv-tiny", device=device, dtype="auto", num_pages=64)
    return {
        "requests": n, "identical_outputs": f"{same}/{n}",
        "hit_rate_unbounded": ref["hit_rate"], "hit_rate_tiered": stats["hit_rate"],
        "host_hit_tokens": stats["host_hit_tokens"], "load_back_pages": stats["load_back_pages"],
        "layerwise_equals_all_at_once": whole == tiered,
        "storage_hit_tokens": storage_hits,
        "storage_outputs_equal": list(cold.outputs[0].token_ids) == list(warm.outputs[0].token_ids),
        "auto_dtype": str(auto.kv_pool.dtype), "auto_backend": auto.backend_choice.name,
        "ok": same == n and abs(ref["hit_rate"] - stats["hit_rate"]) < 1e-9
        and stats["host_hit_tokens"] > 0 and stats["locked_pages"] == 0 and whole == tiered
        and storage_hits >= 512 - 16
        and list(cold.outputs[0].token_ids) == list(warm.outputs[0].token_ids)
        and auto.kv_pool.dtype == torch.bfloat16,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
def _section(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception:
        value = {"ok": False, "error": traceback.format_exc()}
        print(f"[{key}] FAILED\n{value['error']}", flush=True)
    result[key] = value
    print(f"[{key}] {time.perf_counter() - t0:.1f} s", flush=True)


def _rows_ok(rows: Any) -> bool:
    if isinstance(rows, dict):
        return bool(rows.get("ok", "error" not in rows))
    return all(_rows_ok(r) for r in rows)


def _table(result: dict[str, Any]) -> str:
    lines = [f"# gpu_check: {'OK' if result['ok'] else 'FAILED'}", ""]
    lines.append(
        f"{result.get('device')}, torch {result.get('torch')} (CUDA {result.get('cuda')}), "
        f"flashinfer {result.get('flashinfer')}, {result.get('elapsed_s')} s"
    )
    lines += ["", "| section | cases | failed | worst diff |", "|---|---|---|---|"]
    for key in ("paged", "cascade", "window"):
        rows = result.get(key)
        if isinstance(rows, list):
            bad = [r for r in rows if not r["ok"]]
            worst = max((r["max_abs_diff"] for r in rows), default=float("nan"))
            lines.append(f"| {key} | {len(rows)} | {len(bad)} | {worst:.2e} |")
        else:
            lines.append(f"| {key} | error | - | - |")
    tiers = result.get("engine_tiers", {})
    if "identical_outputs" in tiers:
        lines.append(
            f"| engine_tiers | 1 | {int(not tiers['ok'])} | outputs {tiers['identical_outputs']}, "
            f"hit rate {tiers['hit_rate_tiered']:.3f} vs {tiers['hit_rate_unbounded']:.3f}, "
            f"storage hit {tiers['storage_hit_tokens']} tok, auto {tiers['auto_dtype']} |"
        )
    samp = result.get("sampling", {})
    if "adjust_max_abs_diff" in samp:
        lines.append(
            f"| sampling | 1 | {int(not samp['ok'])} | {samp['adjust_max_abs_diff']:.2e} |"
        )
    plp = result.get("prompt_logprobs", {})
    if "max_abs_diff" in plp:
        lines.append(f"| prompt_logprobs | 1 | {int(not plp['ok'])} | {plp['max_abs_diff']:.2e} |")
    spec = result.get("speculative", {})
    if "accepted" in spec:
        lines.append(
            f"| speculative | 1 | {int(not spec['ok'])} | steps {spec['steps_spec']} vs "
            f"{spec['steps_plain']}, common prefix {spec['common_prefix_fraction']:.3f} |"
        )
    ov = result.get("overlap", {})
    if "on_over_off" in ov:
        lines.append(
            f"| overlap | 1 | {int(not ov['ok'])} | identical {ov['identical_outputs']}, "
            f"common prefix {ov['common_prefix_fraction']:.3f}, step on/off {ov['on_over_off']} |"
        )
    tiny = result.get("tiny_model", {})
    if "max_abs_diff" in tiny:
        lines.append(f"| tiny_model | 1 | {int(not tiny['ok'])} | {tiny['max_abs_diff']:.2e} |")
    timings = result.get("timings", {})
    if "error" not in timings:
        lines += [
            "",
            "| timing (bf16, ps 16, one layer) | torch ms | flashinfer ms |",
            "|---|---|---|",
        ]
        for case in ("decode_b32_ctx2048", "prefill_4096", "prefill_128_on_3968"):
            if f"{case}/torch_ms" in timings:
                lines.append(
                    f"| {case} | {timings[f'{case}/torch_ms']:.3f} | {timings[f'{case}/flashinfer_ms']:.3f} |"
                )
    casc = result.get("cascade_timing")
    if isinstance(casc, list):
        lines += [
            "",
            "| B | prefix | plain us | cascade us | speedup | KV read ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in casc:
            lines.append(
                f"| {r['batch']} | {r['prefix']} | {r['plain_us']} | {r['cascade_us']} | {r['speedup']}x | {r['kv_read_ratio']}x |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    t_start = time.perf_counter()
    out_dir = Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do")
        return 2
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "jit_disabled": bool(os.environ.get("FLASHINFER_DISABLE_JIT")),
    }
    manifest = os.environ.get("GPU_KIT_MANIFEST")
    if manifest and Path(manifest).exists():
        kit = json.loads(Path(manifest).read_text())
        result["kit"] = {k: kit.get(k) for k in ("flashinfer", "cuda_arch", "nvcc", "kit_bytes")}
        result["kit"]["modules"] = len(kit.get("modules", []))
    try:
        import flashinfer

        result["flashinfer"] = flashinfer.__version__
        from flashinfer.jit import env as jit_env

        aot = jit_env.FLASHINFER_AOT_DIR
        result["aot_kernels"] = sorted(p.name for p in aot.iterdir()) if aot.exists() else []
    except Exception:
        result["error"] = f"flashinfer import failed: {traceback.format_exc()}"
        print(result["error"])
    if "error" not in result:
        torch.manual_seed(0)
        _section(result, "paged", lambda: [
            check_paged(kind, dt, ps) for dt in DTYPES for ps in PAGE_SIZES
            for kind in ("decode", "prefill", "mixed")
        ])  # fmt: skip
        _section(result, "cascade", lambda: [
            check_cascade(case, dt, ps) for dt in DTYPES for ps in PAGE_SIZES
            for case in ("two_level", "three_level", "three_partial")
        ])  # fmt: skip
        _section(result, "window", lambda: [
            check_window(case, kind, ps) for case in WINDOW_CASES for ps in PAGE_SIZES
            for kind in ("decode", "prefill", "mixed")
        ] + [check_hybrid(kind) for kind in ("decode", "prefill", "mixed")])  # fmt: skip
        _section(result, "tiny_model", check_tiny_model)
        _section(result, "engine_tiers", check_engine_tiers)
        _section(result, "sampling", check_sampling)
        _section(result, "prompt_logprobs", check_prompt_logprobs)
        _section(result, "speculative", check_speculative)
        _section(result, "lora", check_lora)
        _section(result, "moe", check_moe)
        _section(result, "overlap", check_overlap)
        _section(result, "timings", time_paged)
        _section(result, "cascade_timing", lambda: [time_cascade(p) for p in (4096, 32768)])
    sections = (
        "paged", "cascade", "window", "tiny_model", "engine_tiers", "sampling", "prompt_logprobs",
        "speculative", "lora", "moe", "overlap", "timings", "cascade_timing",
    )  # fmt: skip
    result["ok"] = "error" not in result and all(
        _rows_ok(result.get(s, {"ok": False})) for s in sections
    )
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    (out_dir / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    table = _table(result)
    (out_dir / "gpu_check.md").write_text(table)
    print(table)
    print(
        f"gpu_check: {'OK' if result['ok'] else 'FAILED'}; wrote {out_dir}/gpu_check.json, gpu_check.md"
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
