"""The engine: requests in, tokens out, many requests batched together over a shared prefix cache.

One ``step()`` = schedule (scheduler.py) -> one model forward over the mixed batch
(forward_inputs.py: per-sequence inputs, cascade decision) -> publish computed pages -> sample
-> append tokens, detect stops, finish (postprocess.py). Finished requests publish their
prompt + output pages to the radix cache, so later requests (the next chat turn, another
sample, another user with the same system prompt) skip recomputing them.

This module is the ``Engine`` class: its public API, the live-request table and request ids,
and ``step()``. Requests are checked and built in intake.py, counters kept in stats.py, and
``generate``/``stream`` loop in drivers.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixkv.engine import drivers
from radixkv.engine.cascade_planner import CascadePlanner
from radixkv.engine.forward_inputs import model_inputs, plan_cascade
from radixkv.engine.intake import RequestIntake
from radixkv.engine.invariants import check_engine_invariants
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.outputs import EngineStats, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.postprocess import OutputProcessor
from radixkv.engine.prefill_cost import attention_cost_ratio
from radixkv.engine.request import RequestGroup, SeqStatus
from radixkv.engine.sampler import sample
from radixkv.engine.scheduler import ScheduledBatch, Scheduler
from radixkv.engine.setup import EngineConfig, build_components
from radixkv.engine.stats import record_scheduled, record_step_times, snapshot

Prompt = str | Sequence[int]


class Engine:
    """A continuous-batching inference engine with a radix prefix cache.

    Args mirror :class:`EngineConfig` (validated there); ``model`` is a name
    (``"radixkv-tiny"``), a local Hugging Face folder, or an already loaded ``LoadedModel``.
    ``cascade`` (``"auto"`` | ``"on"`` | ``"off"``): decode steps whose sequences share cached
    prefixes read each shared prefix's KV once per group (engine/cascade_planner.py); "auto"
    does so when the step saves enough reads. ``stats()`` reports KV bytes read with and without.

    Not thread-safe: drive it from one thread (``AsyncEngine`` does that for asyncio code).
    """

    def __init__(
        self,
        model: Any = "radixkv-tiny",
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_memory: int | None = None,
        max_running_requests: int = 256,
        max_prefill_tokens: int = 8192,
        chunked_prefill_size: int | None = 2048,
        prefill_budget: str = "tokens",
        schedule_policy: str = "lpm",
        enable_prefix_cache: bool = True,
        eviction_policy: str = "lru",
        attention_backend: str = "auto",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        seed: int = 0,
        cascade: str = "auto",
    ) -> None:
        self.config = EngineConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_memory=kv_cache_memory,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            chunked_prefill_size=chunked_prefill_size,
            prefill_budget=prefill_budget,
            schedule_policy=schedule_policy,
            enable_prefix_cache=enable_prefix_cache,
            eviction_policy=eviction_policy,
            attention_backend=attention_backend,
            device=device,
            dtype=dtype,
            seed=seed,
        )
        # decode steps read shared prefixes once per group when it pays ("auto"), whenever
        # anything is shared ("on"), or never ("off"); see engine/cascade_planner.py
        self.cascade_planner = CascadePlanner(self.config.page_size, mode=cascade)
        c = build_components(model, self.config)
        self.model, self.tokenizer, self.runner = c.model, c.tokenizer, c.runner
        self.kv_pool, self.pool, self.cache = c.kv_pool, c.pool, c.cache
        self.page_size = self.config.page_size
        self.vocab_size: int = c.model.config.vocab_size
        self.max_context: int = c.model.config.max_position_embeddings
        self.eos_token_ids: frozenset[int] = c.eos_token_ids
        self._seqkv = SeqKV(self.cache, enable_prefix_cache=self.config.enable_prefix_cache)
        self.scheduler = Scheduler(
            self._seqkv,
            max_running_requests=self.config.max_running_requests,
            max_prefill_tokens=self.config.max_prefill_tokens,
            chunked_prefill_size=self.config.chunked_prefill_size,
            policy=self.config.schedule_policy,
            prefill_budget=self.config.prefill_budget,
            attention_ratio=attention_cost_ratio(c.model.config),
        )
        self._intake = RequestIntake(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            page_size=self.page_size,
            num_pages=self.pool.num_pages,
            seed=self.config.seed,
        )
        self._groups: dict[str, RequestGroup] = {}  # live (unfinished) requests
        self._next_id = 0
        self._num_pins = 0  # trie locks held by open sessions (see session.py)
        self._stats = EngineStats(kv_pages_total=self.pool.num_pages)
        self._kv_bytes_per_token = self.kv_pool.bytes_per_page // self.page_size
        # finishes sequences and builds outputs; shares _groups and _stats with the engine
        self._post = OutputProcessor(
            self.scheduler, self.tokenizer, self.eos_token_ids, self._stats, self._groups
        )

    # ------------------------------------------------------------------ submission
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Any = None,
        stream: bool = True,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. ``step()`` reports it every step it makes progress
        (``stream=True``) or only when finished. Raises ValueError/TypeError on bad input and
        leaves the engine unchanged."""
        group = self._make_group(prompt, params, request_id, namespace, stream, arrival_time)
        self._enqueue(group)
        return group.request_id

    def _make_group(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        namespace: Any,
        stream: bool,
        arrival_time: float | None = None,
    ) -> RequestGroup:
        """A checked, not yet queued request (see intake.py); assigns ``req-N`` ids."""
        params, text, ids = self._intake.check(prompt, params, namespace)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._intake.build(request_id, text, ids, params, namespace, stream, arrival_time)

    def _enqueue(self, group: RequestGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request_id {group.request_id!r} is already in use")
        self._groups[group.request_id] = group
        self._stats.num_requests += 1
        for seq in group.seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now, releasing its locks and pages. Returns its final output
        (``finish_reason == "abort"`` on unfinished samples). ValueError on an unknown id."""
        group = self._groups.get(request_id)
        if group is None:
            raise ValueError(f"abort: unknown or already finished request_id {request_id!r}")
        for seq in group.seqs:
            if not seq.finished:
                self._post.finish_seq(seq, "abort")
        self._post.touched.pop(request_id, None)
        self._stats.num_aborted += 1
        return group.make_output()

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of requests that progressed (streamed) or finished."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        record_scheduled(self._stats, batch)
        if not batch.seqs:
            self._post.fail_unschedulable()
            return self._post.drain()
        t1 = time.perf_counter()
        logits = self._forward(batch)  # [B, vocab] fp32
        t2 = time.perf_counter()
        rows = self.scheduler.after_forward(batch)
        seqs = [batch.seqs[i] for i in rows]
        tokens = sample(logits[rows], [s.params for s in seqs], [s.generator for s in seqs])
        t3 = time.perf_counter()
        self._post.append_tokens(seqs, tokens)
        outs = self._post.drain()
        record_step_times(self._stats, t0, t1, t2, t3)
        return outs

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """One model forward over the batch; if it raises, the batch's requests end with
        "error" (postprocess.py) and the exception propagates."""
        try:
            inputs = model_inputs(batch)
            cascade = plan_cascade(
                self.cascade_planner, batch, self._stats, self._kv_bytes_per_token
            )
            if cascade is None:
                return self.runner.forward(inputs)
            return self.runner.forward(inputs, cascade=cascade)
        except Exception:
            self._post.fail_batch(batch)
            raise

    def _drain_outputs(self) -> list[RequestOutput]:
        """Outputs with news since the last step (AsyncEngine calls this after a failed step)."""
        return self._post.drain()

    # ------------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        namespace: Any = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. All prompts are validated before
        any is queued. Other queued requests progress too (their outputs are not returned)."""
        return drivers.generate(self, prompts, params, use_tqdm, namespace)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, namespace: Any = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's output each step it progresses (``delta_text`` is the news);
        the last one has ``finished=True``. Closing the iterator early aborts the request."""
        yield from drivers.stream(self, prompt, params, namespace)

    def fork(
        self,
        source: str | Prompt,
        n: int,
        params: SamplingParams | None = None,
        *,
        namespace: Any = None,
    ) -> list[str]:
        """Start ``n`` requests continuing one shared state; returns their ids.

        ``source`` is the id of a live request (its current prompt + output so far, in its
        namespace, is the shared state: its computed full pages are already in the cache) or a
        prompt. The state is prefilled once: the first branch computes it, the others wait for
        its pages and then hit them (only the partial last page is recomputed per branch).
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an int >= 1, got {n!r}")
        if isinstance(source, str) and source in self._groups:
            parent = self._groups[source]
            tokens: Prompt = parent.seqs[0].token_ids.tolist()
            namespace = parent.namespace
        else:
            tokens = source
        groups = [self._make_group(tokens, params, None, namespace, stream=True) for _ in range(n)]
        for g in groups:
            self._enqueue(g)
        return [g.request_id for g in groups]

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges."""
        return snapshot(self._stats, self.scheduler, self.cache, self.pool, len(self._groups))

    def check_invariants(self) -> None:
        """Assert the cache's invariants, the scheduler's, and page accounting:
        free + cached + private == total; each running sequence's shared pages are exactly its
        locked node's path; no page is held twice. When nothing is queued or running and no
        session pins anything: every lock count is zero and no private page remains."""
        check_engine_invariants(self)

    def reset_prefix_cache(self) -> None:
        """Drop every unlocked cache entry (running requests keep theirs)."""
        self.cache.reset()

    def session(self, prompt: Prompt, *, namespace: Any = None) -> Any:
        """A :class:`~radixkv.engine.session.Session` holding ``prompt`` as shared state."""
        from radixkv.engine.session import Session

        return Session(self, prompt, namespace=namespace)


__all__ = ["Engine", "EngineConfig", "SeqStatus"]
