"""What the engine hands back: per-request outputs, their timings, and engine-wide stats.

All times are seconds from ``time.monotonic()``.
"""

from __future__ import annotations

import msgspec


class RequestMetrics(msgspec.Struct, kw_only=True):
    """Timings of one request (monotonic seconds). ``ttft``/``latency`` are None until known."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    ttft: float | None = None  # first_token_time - arrival_time
    latency: float | None = None  # finish_time - arrival_time


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One of the ``n`` samples of a request.

    ``text``/``token_ids`` are cumulative; ``delta_text``/``delta_token_ids`` are what is new
    since the previous output of this request was emitted (what a stream sends). While a stop
    string could still be forming, up to ``max_stop_len - 1`` trailing characters are held
    back from ``delta_text`` and ``text`` (so streamed text never has to be retracted).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    delta_text: str = ""
    delta_token_ids: list[int] = msgspec.field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or stop token id that matched


class RequestOutput(msgspec.Struct, kw_only=True):
    """The state of one request (all its samples).

    ``text``, ``token_ids`` and ``finish_reason`` mirror ``outputs[0]``; with ``n > 1`` read
    ``outputs``. ``num_cached_tokens`` is how many prompt tokens were served from the prefix
    cache (for ``n > 1``, the first sample's count). ``finished`` is True once every sample has
    finished.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    metrics: RequestMetrics
    outputs: list[CompletionOutput]
    finished: bool = False
    namespace: object | None = None


class EngineStats(msgspec.Struct, kw_only=True):
    """Engine-wide counters (monotonic since construction, except the gauges)."""

    # prefix cache, counted per admitted sequence (prompt tokens looked up / served from cache)
    prefix_cache_queries: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    evicted_pages: int = 0
    cached_pages: int = 0
    # KV pool gauges
    kv_pages_total: int = 0
    kv_pages_used: int = 0  # cached + private
    kv_pages_free: int = 0
    kv_usage: float = 0.0
    # request gauges and counters
    num_running: int = 0
    num_waiting: int = 0
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    finish_reasons: dict[str, int] = msgspec.field(default_factory=dict)
    # token counters
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    generated_tokens: int = 0
    num_steps: int = 0
    # time spent in each part of step() (seconds, cumulative)
    time_schedule: float = 0.0
    time_forward: float = 0.0
    time_sample: float = 0.0
    time_postprocess: float = 0.0
    # decode attention KV traffic (bytes, all layers, K+V), summed over decode rows of every
    # step: what plain paged decode reads vs what was read with cascade (shared prefixes read
    # once per group); equal when cascade is off or did not pay
    kv_bytes_read_plain: int = 0
    kv_bytes_read_cascade: int = 0
    cascade_steps: int = 0
