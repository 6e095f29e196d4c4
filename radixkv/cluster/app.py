"""Build and run a radixkv fleet on Ray Serve (the Python API behind ``radixkv serve-ray``).

::

    from radixkv.cluster import ClusterConfig, build_cluster_app
    app = build_cluster_app(ClusterConfig(model="radixkv-tiny", replicas=4))
    serve.run(app, name="radixkv", route_prefix="/")   # OpenAI routes at http://host:8000/v1/...

``router="affinity"`` (default) routes with :class:`RadixAffinityRouter`; ``router="default"``
with Ray Serve's default (power of two choices), for comparison. :func:`fleet_engine_stats`
reads every replica's own engine counters; ``POST /reset_prefix_cache`` through the ingress
resets every replica (see ``fanout.py``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixkv.cluster._ray import import_serve
from radixkv.cluster.affinity_config import AffinityConfig
from radixkv.cluster.fanout import pin_id
from radixkv.cluster.fanout import replica_actor_names as _actor_names
from radixkv.engine.config import EngineConfig

serve = import_serve()

REPLICA_DEPLOYMENT = "RadixKVReplica"
INGRESS_DEPLOYMENT = "RadixKVIngress"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """A fleet's shape (validated on construction).

    Attributes:
        model: model name or local HF folder, loaded by every replica (and the ingress loads
            its tokenizer).
        replicas: number of engine replicas.
        router: "affinity" (RadixAffinityRouter) or "default" (Ray Serve's).
        engine_kwargs: EngineConfig fields (page_size, num_pages, ...), for every replica.
        server_kwargs: ServerConfig fields (api_keys, admin_key, max_queue, ...).
        router_kwargs: AffinityConfig fields (imbalance_abs, imbalance_rel, ...).
        replica_num_cpus / ingress_num_cpus: Ray CPU reservation per actor (fractions allowed).
        max_ongoing_requests: per replica; beyond it Ray's back-pressure tries the next choice.
        stats_period_s: how often Ray pulls each replica's routing stats.
        summary_max_hashes: bound on the page hashes a replica reports.
        torch_threads: intra-op threads per replica (None: torch's default).
        ingress_replicas: number of ingress replicas (each has its own router state).
    """

    model: str = "radixkv-tiny"
    replicas: int = 2
    router: str = "affinity"
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    server_kwargs: Mapping[str, Any] = field(default_factory=dict)
    router_kwargs: Mapping[str, Any] = field(default_factory=dict)
    replica_num_cpus: float = 1.0
    ingress_num_cpus: float = 0.1
    max_ongoing_requests: int = 64
    stats_period_s: float = 1.0
    summary_max_hashes: int = 2048
    torch_threads: int | None = 1
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if self.router not in ("affinity", "default"):
            raise ValueError(f"router must be 'affinity' or 'default', got {self.router!r}")
        if not self.replica_num_cpus >= 0 or not self.ingress_num_cpus >= 0:
            raise ValueError("num_cpus must be >= 0")
        if not isinstance(self.max_ongoing_requests, int) or self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if not self.stats_period_s > 0:
            raise ValueError(f"stats_period_s must be > 0, got {self.stats_period_s}")
        if not isinstance(self.ingress_replicas, int) or self.ingress_replicas < 1:
            raise ValueError(f"ingress_replicas must be >= 1, got {self.ingress_replicas!r}")
        AffinityConfig(**self.router_kwargs)  # fail here, not inside a replica
        EngineConfig(**self.engine_kwargs)

    @property
    def page_size(self) -> int:
        return int(self.engine_kwargs.get("page_size", 16))

    @property
    def tokenizer_source(self) -> dict[str, Any]:
        """The engine options that decide the tokenizer (revision, gguf_file, tokenizer,
        chat_template): the ingress loads the replicas' tokenizer with them to hash prompts as
        they will."""
        keys = ("revision", "gguf_file", "tokenizer", "chat_template")
        return {k: self.engine_kwargs[k] for k in keys if self.engine_kwargs.get(k) is not None}


def build_cluster_app(config: ClusterConfig | None = None) -> Any:
    """The Ray Serve application (ingress bound to the engine replicas) for ``config``."""
    from ray.serve.config import RequestRouterConfig

    from radixkv.cluster.deployment import RadixKVIngress, RadixKVReplica
    from radixkv.cluster.router import PinnablePowerOfTwoRouter, RadixAffinityRouter

    cfg = config or ClusterConfig()
    router_cls = RadixAffinityRouter if cfg.router == "affinity" else PinnablePowerOfTwoRouter
    router_config = RequestRouterConfig(
        request_router_class=router_cls,
        request_router_kwargs=dict(cfg.router_kwargs) if cfg.router == "affinity" else {},
        request_routing_stats_period_s=cfg.stats_period_s,
    )
    replica = RadixKVReplica.options(
        name=REPLICA_DEPLOYMENT,
        num_replicas=cfg.replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        request_router_config=router_config,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus},
    ).bind(
        cfg.model,
        dict(cfg.engine_kwargs),
        dict(cfg.server_kwargs),
        summary_max_hashes=cfg.summary_max_hashes,
        torch_threads=cfg.torch_threads,
    )
    return RadixKVIngress.options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=cfg.ingress_replicas,
        max_ongoing_requests=max(256, cfg.max_ongoing_requests * cfg.replicas),
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus},
    ).bind(
        replica,
        cfg.model,
        cfg.page_size,
        dict(cfg.server_kwargs),
        tokenizer_source=cfg.tokenizer_source,
        lora_modules=cfg.engine_kwargs.get("lora_modules"),
    )


def replica_actor_names(app_name: str) -> list[str]:
    """Ray actor names (in namespace "serve") of the app's engine replicas, sorted."""
    return _actor_names(app_name, REPLICA_DEPLOYMENT)


def fleet_engine_stats(
    app_name: str, *, timeout_s: float = 60.0, attempts: int = 5, retry_s: float = 0.2
) -> list[dict[str, Any]]:
    """Every engine replica's own EngineStats (as dicts with a "replica" key), one per replica,
    in the order of the replicas' actor names.

    Calls are pinned to each replica through the router (``pin_replica``). A call answered by
    another replica is made again, up to ``attempts`` calls in all, ``retry_s`` apart: the
    handle is a fresh one, whose router may not list every replica yet, and routes a call
    pinned to an unlisted one like any other. A replica that is gone or does not answer in
    ``timeout_s`` is skipped. Call from synchronous code (the driver).
    """
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name)
    names = replica_actor_names(app_name)
    got: dict[str, dict[str, Any]] = {}
    missed = names  # replicas whose call was answered by another one (all, before the first)
    for attempt in range(max(1, attempts)):
        if attempt:
            time.sleep(retry_s)
        calls = [(n, handle.engine_stats.remote(pin_replica=pin_id(n))) for n in missed]
        missed = []
        for name, call in calls:
            try:
                answer = call.result(timeout_s=timeout_s)
            except Exception:  # gone, or no answer in time: asking again would not help
                continue
            if isinstance(answer, dict) and answer.get("replica") == name:
                got[name] = answer
            else:
                missed.append(name)
        if not missed:
            break
    return [got[n] for n in names if n in got]
