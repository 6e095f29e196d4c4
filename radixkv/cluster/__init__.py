"""radixkv on Ray Serve: engine replicas behind a prefix-affinity request router.

Install with ``pip install 'radixkv[ray]'`` (``ray[serve]==2.60.0``). Imports are lazy, so
``import radixkv.cluster`` needs no Ray; the pure scoring logic (``radixkv.cluster.affinity``)
never does. See docs/cluster.md.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AffinityConfig",
    "AffinityState",
    "ClusterConfig",
    "RadixAffinityRouter",
    "RadixKVIngress",
    "RadixKVReplica",
    "build_cluster_app",
    "fleet_engine_stats",
]

_WHERE = {
    "AffinityConfig": "radixkv.cluster.affinity",
    "AffinityState": "radixkv.cluster.affinity",
    "ClusterConfig": "radixkv.cluster.app",
    "build_cluster_app": "radixkv.cluster.app",
    "fleet_engine_stats": "radixkv.cluster.app",
    "RadixAffinityRouter": "radixkv.cluster.router",
    "RadixKVIngress": "radixkv.cluster.deployment",
    "RadixKVReplica": "radixkv.cluster.deployment",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'radixkv.cluster' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
