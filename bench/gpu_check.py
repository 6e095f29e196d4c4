"""GPU check (run by hand on a CUDA machine, never in CI): flashinfer backend vs torch backend.

For bf16 and fp16 and page sizes 1 and 16, random mixed batches (fresh prefills, chunks on a past,
decodes) are run through the flashinfer backend and, as the reference, through the torch backend
in fp32 on the same values; outputs must agree within bf16 2e-2 / fp16 2e-3 and the written K/V
must match exactly. Then both
are timed on a decode batch (32 x 2048) and a 4096-token prefill, and radixkv-tiny's logits are
compared end to end. Results go to $OUT/gpu_check.json (or bench/results/gpu_check.json).

    python bench/gpu_check.py            # exit status 1 if any check fails
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixkv.attention.base import BatchLayout
from radixkv.attention.registry import get_backend
from radixkv.kv.kv_pool import KVPool

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
HQ, HKV, D = 32, 8, 128


def _pool(page_size: int, num_pages: int, dtype: torch.dtype, seed: int) -> KVPool:
    kv = KVPool(1, num_pages, page_size, HKV, D, dtype, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen, device="cuda"))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen, device="cuda"))
    return kv


def _random_batch(page_size: int, seed: int) -> tuple[list[list[int]], list[int], list[int], int]:
    gen = torch.Generator().manual_seed(seed)
    past, new = [], []
    for kind in torch.randint(0, 3, (12,), generator=gen).tolist():
        if kind == 0:  # fresh prefill
            past.append(0)
            new.append(int(torch.randint(1, 300, (1,), generator=gen)))
        elif kind == 1:  # chunk on a past, not page aligned
            past.append(int(torch.randint(1, 700, (1,), generator=gen)))
            new.append(int(torch.randint(2, 200, (1,), generator=gen)))
        else:  # decode
            past.append(int(torch.randint(1, 1500, (1,), generator=gen)))
            new.append(1)
    needs = [(p + n + page_size - 1) // page_size for p, n in zip(past, new)]
    perm = torch.randperm(sum(needs), generator=gen).tolist()
    tables, used = [], 0
    for n in needs:
        tables.append(perm[used : used + n])
        used += n
    return tables, past, new, sum(needs)


def check_backends(dtype: torch.dtype, page_size: int, seed: int) -> dict[str, Any]:
    tables, past, new, num_pages = _random_batch(page_size, seed)
    layout = BatchLayout.build(tables, past, new)
    t = sum(new)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = torch.randn(t, HQ, D, generator=gen, device="cuda").to(dtype)
    k = torch.randn(t, HKV, D, generator=gen, device="cuda").to(dtype)
    v = torch.randn(t, HKV, D, generator=gen, device="cuda").to(dtype)
    # reference: the torch backend in fp32 on the same (bf16/fp16-representable) values
    fi_kv = _pool(page_size, num_pages, dtype, seed)
    ref_kv = KVPool(1, num_pages, page_size, HKV, D, torch.float32, "cuda")
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
        "dtype": str(dtype),
        "page_size": page_size,
        "seed": seed,
        "num_tokens": t,
        "num_seqs": len(new),
        "max_abs_diff": diff,
        "tolerance": TOL[dtype],
        "kv_written_equal": kv_equal,
        "ok": diff <= TOL[dtype] and kv_equal,
    }


def _time_cuda(fn: Any, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats  # ms


def time_backends(dtype: torch.dtype) -> dict[str, Any]:
    ps = 16
    rows: dict[str, Any] = {}
    cases = {
        "decode_b32_ctx2048": ([2047] * 32, [1] * 32),
        "prefill_4096": ([0], [4096]),
        "prefill_128_on_3968": ([3968], [128]),
    }
    for case, (past, new) in cases.items():
        needs = [(p + n + ps - 1) // ps for p, n in zip(past, new)]
        tables, used = [], 0
        for n in needs:
            tables.append(list(range(used, used + n)))
            used += n
        layout = BatchLayout.build(tables, past, new)
        t = sum(new)
        q = torch.randn(t, HQ, D, device="cuda", dtype=dtype)
        k = torch.randn(t, HKV, D, device="cuda", dtype=dtype)
        for name in ("torch", "flashinfer"):
            kv = _pool(ps, used, dtype, 0)
            backend = get_backend(name, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
            backend.plan(layout)
            rows[f"{case}/{name}_ms_per_layer"] = _time_cuda(
                lambda b=backend, q=q, k=k: b.forward(0, q, k, k)
            )
            plan_t0 = time.perf_counter()
            for _ in range(10):
                backend.plan(layout)
            torch.cuda.synchronize()
            rows[f"{case}/{name}_plan_ms"] = (time.perf_counter() - plan_t0) * 100
    return rows


def check_tiny_model() -> dict[str, Any]:
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner, SeqInput

    lm = load_model("radixkv-tiny", device="cuda", dtype=torch.bfloat16)
    c = lm.config
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    logits = {}
    for name in ("torch", "flashinfer"):
        kv = KVPool(c.num_layers, 64, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, "cuda")
        runner = ModelRunner(lm.model, kv, backend=name)
        table = list(range(64))
        first = runner.forward([SeqInput(ids[:500], table, 0)], all_logits=True)
        rest = runner.forward([SeqInput(ids[500:], table, 500)], all_logits=True)
        logits[name] = torch.cat([first, rest])
    diff = (logits["torch"] - logits["flashinfer"]).abs().max().item()
    scale = logits["torch"].abs().max().item()
    same_argmax = (logits["torch"].argmax(-1) == logits["flashinfer"].argmax(-1)).float().mean()
    return {
        "max_abs_diff": diff,
        "logit_scale": scale,
        "argmax_agreement": same_argmax.item(),
        "ok": diff <= 0.05 * scale,
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to do")
        return 2
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "checks": [],
        "timings": {},
    }
    try:
        import flashinfer

        result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as exc:
        result["error"] = f"flashinfer import failed: {exc!r}"
    ok = "error" not in result
    if ok:
        for dtype in (torch.bfloat16, torch.float16):
            for ps in (1, 16):
                for seed in (0, 1):
                    try:
                        row = check_backends(dtype, ps, seed)
                    except Exception:
                        row = {
                            "dtype": str(dtype),
                            "page_size": ps,
                            "seed": seed,
                            "ok": False,
                            "error": traceback.format_exc(),
                        }
                    result["checks"].append(row)
                    ok &= row["ok"]
                    print(json.dumps(row))
        for dtype in (torch.bfloat16,):
            try:
                result["timings"][str(dtype)] = time_backends(dtype)
            except Exception:
                result["timings"][str(dtype)] = {"error": traceback.format_exc()}
        try:
            result["tiny_model"] = check_tiny_model()
            ok &= result["tiny_model"]["ok"]
        except Exception:
            result["tiny_model"] = {"ok": False, "error": traceback.format_exc()}
            ok = False
    result["ok"] = ok
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["timings"], indent=2))
    print(f"gpu_check: {'OK' if ok else 'FAILED'}; wrote {path}")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------
# Cascade (shared-prefix) decode attention, issue 5: FlashInfer's multi-level cascade and the
# per-level wrappers against the torch cascade in fp32, plus timings (see bench/bench_cascade.py).
def check_cascade() -> bool:
    """Run ``bench_cascade.gpu_check_cascade``; write gpu_check_cascade.json next to the rest."""
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from bench_cascade import gpu_check_cascade

        rows = gpu_check_cascade("cuda")
        result: dict[str, Any] = {"rows": rows, "ok": all(r["ok"] for r in rows)}
    except Exception:
        result = {"ok": False, "error": traceback.format_exc()}
    (out_dir / "gpu_check_cascade.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu_check cascade: {'OK' if result['ok'] else 'FAILED'}")
    return bool(result["ok"])


if __name__ == "__main__":
    rc = main()
    sys.exit(rc if check_cascade() else 1)
