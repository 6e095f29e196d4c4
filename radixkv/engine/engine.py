"""The engine: requests in, tokens out, many requests batched together over a shared prefix cache.

One ``step()`` = schedule (scheduler.py) -> one model forward over the mixed batch -> publish
computed pages -> sample -> append tokens, detect stops, finish. Finished requests publish their
prompt + output pages to the radix cache, so later requests (the next chat turn, another sample,
another user with the same system prompt) skip recomputing them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.invariants import check_engine_invariants
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.outputs import EngineStats, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.prefill_cost import attention_cost_ratio
from radixkv.engine.request import RequestGroup, SeqStatus
from radixkv.engine.request import Sequence as Seq
from radixkv.engine.sampler import make_generator, sample
from radixkv.engine.scheduler import ScheduledBatch, Scheduler
from radixkv.engine.setup import EngineConfig, build_components
from radixkv.engine.validate import as_prompt_list, normalise_prompt

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
        self._rng = random.Random(self.config.seed)
        self._groups: dict[str, RequestGroup] = {}  # live (unfinished) requests
        self._touched: dict[str, RequestGroup] = {}  # requests with news since the last step
        self._next_id = 0
        self._num_pins = 0  # trie locks held by open sessions (see session.py)
        self._stats = EngineStats(kv_pages_total=self.pool.num_pages)
        self._kv_bytes_per_token = self.kv_pool.bytes_per_page // self.page_size

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
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = normalise_prompt(prompt, self.tokenizer, self.vocab_size)
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length {self.max_context}"
            )
        if -(-total // self.page_size) > self.pool.num_pages:
            raise ValueError(
                f"request needs {-(-total // self.page_size)} KV pages for {total} tokens but the "
                f"pool has only {self.pool.num_pages}: it could never fit"
            )
        try:
            hash(namespace)
        except TypeError:
            raise TypeError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        now = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, text, ids, params, namespace, now, stream)
        live_detok = stream or bool(params.stop)
        for i in range(params.n):
            gen = None
            if params.temperature > 0:
                seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
                gen = make_generator(seed)
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens
            )
            seq = Seq(group, i, ids, gen, detok)
            seq.live_detok = live_detok
            group.seqs.append(seq)
        return group

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
                self._finish_seq(seq, "abort")
        self._touched.pop(request_id, None)
        self._stats.num_aborted += 1
        return group.make_output()

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of requests that progressed (streamed) or finished."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self._on_scheduled(batch)
        if not batch.seqs:
            self._fail_unschedulable()
            return self._drain_outputs()
        t1 = time.perf_counter()
        try:
            inputs = self._model_inputs(batch)
            cascade = self._plan_cascade(batch)
            if cascade is None:
                logits = self.runner.forward(inputs)  # [B, vocab] fp32
            else:
                logits = self.runner.forward(inputs, cascade=cascade)
        except Exception:
            self._fail_batch(batch)
            raise
        t2 = time.perf_counter()
        rows = self.scheduler.after_forward(batch)
        seqs = [batch.seqs[i] for i in rows]
        tokens = sample(logits[rows], [s.params for s in seqs], [s.generator for s in seqs])
        t3 = time.perf_counter()
        self._append_tokens(seqs, tokens)
        outs = self._drain_outputs()
        st = self._stats
        st.num_steps += 1
        st.time_schedule += t1 - t0
        st.time_forward += t2 - t1
        st.time_sample += t3 - t2
        st.time_postprocess += time.perf_counter() - t3
        return outs

    def _model_inputs(self, batch: ScheduledBatch) -> list[Any]:
        from radixkv.model.runner import SeqInput

        return [
            SeqInput(s.token_ids[s.num_computed : s.num_computed + n], s.page_table, s.num_computed)
            for s, n in zip(batch.seqs, batch.num_new)
        ]

    def _plan_cascade(self, batch: ScheduledBatch) -> Any:
        """Count the step's decode KV reads; return a CascadeDecision when the batch is all
        decode and the planner finds sharing that pays, else None (plain paged decode)."""
        dec_seqs = [s for s, n in zip(batch.seqs, batch.num_new) if n == 1 and s.num_computed]
        plain = sum(s.num_computed + 1 for s in dec_seqs)
        read = plain
        decision = None
        if len(dec_seqs) == len(batch.seqs) > 1 and self.cascade_planner.mode != "off":
            entries = [
                DecodeEntry(s.locked_node, s.page_table, s.num_computed + 1, s.num_shared_pages)
                for s in dec_seqs
            ]
            d = self.cascade_planner.plan(entries)
            if d.use_cascade:
                decision, read = d, d.kv_tokens_cascade
                self._stats.cascade_steps += 1
        self._stats.kv_bytes_read_plain += plain * self._kv_bytes_per_token
        self._stats.kv_bytes_read_cascade += read * self._kv_bytes_per_token
        return decision

    def _on_scheduled(self, batch: ScheduledBatch) -> None:
        now = time.monotonic()
        for seq in batch.seqs:
            m = seq.group.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        self._stats.prefill_tokens_computed += batch.num_prefill_tokens
        self._stats.num_preemptions += len(batch.preempted)

    def _append_tokens(self, seqs: list[Seq], tokens: list[int]) -> None:
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            group = seq.group
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                group.metrics.ttft = now - group.metrics.arrival_time
            self._touched[group.request_id] = group
            p = seq.params
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                reason, seq.stop_reason = "stop", tok
            elif seq.live_detok and seq.detok.add(tok):
                reason, seq.stop_reason = "stop", seq.detok.stop_matched
            if reason is None and seq.num_output_tokens >= p.max_tokens:
                reason = "length"
            if reason is not None:
                self._finish_seq(seq, reason)
        self._stats.generated_tokens += len(tokens)

    def _finish_seq(self, seq: Seq, reason: str, *, insert: bool = True) -> None:
        self.scheduler.finish(seq, reason, insert=insert)
        d = seq.detok
        if seq.live_detok:
            d.flush()
        else:  # decode once at the end instead of every step
            ids = seq.output_ids
            if isinstance(seq.stop_reason, int):
                ids = ids[:-1]
            d.text = self.tokenizer.decode(ids)
        fr = self._stats.finish_reasons
        fr[reason] = fr.get(reason, 0) + 1
        group = seq.group
        if group.finished:
            now = time.monotonic()
            group.metrics.finish_time = now
            group.metrics.latency = now - group.metrics.arrival_time
            self._groups.pop(group.request_id, None)
            self._stats.num_finished += 1
        self._touched[group.request_id] = group

    def _drain_outputs(self) -> list[RequestOutput]:
        outs = [g.make_output() for g in self._touched.values() if g.stream or g.finished]
        self._touched.clear()
        return outs

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        """A forward raised: every sequence in the batch ends with "error" (its KV of this step
        is garbage, so nothing it computed is published); the rest keep running."""
        self.scheduler.fail_batch(batch)
        for seq in batch.seqs:
            if not seq.finished:
                self._finish_seq(seq, "error", insert=False)

    def _fail_unschedulable(self) -> None:
        # Nothing runs and nothing could be admitted: the head cannot fit (pages pinned by
        # sessions). Fail it rather than spin forever.
        if self.scheduler.waiting and not self.scheduler.running:
            self._finish_seq(self.scheduler.waiting[0], "error", insert=False)

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
        plist = as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        groups = [
            self._make_group(p, sp, None, namespace, stream=False)
            for p, sp in zip(plist, params_list)
        ]
        ids = set()
        for g in groups:
            self._enqueue(g)
            ids.add(g.request_id)
        # plain tqdm: tqdm.auto warns in notebooks without ipywidgets
        from tqdm import tqdm

        pending = len(groups)
        with tqdm(total=pending, disable=not use_tqdm, desc="generate", unit="req") as bar:
            try:
                while pending:
                    done = sum(1 for o in self.step() if o.finished and o.request_id in ids)
                    pending -= done
                    bar.update(done)
            except BaseException:
                for g in groups:
                    if g.request_id in self._groups:
                        self.abort(g.request_id)
                raise
        return [g.make_output() for g in groups]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, namespace: Any = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's output each step it progresses (``delta_text`` is the news);
        the last one has ``finished=True``. Closing the iterator early aborts the request."""
        rid = self.add_request(prompt, params, namespace=namespace, stream=True)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            if rid in self._groups:
                self.abort(rid)

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
        s = self._stats
        sch = self.scheduler
        cs = self.cache.stats
        s.prefix_cache_queries = sch.stat_queries
        s.prefix_cache_query_tokens = sch.stat_query_tokens
        s.prefix_cache_hit_tokens = sch.stat_hit_tokens
        s.prefix_cache_hit_rate = sch.stat_hit_tokens / max(1, sch.stat_query_tokens)
        s.evicted_pages = int(getattr(cs, "evicted_pages", 0))
        s.cached_pages = self.cache.num_cached_pages
        s.kv_pages_free = self.pool.num_free
        s.kv_pages_used = self.pool.num_pages - self.pool.num_free
        s.kv_usage = s.kv_pages_used / self.pool.num_pages
        s.num_running = len({id(q.group) for q in sch.running})
        s.num_waiting = len(self._groups) - s.num_running
        s.prompt_tokens = sch.stat_query_tokens
        import msgspec

        return msgspec.structs.replace(s, finish_reasons=dict(s.finish_reasons))

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
