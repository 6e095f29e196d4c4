"""Prometheus metrics for one app, in its own CollectorRegistry (apps and tests never collide).

Two sources:
- request-level series the server observes itself (TTFT, queue time, time per output token,
  latency, requests by finish reason, prompt/generated/cached token counters, HTTP errors by
  status, requests whose client went away);
- engine/cache series read from ``engine.stats()`` at scrape time by ``EngineStatsCollector``
  (prefix cache queries and hits in tokens, hit rate, KV pages used/total/cached/locked/private,
  evictions, running/waiting requests, aborts, preemptions), so they are never stale and cost
  nothing between scrapes;
- per tenant (label ``tenant``: the key file's tenant name, never a key, capped at
  ``MAX_TENANT_LABELS`` names, the rest as ``other``): running and waiting sequences and queued
  prompt tokens, read from the server's TenantLimiter at scrape time, and requests refused for
  a per-tenant limit (server/tenant_limits.py), by limit.

Every series carries a ``model_name`` label (the served model id), as vLLM's and SGLang's do, so
dashboards that aggregate several servers can tell models apart. docs/serving.md lists each
series with its vLLM / SGLang counterpart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("radixkv.server")

PREFIX = "radixkv"
# distinct tenant label values at most (the others are counted under OTHER_TENANTS)
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "other"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_QUEUE_BUCKETS = (
    0.0005,
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# where a client that went away was: sending its body, waiting for a whole answer, or streaming
CLIENT_CLOSED_PHASES = ("body", "waiting", "streaming")

# metric suffix -> (kind, help, EngineStats field)
_ENGINE_SERIES: dict[str, tuple[str, str, str]] = {
    "prefix_cache_queries_tokens": (
        "counter",
        "Prompt tokens looked up in the prefix cache",
        "prefix_cache_query_tokens",
    ),
    "prefix_cache_hits_tokens": (
        "counter",
        "Prompt tokens served from the prefix cache",
        "prefix_cache_hit_tokens",
    ),
    "prefix_cache_queries": (
        "counter",
        "Prefix cache lookups (requests)",
        "prefix_cache_queries",
    ),
    "prefix_cache_evicted_pages": (
        "counter",
        "KV pages evicted from the prefix cache",
        "evicted_pages",
    ),
    "prefix_cache_hit_rate": (
        "gauge",
        "Prefix cache hit rate in tokens since start (hits / queries)",
        "prefix_cache_hit_rate",
    ),
    "kv_pages_used": (
        "gauge",
        "KV pages in use (cached or held by running requests)",
        "kv_pages_used",
    ),
    "kv_pages_total": (
        "gauge",
        "KV pages in the pool",
        "kv_pages_total",
    ),
    "kv_pages_cached": (
        "gauge",
        "KV pages owned by the prefix cache",
        "cached_pages",
    ),
    "kv_pages_locked": (
        "gauge",
        "Cached KV pages locked by running requests or sessions (not evictable now)",
        "locked_pages",
    ),
    "kv_pages_private": (
        "gauge",
        "KV pages held privately by running requests (not in the prefix cache yet)",
        "private_pages",
    ),
    "kv_usage_ratio": (
        "gauge",
        "Fraction of KV pages in use",
        "kv_usage",
    ),
    "window_slots_total": (
        "gauge",
        "Window slots (a KV page's K/V in the sliding-window layers; hybrid window KV only)",
        "window_slots_total",
    ),
    "window_slots_pinned": (
        "gauge",
        "Window slots the windows of running requests read",
        "window_slots_pinned",
    ),
    "window_slots_cached": (
        "gauge",
        "Window slots kept for cached pages (taken when slots run short)",
        "window_slots_cached",
    ),
    "window_slots_evicted": (
        "counter",
        "Window slots taken from cached pages",
        "window_slots_evicted",
    ),
    "prefix_cache_window_trimmed_tokens": (
        "counter",
        "Cached prompt tokens recomputed because the window before them had lost its slots",
        "window_trimmed_tokens",
    ),
    "prefix_cache_device_hits_tokens": (
        "counter",
        "Prompt tokens served from the device KV pool",
        "prefix_cache_device_hit_tokens",
    ),
    "prefix_cache_host_hits_tokens": (
        "counter",
        "Prompt tokens served from the host KV tier (loaded back, not recomputed)",
        "prefix_cache_host_hit_tokens",
    ),
    "host_load_back_pages": (
        "counter",
        "KV pages copied back from the host tier to the device",
        "load_back_pages",
    ),
    "host_load_back_seconds": (
        "counter",
        "Seconds admissions waited for host-tier load backs",
        "load_back_seconds",
    ),
    "host_load_back_failures": (
        "counter",
        "Host-tier load backs that failed (served as misses)",
        "load_back_failures",
    ),
    "host_backup_pages": (
        "counter",
        "KV pages copied from the device to the host tier",
        "backup_pages",
    ),
    "host_write_back_pages": (
        "counter",
        "KV pages copied to the host tier when evicted from the device (write_back)",
        "write_back_pages",
    ),
    "host_kv_pages_used": ("gauge", "Host-tier KV pages in use", "host_pages_used"),
    "host_kv_pages_total": ("gauge", "KV pages in the host tier", "host_pages_total"),
    "host_kv_usage_ratio": ("gauge", "Fraction of host-tier KV pages in use", "host_usage"),
    "prefix_cache_storage_hits_tokens": (
        "counter",
        "Prompt tokens served from the storage tier (prefetched to host memory, loaded back)",
        "prefix_cache_storage_hit_tokens",
    ),
    "storage_prefetch_jobs": (
        "counter",
        "Storage lookups started for queued requests",
        "storage_prefetch_jobs",
    ),
    "storage_prefetch_pages": (
        "counter",
        "KV pages prefetched from storage into the host tier",
        "storage_prefetch_pages",
    ),
    "storage_prefetch_seconds": (
        "counter",
        "Seconds the storage reader spent on prefetch lookups",
        "storage_prefetch_seconds",
    ),
    "storage_prefetch_timeouts": (
        "counter",
        "Storage lookups cut short by the timeout (their requests proceeded as misses)",
        "storage_prefetch_timeouts",
    ),
    "storage_write_pages": ("counter", "KV pages written to storage", "storage_write_pages"),
    "storage_dropped_write_pages": (
        "counter",
        "KV pages not written to storage: write queue full, or storage unavailable",
        "storage_dropped_write_pages",
    ),
    "storage_errors": (
        "counter",
        "Failed storage calls (unreachable, timeout, full, permission, I/O)",
        "storage_errors",
    ),
    "storage_corrupt_objects": (
        "counter",
        "Corrupt KV objects found in storage (deleted, served as misses)",
        "storage_corrupt_objects",
    ),
    "storage_available": (
        "gauge",
        "1 while the storage tier is usable, 0 during an outage's back-off",
        "storage_available",
    ),
    "spec_decode_num_draft_tokens": (
        "counter",
        "Draft tokens proposed by prompt lookup (speculative decoding)",
        "speculative_draft_tokens",
    ),
    "spec_decode_num_accepted_tokens": (
        "counter",
        "Draft tokens accepted (each a decode step saved)",
        "speculative_accepted_tokens",
    ),
    "num_requests_running": ("gauge", "Requests running in the engine", "num_running"),
    "num_requests_waiting": ("gauge", "Requests waiting in the engine", "num_waiting"),
    "num_aborted_requests": (
        "counter",
        "Requests aborted before they finished (client gone, cancelled, server shutdown)",
        "num_aborted",
    ),
    "num_sequence_errors": (
        "counter",
        "Sequences ended alone with an error while served (grammar, sampling, detokenizing...)",
        "num_sequence_errors",
    ),
    "num_batch_failures": (
        "counter",
        "Batches failed whole by a model forward error (the engine recovered)",
        "num_batch_failures",
    ),
    "num_preemptions": (
        "counter",
        "Sequences preempted to free KV pages (they resume from their cached pages)",
        "num_preemptions",
    ),
    "weight_updates": (
        "counter",
        "Weight updates served (POST /update_weights_from_disk, Engine.update_weights)",
        "weight_updates",
    ),
    "weight_update_retracted": (
        "counter",
        "Running sequences sent back by weight updates (recomputed under the new weights)",
        "weight_update_retracted",
    ),
}


def _lookup(stats: Any, field: str) -> float | None:
    value = getattr(stats, field, None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class EngineStatsCollector(Collector):
    """Reads ``stats_fn()`` on every scrape; a series whose attribute the stats lack is skipped."""

    def __init__(self, stats_fn: Callable[[], Any], model_name: str) -> None:
        self._stats_fn = stats_fn
        self._labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:  # a failing stats call must not break the /metrics endpoint
            log.exception("engine stats failed during scrape")
            return
        for suffix, (kind, doc, field) in _ENGINE_SERIES.items():
            value = _lookup(stats, field)
            if value is None:
                continue
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric = family(f"{PREFIX}_{suffix}", doc, labels=["model_name"])
            metric.add_metric(self._labels, value)
            yield metric
        running = getattr(stats, "running_lora_adapters", None)
        if running is not None:  # vLLM's lora_requests_info: the adapters in use, as labels
            info = GaugeMetricFamily(
                f"{PREFIX}_lora_requests_info",
                "LoRA adapters used by running and waiting requests (comma-separated labels; "
                "max_lora: adapters loaded); the value is the scrape's Unix time",
                labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            info.add_metric(
                [
                    *self._labels,
                    ",".join(running),
                    ",".join(stats.waiting_lora_adapters),
                    str(stats.num_lora_adapters),
                ],
                time.time(),
            )
            yield info


class TenantLabels:
    """The ``tenant`` label value of each tenant: its name (the key file's, never the key) for
    the first ``MAX_TENANT_LABELS`` tenants seen, ``"other"`` for the rest, ``"-"`` for the
    anonymous tenant of a server without keys, so the series stay bounded however many keys
    come and go."""

    def __init__(self, most: int = MAX_TENANT_LABELS) -> None:
        self._most = most
        self._names: dict[str, str] = {}

    def __call__(self, tenant: str) -> str:
        label = self._names.get(tenant)
        if label is None:
            if len(self._names) >= self._most:
                return OTHER_TENANTS
            label = self._names[tenant] = tenant or "-"
        return label


class TenantLoadCollector(Collector):
    """Each tenant's running and waiting sequences and queued prompt tokens, read from
    ``load_fn()`` (``TenantLimiter.load``: tenants with none are absent) on every scrape."""

    def __init__(
        self, load_fn: Callable[[], dict[str, Any]], labels: TenantLabels, model_name: str
    ) -> None:
        self._load_fn = load_fn
        self._labels = labels
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        series = {
            "running": ("tenant_num_requests_running", "Sequences of a tenant running"),
            "waiting": (
                "tenant_num_requests_waiting",
                "Sequences of a tenant waiting for their first output",
            ),
            "queued_tokens": (
                "tenant_queued_prompt_tokens",
                "Prompt tokens of a tenant's waiting sequences",
            ),
        }
        totals: dict[str, dict[str, float]] = {k: {} for k in series}
        for tenant, load in self._load_fn().items():
            label = self._labels(tenant)
            for k in series:
                totals[k][label] = totals[k].get(label, 0.0) + getattr(load, k)
        for k, (name, doc) in series.items():
            metric = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name", "tenant"])
            for label, value in sorted(totals[k].items()):
                metric.add_metric([self._model, label], value)
            yield metric


class ServerMetrics:
    """All metrics of one app. ``stats_fn`` is usually ``engine.stats``; ``model_name`` is the
    value of every series' ``model_name`` label; ``tenants_fn`` gives each tenant's load
    (``TenantLimiter.load``) for the per-tenant gauges."""

    def __init__(
        self,
        stats_fn: Callable[[], Any] | None = None,
        *,
        model_name: str = "radixkv",
        tenants_fn: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.model_name = model_name
        self.tenant_label = TenantLabels()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self._requests = Counter(
            f"{PREFIX}_requests",
            "Finished requests (per choice) by finish reason",
            [*m, "finish_reason"],
            registry=r,
        )
        self._http_errors = Counter(
            f"{PREFIX}_http_errors", "Error responses by HTTP status", [*m, "status"], registry=r
        )
        self._client_closed = Counter(
            f"{PREFIX}_client_closed_requests",
            "Requests whose client disconnected before the answer was complete, by phase "
            "(body: while sending the request; waiting: before a whole answer; streaming: "
            "mid-stream). Their engine requests were aborted.",
            [*m, "phase"],
            registry=r,
        )
        one = self._labelled
        self.prompt_tokens = one(
            Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed", m, registry=r)
        )
        self.cached_prompt_tokens = one(
            Counter(
                f"{PREFIX}_cached_prompt_tokens",
                "Prompt tokens served from the prefix cache",
                m,
                registry=r,
            )
        )
        self.generation_tokens = one(
            Counter(f"{PREFIX}_generation_tokens", "Tokens generated", m, registry=r)
        )
        self.ttft = one(
            Histogram(
                f"{PREFIX}_time_to_first_token_seconds",
                "Time to first token",
                m,
                buckets=_TTFT_BUCKETS,
                registry=r,
            )
        )
        self.queue_time = one(
            Histogram(
                f"{PREFIX}_request_queue_time_seconds",
                "Time a request waited in the engine's queue before it was first scheduled",
                m,
                buckets=_QUEUE_BUCKETS,
                registry=r,
            )
        )
        self.tpot = one(
            Histogram(
                f"{PREFIX}_time_per_output_token_seconds",
                "Mean time per output token after the first, per request",
                m,
                buckets=_TPOT_BUCKETS,
                registry=r,
            )
        )
        self.latency = one(
            Histogram(
                f"{PREFIX}_e2e_request_latency_seconds",
                "End-to-end request latency",
                m,
                buckets=_LATENCY_BUCKETS,
                registry=r,
            )
        )
        self._tenant_rejected = Counter(
            f"{PREFIX}_tenant_rejected_requests",
            "Requests refused with 429 for a per-tenant limit, by tenant and limit",
            [*m, "tenant", "limit"],
            registry=r,
        )
        for phase in CLIENT_CLOSED_PHASES:  # exported at 0 from the start, so rates work
            self._client_closed.labels(model_name, phase)
        if stats_fn is not None:
            r.register(EngineStatsCollector(stats_fn, model_name))
        if tenants_fn is not None:
            r.register(TenantLoadCollector(tenants_fn, self.tenant_label, model_name))

    def _labelled(self, metric: Any) -> Any:
        return metric.labels(self.model_name)

    def count_http_error(self, status: int) -> None:
        self._http_errors.labels(self.model_name, str(status)).inc()

    def count_tenant_rejected(self, tenant: str, limit: str) -> None:
        """A request of ``tenant`` was refused for ``limit`` (server/tenant_limits.py)."""
        self._tenant_rejected.labels(self.model_name, self.tenant_label(tenant), limit).inc()

    def count_client_closed(self, phase: str) -> None:
        """A client went away during ``phase`` (one of CLIENT_CLOSED_PHASES)."""
        if phase not in CLIENT_CLOSED_PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        self._client_closed.labels(self.model_name, phase).inc()

    def observe_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        latency: float | None,
        queue_time: float | None = None,
    ) -> None:
        """Record one finished choice (times in seconds; None when unknown or already counted:
        with ``n > 1`` the prompt's tokens, TTFT and queue time are passed for its first sample
        only)."""
        self._requests.labels(self.model_name, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft is not None:
            self.ttft.observe(max(ttft, 0.0))
        if queue_time is not None:
            self.queue_time.observe(max(queue_time, 0.0))
        if latency is not None:
            self.latency.observe(max(latency, 0.0))
            if ttft is not None and completion_tokens > 1:
                self.tpot.observe(max(latency - ttft, 0.0) / (completion_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
