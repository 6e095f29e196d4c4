"""What the engine hands back: per-request outputs, their timings, and engine-wide stats.

All times are seconds from ``time.monotonic()`` (step phase times: ``time.perf_counter()``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from radixkv.cache.stats import CacheStats
    from radixkv.cache.window_slots import WindowSlots
    from radixkv.engine.storage_tier import StorageStats


class RequestMetrics(msgspec.Struct, kw_only=True):
    """Timings of one request (monotonic seconds). ``ttft``/``latency`` are None until known."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    ttft: float | None = None  # first_token_time - arrival_time
    latency: float | None = None  # finish_time - arrival_time


class Logprob(msgspec.Struct, frozen=True):
    """One token's log probability at one output position (vLLM's ``Logprob``).

    ``logprob`` is ``log_softmax`` of the step's logits (the model's distribution, before
    temperature and filtering; may be ``-inf``); ``rank`` is 1 for the most likely token (1 +
    the number of tokens strictly more likely); ``decoded_token`` is the token decoded on its
    own, special tokens included (a byte that is part of a multi-byte character decodes to
    U+FFFD, as in vLLM).
    """

    logprob: float
    rank: int
    decoded_token: str


# One dict per output token: token id -> Logprob, the sampled token first, then the requested
# number of most likely tokens (so k or k + 1 entries), as in vLLM.
SampleLogprobs = list[dict[int, Logprob]]


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One of the ``n`` samples of a request.

    ``text``/``token_ids`` are cumulative; ``delta_text``/``delta_token_ids`` are what is new
    since the previous output of this request was emitted (what a stream sends). While a stop
    string could still be forming, up to ``max_stop_len - 1`` trailing characters are held
    back from ``delta_text`` and ``text`` (so streamed text never has to be retracted).

    ``logprobs`` (only with ``SamplingParams.logprobs`` set, else None) has one entry per
    token of ``token_ids`` (cumulative, like ``token_ids``); ``cumulative_logprob`` is the sum
    of the sampled tokens' log probabilities. With beam search (``SamplingParams.beam_width``)
    each output is a finished hypothesis, best first: ``cumulative_logprob`` is its total log
    probability (set without ``logprobs``) and ``score`` what it was ranked by.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    delta_text: str = ""
    delta_token_ids: list[int] = msgspec.field(default_factory=list)
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # beam search: the hypothesis's score, cumulative_logprob / len(token_ids) ** length_penalty
    score: float | None = None


class RequestOutput(msgspec.Struct, kw_only=True):
    """The state of one request (all its samples).

    ``text``, ``token_ids`` and ``finish_reason`` mirror ``outputs[0]``; with ``n > 1`` read
    ``outputs``. ``num_cached_tokens`` is how many prompt tokens were served from the prefix
    cache (for ``n > 1``, the first sample's count). ``finished`` is True once every sample has
    finished.

    ``prompt_logprobs`` (only with ``SamplingParams.prompt_logprobs`` set, else None) has one
    entry per prompt token: None for the first, then ``{prompt token: Logprob, the k most
    likely tokens ...}`` (the prompt's own token first, as in ``CompletionOutput.logprobs``).
    It is filled once the prompt's prefill is complete, so every output that carries a
    generated token (and the final one) has it; earlier streamed outputs have None.
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    lora: str | None = None  # the LoRA adapter it ran with (None: the base model)
    # the engine's weight version when this output was made (Engine.update_weights): the
    # weights of its latest tokens
    weight_version: str = "default"
    # why a sample ended with finish_reason "error" (its grammar, sampling, detokenizing... or
    # a failed batch forward), else None; only that request's own error
    error: str | None = None


class WeightUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Engine.update_weights`` did.

    ``weight_version``: the version now served. ``tensors`` / ``bytes``: parameters replaced
    and their size; ``complete``: all of them. ``retracted``: running sequences sent back to
    the queue (their KV dropped; recomputed under the new weights when admitted again).
    ``aborted``: requests ended (``in_flight="abort"``). ``dropped_pages`` /
    ``dropped_host_pages``: cached pages dropped from the device and host tiers; ``pins``:
    session pins released. ``seconds``: the whole call, reading a checkpoint included."""

    weight_version: str
    tensors: int
    bytes: int
    complete: bool
    retracted: int
    aborted: int
    dropped_pages: int
    dropped_host_pages: int
    pins: int
    seconds: float


