"""Backend registry: ``get_backend("auto" | "torch" | "flashinfer" | ..., ...)``.

The backends are the rows of :data:`radixkv.attention.names.ATTENTION_BACKENDS` (a table, read by
name; a new backend is a row there or ``ATTENTION_BACKENDS.register(name, cls)``). ``"auto"`` picks flashinfer when the pool is on CUDA in fp16/bf16 and flashinfer is installed,
else torch; :func:`choose_backend` says which and why (the engine logs it, and warns when "auto"
leaves a CUDA pool on the torch kernels). flashinfer is only imported inside
:mod:`radixkv.attention.flashinfer_backend`, and only when chosen.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.attention.names import ATTENTION_BACKENDS, AUTO
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool


@dataclass(frozen=True)
class BackendChoice:
    """The backend ``name`` resolves to, ``reason`` (one clause, for the startup log) and
    ``fallback``: "auto" chose the torch kernels for a CUDA pool, which runs but far slower
    than FlashInfer would (the reason says what to change)."""

    name: str
    reason: str
    fallback: bool = False


def flashinfer_available() -> bool:
    """True if the ``flashinfer`` package can be found (does not import it)."""
    return importlib.util.find_spec("flashinfer") is not None


def pool_device_type(kv_pool: KVPool | HybridKVPool) -> str:
    """``"cuda"``, ``"cpu"``, ...: where the pool's buffers live (what "auto" decides on)."""
    return kv_pool.device.type


def choose_backend(name: str, kv_pool: KVPool | HybridKVPool) -> BackendChoice:
    """Resolve ``name`` for ``kv_pool``: explicit names are kept; "auto" is flashinfer on a CUDA
    pool in fp16/bf16 with flashinfer installed, else torch. ValueError listing the backends on
    an unknown name."""
    ATTENTION_BACKENDS.check(name)
    if name != AUTO:
        return BackendChoice(name, "requested")
    device = pool_device_type(kv_pool)
    if device != "cuda":
        return BackendChoice("torch", f"auto: the KV pool is on {device} (flashinfer needs CUDA)")
    dtype = str(kv_pool.compute_dtype).removeprefix("torch.")
    if kv_pool.dtype != kv_pool.compute_dtype:  # see FlashInferAttention
        stored = str(kv_pool.dtype).removeprefix("torch.")
        return BackendChoice(
            "torch",
            f"auto: the pages store {stored} (kv_cache_dtype); the flashinfer backend reads "
            "them in the model's dtype only",
            fallback=True,
        )
    if kv_pool.compute_dtype not in (torch.float16, torch.bfloat16):  # FlashInfer: no fp32
        return BackendChoice(
            "torch",
            f"auto: flashinfer has no {dtype} kernels (serve in bfloat16 or float16 to use it)",
            fallback=True,
        )
    if not flashinfer_available():
        return BackendChoice(
            "torch",
            "auto: flashinfer is not installed (pip install 'radixkv[gpu]')",
            fallback=True,
        )
    return BackendChoice("flashinfer", f"auto: CUDA pool in {dtype} and flashinfer is installed")


def resolve_backend_name(name: str, kv_pool: KVPool | HybridKVPool) -> str:
    return choose_backend(name, kv_pool).name


def get_backend(
    name: str,
    kv_pool: KVPool | HybridKVPool,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float | None = None,
    layer_windows: Sequence[int] = (),
    softcap: float | None = None,
) -> AttentionBackend:
    """Construct the named backend over ``kv_pool``; ``layer_windows``: each layer's sliding
    window (see :class:`AttentionBackend`; empty: every layer attends in full); ``softcap``:
    the tanh cap of attention scores (None: none). A :class:`HybridKVPool` gets a
    :class:`HybridAttention` holding a backend of that kind per pool (attention/hybrid.py)."""
    if isinstance(kv_pool, HybridKVPool):
        from radixkv.attention.hybrid import HybridAttention

        def make(pool: KVPool, windows: tuple[int, ...]) -> AttentionBackend:
            return get_backend(
                name, pool, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, scale=scale, layer_windows=windows, softcap=softcap,
            )  # fmt: skip

        return HybridAttention(
            kv_pool, num_qo_heads, num_kv_heads, head_dim, scale,
            make=make, layer_windows=layer_windows, softcap=softcap,
        )  # fmt: skip
    backend = ATTENTION_BACKENDS.get(resolve_backend_name(name, kv_pool))
    return backend(
        kv_pool, num_qo_heads, num_kv_heads, head_dim, scale,
        layer_windows=layer_windows, softcap=softcap,
    )  # fmt: skip
