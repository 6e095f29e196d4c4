"""Backend registry: ``get_backend("auto" | "torch" | "flashinfer", ...)``.

``"auto"`` picks flashinfer when the pool is on CUDA in fp16/bf16 and flashinfer is installed,
else torch. flashinfer is
only imported inside :mod:`radixkv.attention.flashinfer_backend`, and only when chosen.
"""

from __future__ import annotations

import importlib.util

import torch

from radixkv.attention.base import AttentionBackend
from radixkv.kv.kv_pool import KVPool

BACKENDS = ("auto", "torch", "flashinfer")


def flashinfer_available() -> bool:
    """True if the ``flashinfer`` package can be found (does not import it)."""
    return importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, kv_pool: KVPool) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        on_cuda = kv_pool.device.type == "cuda"
        half = kv_pool.dtype in (torch.float16, torch.bfloat16)  # FlashInfer has no fp32 kernels
        return "flashinfer" if on_cuda and half and flashinfer_available() else "torch"
    return name


def get_backend(
    name: str,
    kv_pool: KVPool,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float | None = None,
) -> AttentionBackend:
    """Construct the named backend over ``kv_pool``."""
    resolved = resolve_backend_name(name, kv_pool)
    if resolved == "torch":
        from radixkv.attention.torch_backend import TorchAttention

        return TorchAttention(kv_pool, num_qo_heads, num_kv_heads, head_dim, scale)
    from radixkv.attention.flashinfer_backend import FlashInferAttention  # checks: CUDA pool

    return FlashInferAttention(kv_pool, num_qo_heads, num_kv_heads, head_dim, scale)