class EngineStats(msgspec.Struct, kw_only=True):
    """Engine-wide counters (monotonic since construction, except the gauges).

    The engine owns one live instance and updates it only through the ``record_*`` methods;
    ``Engine.stats()`` hands out :meth:`snapshot` copies with the gauges filled in, so a caller
    can keep or change a snapshot without touching the live counters.
    """

    # prefix cache, counted per admitted sequence (prompt tokens looked up / served from cache)
    prefix_cache_queries: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    # of the hit tokens, by where they were found: device pool, host tier (loaded back), or
    # storage (prefetched into the host tier, then loaded back); the three add up to the hits
    prefix_cache_device_hit_tokens: int = 0
    prefix_cache_host_hit_tokens: int = 0
    prefix_cache_storage_hit_tokens: int = 0
    evicted_pages: int = 0
    cached_pages: int = 0
    # KV pool gauges
    kv_pages_total: int = 0
    kv_pages_used: int = 0  # cached + private
    kv_pages_free: int = 0
    # of the cached pages, those on the path of a locked node (a running request's or a
    # session's prefix: not evictable now); pages held privately by running requests (their
    # uncached tail: partial last pages, prefill chunks not yet published)
    locked_pages: int = 0
    private_pages: int = 0
    kv_usage: float = 0.0
    # request gauges and counters
    num_running: int = 0
    num_waiting: int = 0
    # LoRA adapters: loaded, and those that running / waiting requests use (names, sorted)
    num_lora_adapters: int = 0
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    # failures contained: samples ended alone with "error" by a per-sequence stage (grammar,
    # sampling, logprobs, detokenizing, stop strings), and batches failed whole by an error of
    # shared state (the model forward) after which the engine recovered
    num_sequence_errors: int = 0
    num_batch_failures: int = 0
    num_preemptions: int = 0
    # weight updates (Engine.update_weights): how many, the running sequences they sent back
    # to be recomputed, and the cached pages they dropped (KV of the old weights)
    weight_updates: int = 0
    weight_update_retracted: int = 0
    weight_update_dropped_pages: int = 0
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
    # speculative decoding (prompt lookup): draft tokens proposed, and of those accepted (each
    # one a decode step saved)
    speculative_draft_tokens: int = 0
    speculative_accepted_tokens: int = 0
    # host KV tier (all 0 without one): pages copied host -> device and the time admissions
    # waited for them, failed load backs, pages copied device -> host (backups, of which
    # write_back_pages on eviction), host pool gauges
    load_back_pages: int = 0
    load_back_seconds: float = 0.0
    load_back_failures: int = 0
    backup_pages: int = 0
    write_back_pages: int = 0
    host_pages_total: int = 0
    host_pages_used: int = 0
    host_usage: float = 0.0
    # hybrid window KV (all 0 without it): window slots (a page's K/V in the sliding-window
    # layers), those free, pinned by running sequences' windows and cached; slots taken from
    # cached pages; cached prompt tokens a match gave up (recomputed) because the window
    # before them had lost its slots
    window_slots_total: int = 0
    window_slots_free: int = 0
    window_slots_pinned: int = 0
    window_slots_cached: int = 0
    window_slots_evicted: int = 0
    window_trimmed_tokens: int = 0
    # storage tier (all 0 without one): prefetch lookups and the pages they put in the host
    # tier, reader seconds and seconds putting them in the host tier, lookups cut short by the
    # timeout; pages written, writes dropped
    # (queue full or storage unavailable); failed backend calls, corrupt objects found (and
    # deleted); whether storage is usable now (1) or in an outage's back-off (0)
    storage_prefetch_jobs: int = 0
    storage_prefetch_pages: int = 0
    storage_prefetch_seconds: float = 0.0
    storage_land_seconds: float = 0.0
    storage_prefetch_timeouts: int = 0
    storage_write_pages: int = 0
    storage_dropped_write_pages: int = 0
    storage_errors: int = 0
    storage_corrupt_objects: int = 0
    storage_available: int = 0

    # ------------------------------------------------------------------ counting
    def record_request(self) -> None:
        """A request was queued."""
        self.num_requests += 1

    def record_schedule(
        self,
        *,
        prefill_tokens: int,
        preemptions: int,
        queries: int,
        query_tokens: int,
        hit_tokens: int,
        host_hit_tokens: int = 0,
        storage_hit_tokens: int = 0,
    ) -> None:
        """What one ``Scheduler.schedule()`` did: prefill tokens it scheduled, sequences it
        preempted, and the prefix-cache lookups of sequences admitted for the first time
        (``queries`` of them, ``query_tokens`` prompt tokens, ``hit_tokens`` served from cache,
        of which ``host_hit_tokens`` loaded back from the host tier, and of those
        ``storage_hit_tokens`` prefetched there from storage)."""
        self.prefill_tokens_computed += prefill_tokens
        self.num_preemptions += preemptions
        self.prefix_cache_queries += queries
        self.prefix_cache_query_tokens += query_tokens
        self.prefix_cache_hit_tokens += hit_tokens
        self.prefix_cache_host_hit_tokens += host_hit_tokens - storage_hit_tokens
        self.prefix_cache_storage_hit_tokens += storage_hit_tokens
        self.prefix_cache_device_hit_tokens += hit_tokens - host_hit_tokens

    def record_decode_reads(self, plain_bytes: int, read_bytes: int, *, cascade: bool) -> None:
        """One step's decode KV traffic: what plain paged decode would read, what was read, and
        whether a cascade plan ran."""
        self.kv_bytes_read_plain += plain_bytes
        self.kv_bytes_read_cascade += read_bytes
        self.cascade_steps += int(cascade)

    def record_generated(self, num_tokens: int) -> None:
        self.generated_tokens += num_tokens

    def record_finish(self, reason: str, *, request_finished: bool) -> None:
        """One sequence ended with ``reason``; ``request_finished``: it was its request's last."""
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
        self.num_finished += int(request_finished)

    def record_abort(self) -> None:
        self.num_aborted += 1

    def record_sequence_error(self) -> None:
        self.num_sequence_errors += 1

    def record_batch_failure(self) -> None:
        self.num_batch_failures += 1

    def record_weight_update(self, update: WeightUpdate) -> None:
        self.weight_updates += 1
        self.weight_update_retracted += update.retracted
        self.weight_update_dropped_pages += update.dropped_pages

    def record_speculation(self, drafted: int, accepted: int) -> None:
        self.speculative_draft_tokens += drafted
        self.speculative_accepted_tokens += accepted

    def record_step(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """One completed step whose schedule / forward / sample phases started at t0 / t1 / t2
        and whose postprocessing started at t3 and ends now (``time.perf_counter()``)."""
        self.num_steps += 1
        self.time_schedule += t1 - t0
        self.time_forward += t2 - t1
        self.time_sample += t3 - t2
        self.time_postprocess += time.perf_counter() - t3

    def snapshot(
        self,
        *,
        cached_pages: int,
        evicted_pages: int,
        kv_pages_free: int,
        num_running: int,
        num_waiting: int,
        locked_pages: int = 0,
        private_pages: int = 0,
        cache: CacheStats | None = None,
        load_back_seconds: float = 0.0,
        storage: StorageStats | None = None,
        loras: tuple[int, list[str], list[str]] = (0, [], []),
        window: WindowSlots | None = None,
        window_trimmed_tokens: int = 0,
    ) -> EngineStats:
        """An independent copy with the gauges set from the engine's current state (the host
        tier's from the cache's ``cache`` stats)."""
        used = self.kv_pages_total - kv_pages_free
        tier: dict[str, Any] = {}
        if cache is not None:
            host_total = cache.host_free_pages + cache.host_cached_pages
            tier = dict(
                load_back_pages=cache.loaded_pages,
                load_back_seconds=load_back_seconds,
                load_back_failures=cache.load_failures,
                backup_pages=cache.backup_pages,
                write_back_pages=cache.write_back_pages,
                host_pages_total=host_total,
                host_pages_used=cache.host_cached_pages,
                host_usage=cache.host_cached_pages / host_total if host_total else 0.0,
            )
        if window is not None:
            tier.update(
                window_slots_total=window.num_slots,
                window_slots_free=window.num_free,
                window_slots_pinned=window.num_pinned,
                window_slots_cached=window.num_cached,
                window_slots_evicted=window.evicted,
                window_trimmed_tokens=window_trimmed_tokens,
            )
        if storage is not None:
            tier.update(
                storage_prefetch_jobs=storage.prefetch_jobs,
                storage_prefetch_pages=storage.prefetch_pages,
                storage_prefetch_seconds=storage.prefetch_seconds,
                storage_land_seconds=storage.land_seconds,
                storage_prefetch_timeouts=storage.prefetch_timeouts,
                storage_write_pages=storage.write_pages,
                storage_dropped_write_pages=storage.dropped_write_pages,
                storage_errors=storage.errors,
                storage_corrupt_objects=storage.corrupt_objects,
                storage_available=int(storage.available),
            )
        return msgspec.structs.replace(
            self,
            **tier,
            prefix_cache_hit_rate=self.prefix_cache_hit_tokens
            / max(1, self.prefix_cache_query_tokens),
            prompt_tokens=self.prefix_cache_query_tokens,
            num_lora_adapters=loras[0],
            running_lora_adapters=loras[1],
            waiting_lora_adapters=loras[2],
            evicted_pages=evicted_pages,
            cached_pages=cached_pages,
            kv_pages_free=kv_pages_free,
            locked_pages=locked_pages,
            private_pages=private_pages,
            kv_pages_used=used,
            kv_usage=used / self.kv_pages_total if self.kv_pages_total else 0.0,
            num_running=num_running,
            num_waiting=num_waiting,
            finish_reasons=dict(self.finish_reasons),
        )
