"""GPU check of the host tier's copier (run by hand on a CUDA machine, never in CI).

KVCopier on a CUDA KVPool with a pinned HostKVPool: pages written by work still queued on the
current stream are backed up correctly (the side stream waits for it), a round trip device ->
host -> other device pages is bit-exact, a copy overlaps work on the current stream, a
RadixCache with the tier loads back exact KV, and the transfer rate of 64 pages each way.
Layer-wise loads (``layerwise=True``; off by default until measured here to pay): the handle
is a per-layer one registered in ``kv.loads``, a reader on the current stream that waits for
layer i (``wait_layer``) and reads it at once sees exact data in every layer while later
layers are still in flight, the pool's ``loads`` empties once the load is waited for; and the
transfer rate and issue cost of a load layer by layer vs all at once.
Results go to $OUT/gpu_check_tiers.json (or bench/results/gpu_check_tiers.json).

    python bench/gpu_check_tiers.py      # exit status 1 if any check fails
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixkv.cache import PagePool, TieredRadixCache
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool

LAYERS, PS, HKV, D = 28, 16, 8, 128


def check_round_trip(dtype: torch.dtype) -> dict[str, Any]:
    kv = KVPool(LAYERS, 256, PS, HKV, D, dtype, "cuda")
    host = HostKVPool.like(kv, 128)
    assert host.pin_memory and host.k.is_pinned()
    copier = KVCopier(kv, host)
    src = list(range(0, 64))
    # write on the current stream and back up at once: the copy must see the writes
    big = torch.randn((LAYERS, 64, PS, HKV, D), device="cuda").to(dtype)
    torch.cuda._sleep(50_000_000)  # keep the current stream busy so the writes land late
    kv.k[:, src] = big
    kv.v[:, src] = -big
    h = copier.to_host([(s, s + 10) for s in src])
    h.wait()
    ok_backup = bool(torch.equal(host.k[10:74].transpose(0, 1).cuda(), big))
    dst = list(range(128, 192))
    h = copier.to_device([(s + 10, d) for s, d in zip(src, dst)])
    done_early = h.done()
    h.wait()
    ok_k = bool(torch.equal(kv.k[:, dst], big))
    ok_v = bool(torch.equal(kv.v[:, dst], -big))
    return {"dtype": str(dtype), "backup_sees_queued_writes": ok_backup, "round_trip_k": ok_k,
            "round_trip_v": ok_v, "load_was_async": not done_early,
            "ok": ok_backup and ok_k and ok_v}  # fmt: skip


def check_layerwise(dtype: torch.dtype) -> dict[str, Any]:
    """A layer-wise load read layer by layer on the current stream as it lands."""
    kv = KVPool(LAYERS, 256, PS, HKV, D, dtype, "cuda")
    host = HostKVPool.like(kv, 128)
    copier = KVCopier(kv, host, layerwise=True)
    big = torch.randn((64, LAYERS, PS, HKV, D)).to(dtype)
    host.k[:64] = big
    host.v[:64] = -big
    dst = list(range(100, 164))
    torch.cuda.synchronize()
    h = copier.to_device(list(zip(range(64), dst)))
    layered = hasattr(h, "wait_layer") and h in kv.loads.pending
    reads_k, reads_v = [], []
    for layer in range(LAYERS):  # what a forward does: wait for the layer, read it at once
        kv.loads.wait(layer)
        reads_k.append(kv.k[layer, dst].clone())
        reads_v.append(kv.v[layer, dst].clone())
    torch.cuda.synchronize()
    exact = all(
        bool(torch.equal(reads_k[i].cpu(), big[:, i]))
        and bool(torch.equal(reads_v[i].cpu(), -big[:, i]))
        for i in range(LAYERS)
    )
    h.wait()
    return {"dtype": str(dtype), "layered_handle": layered, "exact_per_layer_reads": exact,
            "loads_empty_after_wait": not kv.loads.pending,
            "ok": layered and exact and not kv.loads.pending}  # fmt: skip


def time_layerwise() -> dict[str, Any]:
    """GB/s of a 64-page load, layer by layer vs all at once (both on the side stream)."""
    out = {}
    for name, on in (("layerwise", True), ("all_at_once", False)):
        kv = KVPool(LAYERS, 256, PS, HKV, D, torch.bfloat16, "cuda")
        host = HostKVPool.like(kv, 256)
        copier = KVCopier(kv, host, layerwise=on)
        pairs = [(i, i) for i in range(64)]
        copier.to_device(pairs).wait()
        t = time.perf_counter()
        for _ in range(10):
            copier.to_device(pairs).wait()
        dt = (time.perf_counter() - t) / 10
        out[f"to_device_{name}_GBps"] = 64 * kv.bytes_per_page / dt / 1e9
        # what the issuing thread pays (Python enqueueing the copies)
        t = time.perf_counter()
        h = copier.to_device(pairs)
        out[f"to_device_{name}_issue_ms"] = 1e3 * (time.perf_counter() - t)
        h.wait()
    return out


def check_cache() -> dict[str, Any]:
    kv = KVPool(LAYERS, 16, PS, HKV, D, torch.bfloat16, "cuda")
    host = HostKVPool.like(kv, 32)
    copier = KVCopier(kv, host)
    cache = TieredRadixCache(PagePool(16), PS, host_pool=PagePool(32), copier=copier)
    tokens = list(range(8 * PS))
    pages = cache.alloc(8)
    for i, p in enumerate(pages):
        kv.k[:, p] = float(i + 1)
        kv.v[:, p] = -float(i + 1)
    cache.insert(tokens, pages)
    cache.wait_all()
    cache.evict(8)
    other = cache.alloc(8)
    kv.k[:, other] = 0.0
    cache.pool.free(other)
    lb = cache.load_back(cache.match_prefix(tokens))
    cache.lock(lb.node)
    ok = cache.wait_load(lb) and all(
        bool(torch.all(kv.k[:, p] == float(i + 1))) for i, p in enumerate(lb.pages)
    )
    cache.unlock(lb.node)
    cache.check_invariants()
    return {"ok": bool(ok), "loaded_pages": cache.stats.loaded_pages}


def time_copies() -> dict[str, Any]:
    kv = KVPool(LAYERS, 256, PS, HKV, D, torch.bfloat16, "cuda")
    host = HostKVPool.like(kv, 256)
    copier = KVCopier(kv, host)
    pairs = [(i, i) for i in range(64)]
    out = {}
    for name, fn in (("to_host", copier.to_host), ("to_device", copier.to_device)):
        fn(pairs).wait()
        t = time.perf_counter()
        for _ in range(10):
            fn(pairs).wait()
        dt = (time.perf_counter() - t) / 10
        out[f"{name}_GBps"] = 64 * kv.bytes_per_page / dt / 1e9
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    res = {
        "round_trip": [check_round_trip(dt) for dt in (torch.bfloat16, torch.float32)],
        "cache": check_cache(),
        "layerwise": [check_layerwise(dt) for dt in (torch.bfloat16, torch.float32)],
        "timing": time_copies(),
        "timing_layerwise": time_layerwise(),
        "device": torch.cuda.get_device_name(),
    }
    ok = all(r["ok"] for r in res["round_trip"] + res["layerwise"]) and res["cache"]["ok"]
    res["ok"] = ok
    out = Path(os.environ.get("OUT", Path(__file__).parent / "results")) / "gpu_check_tiers.json"
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
