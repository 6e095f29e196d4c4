"""Engine statistics: the per-step counter updates and the ``Engine.stats()`` snapshot.

Contract: the engine owns one live ``EngineStats`` (counters, monotonic since construction).
``record_scheduled`` and ``record_step_times`` add to it (and ``record_scheduled`` stamps each
scheduled request's first-scheduled time in its ``RequestMetrics``); ``snapshot`` refreshes
its gauges from the scheduler, cache and pool (read-only on those) and returns an independent
copy, so a caller can keep or change a snapshot without touching the live counters.
"""

from __future__ import annotations

import time
from typing import Any

from radixkv.engine.outputs import EngineStats
from radixkv.engine.scheduler import ScheduledBatch, Scheduler


def record_scheduled(stats: EngineStats, batch: ScheduledBatch) -> None:
    """Account for what ``Scheduler.schedule()`` just did."""
    now = time.monotonic()
    for seq in batch.seqs:
        m = seq.group.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = now
    stats.prefill_tokens_computed += batch.num_prefill_tokens
    stats.num_preemptions += len(batch.preempted)


def record_step_times(stats: EngineStats, t0: float, t1: float, t2: float, t3: float) -> None:
    """One completed step whose schedule/forward/sample phases started at t0/t1/t2 and whose
    postprocessing started at t3 and ends now (``time.perf_counter()`` seconds)."""
    stats.num_steps += 1
    stats.time_schedule += t1 - t0
    stats.time_forward += t2 - t1
    stats.time_sample += t3 - t2
    stats.time_postprocess += time.perf_counter() - t3


def snapshot(
    stats: EngineStats, scheduler: Scheduler, cache: Any, pool: Any, num_live_requests: int
) -> EngineStats:
    """Refresh the gauges in ``stats`` and return a copy of it. ``num_live_requests``: the
    engine's unfinished requests (running or waiting)."""
    s = stats
    sch = scheduler
    cs = cache.stats
    s.prefix_cache_queries = sch.stat_queries
    s.prefix_cache_query_tokens = sch.stat_query_tokens
    s.prefix_cache_hit_tokens = sch.stat_hit_tokens
    s.prefix_cache_hit_rate = sch.stat_hit_tokens / max(1, sch.stat_query_tokens)
    s.evicted_pages = int(getattr(cs, "evicted_pages", 0))
    s.cached_pages = cache.num_cached_pages
    s.kv_pages_free = pool.num_free
    s.kv_pages_used = pool.num_pages - pool.num_free
    s.kv_usage = s.kv_pages_used / pool.num_pages
    s.num_running = len({id(q.group) for q in sch.running})
    s.num_waiting = num_live_requests - s.num_running
    s.prompt_tokens = sch.stat_query_tokens
    import msgspec

    return msgspec.structs.replace(s, finish_reasons=dict(s.finish_reasons))
