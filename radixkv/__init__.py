"""radixkv: a radix-tree prefix KV cache and a small inference engine around it.

Exports are resolved lazily so that ``import radixkv`` stays cheap and torch-free
for users of the cache alone (``radixkv.RadixCache`` never imports torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # cache layer (torch-free)
    "PagePool": "radixkv.cache.page_pool",
    "OutOfPages": "radixkv.cache.errors",
    "RadixCache": "radixkv.cache.radix_cache",
    "TieredRadixCache": "radixkv.cache.tiered_cache",
    "build_cache": "radixkv.cache.build",
    "MatchResult": "radixkv.cache.results",
    "InsertResult": "radixkv.cache.results",
    "CacheStats": "radixkv.cache.stats",
    "LoadBack": "radixkv.cache.tiers",
    # kv / model layers
    "KVPool": "radixkv.kv.kv_pool",
    "HostKVPool": "radixkv.kv.host_pool",
    "KVCopier": "radixkv.kv.copier",
    "load_model": "radixkv.model.loader",
    # engine
    "Engine": "radixkv.engine.engine",
    "EngineConfig": "radixkv.engine.config",
    "AsyncEngine": "radixkv.engine.async_engine",
    "SamplingParams": "radixkv.engine.params",
    "GuidedDecodingParams": "radixkv.engine.params",
    "RequestOutput": "radixkv.engine.outputs",
    "RequestMetrics": "radixkv.engine.outputs",
    "EngineStats": "radixkv.engine.outputs",
    "WeightUpdate": "radixkv.engine.outputs",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
