"""Engine configuration (validated on construction) and the wiring of model, KV pool and cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~1M tokens of radixkv-tiny (1 KiB of K+V per token)
_DEFAULT_GPU_KV_FRACTION = 0.5  # of the free GPU memory after the weights are loaded


def _pos_int(name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine knobs. ``num_pages`` wins over ``kv_cache_memory`` (bytes); with neither, the KV
    pool gets 1 GiB on the CPU or half the free memory on a GPU. ``chunked_prefill_size`` None
    or 0 disables chunking; a step computes at most ``min(max_prefill_tokens,
    chunked_prefill_size)`` prefill tokens in all. ``prefill_budget`` says what that counts: new tokens
    ("tokens") or new tokens plus their attention to past ones ("attention", see
    engine/prefill_cost.py)."""

    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = 2048
    prefill_budget: str = "tokens"
    schedule_policy: str = "lpm"
    enable_prefix_cache: bool = True
    eviction_policy: str = "lru"
    attention_backend: str = "auto"
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _pos_int("page_size", self.page_size)
        if self.num_pages is not None:
            _pos_int("num_pages", self.num_pages)
        if self.kv_cache_memory is not None:
            _pos_int("kv_cache_memory", self.kv_cache_memory)
        _pos_int("max_running_requests", self.max_running_requests)
        _pos_int("max_prefill_tokens", self.max_prefill_tokens)
        if self.chunked_prefill_size not in (None, 0):
            _pos_int("chunked_prefill_size", self.chunked_prefill_size)
        if self.prefill_budget not in ("tokens", "attention"):
            raise ValueError(
                f"prefill_budget must be 'tokens' or 'attention', got {self.prefill_budget!r}"
            )
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(
                f"schedule_policy must be 'lpm' or 'fcfs', got {self.schedule_policy!r}"
            )
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(
                f"enable_prefix_cache must be a bool, got {self.enable_prefix_cache!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")


@dataclass
class Components:
    model: Any  # LoadedModel
    tokenizer: Any
    kv_pool: Any  # KVPool
    pool: Any  # PagePool
    cache: Any  # RadixCache
    runner: Any  # ModelRunner
    eos_token_ids: frozenset[int]


def build_components(model: Any, cfg: EngineConfig) -> Components:
    from radixkv.cache.page_pool import PagePool
    from radixkv.cache.radix_cache import RadixCache
    from radixkv.kv.kv_pool import KVPool
    from radixkv.model.loader import LoadedModel, load_model
    from radixkv.model.runner import ModelRunner

    if isinstance(model, LoadedModel):
        lm = model
        device = next(lm.model.parameters()).device
    else:
        device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        lm = load_model(model, device=device, dtype=cfg.dtype)
    mc = lm.config
    dtype = next(lm.model.parameters()).dtype
    shape = dict(
        num_layers=mc.num_layers,
        page_size=cfg.page_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
    )
    if cfg.num_pages is not None:
        kv = KVPool(num_pages=cfg.num_pages, **shape)
    else:
        budget = cfg.kv_cache_memory
        if budget is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budget = int(free * _DEFAULT_GPU_KV_FRACTION)
            else:
                budget = _DEFAULT_CPU_KV_BYTES
        # more pages than the context could ever address across max_running is waste
        cap = -(-mc.max_position_embeddings // cfg.page_size) * cfg.max_running_requests
        kv = KVPool.from_memory_budget(budget, max_pages=cap, **shape)
    pool = PagePool(kv.num_pages)
    cache = RadixCache(pool, page_size=cfg.page_size, policy=cfg.eviction_policy)
    runner = ModelRunner(lm.model, kv, backend=cfg.attention_backend)
    eos = set(lm.tokenizer.eos_token_ids) | set(getattr(mc, "eos_token_ids", ()) or ())
    return Components(lm, lm.tokenizer, kv, pool, cache, runner, frozenset(eos))
