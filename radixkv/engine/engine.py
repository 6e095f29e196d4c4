"""The engine: requests in, tokens out, many requests batched together over a shared prefix cache.

The request API, which ``generate``, ``stream``, ``fork``, ``Session``, ``AsyncEngine`` and the
HTTP server all go through:

    prepare(prompt, params, ...) -> RequestGroup   check the input (the only place it is
                                                   checked) and build the request; queues nothing
    submit(request) -> request id                  queue a prepared request
    add_request(prompt, params, ...) -> id         prepare + submit
    step() -> [RequestOutput]                      run one batch; outputs of requests with news
    drain() -> [RequestOutput]                     news not yet returned (after a step raised)
    abort(request_id) -> RequestOutput             end a request now, releasing its locks and pages
    iter_outputs(request_ids)                      step until these requests finish; aborts the
                                                   ones still live if the loop is left early

One ``step()``: the scheduler picks the batch (scheduler.py: which sequences run, how many tokens
each computes, what their pages are, through kv_manager.py) -> one model forward over the mixed
batch (model/runner.py; a decode-only batch whose sequences share cached prefixes may read each
shared prefix once per group, cascade_planner.py) -> computed full pages are published to the
radix cache -> one token is sampled per sequence that reached its end (sampler.py) -> tokens are
appended, stops detected, finished sequences released (their prompt + output pages stay
cached, so the next chat turn, another sample or another user with the same system prompt skips
recomputing them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Collection, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from radixkv.cache import PagePool, RadixCache
from radixkv.engine.cascade_planner import CascadeDecision, CascadePlanner, DecodeEntry
from radixkv.engine.config import EngineConfig
from radixkv.engine.intake import Prompt, RequestIntake, as_prompt_list
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.outputs import EngineStats, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.prefill_cost import attention_cost_ratio
from radixkv.engine.request import Namespace, RequestGroup, SeqStatus
from radixkv.engine.request import Sequence as Seq
from radixkv.engine.sampler import sample
from radixkv.engine.scheduler import ScheduledBatch, Scheduler
from radixkv.engine.session import Session
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.runner import ModelRunner
from radixkv.model.tokenizer import Tokenizer
from radixkv.pages import pages_for

_DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~1M tokens of radixkv-tiny (1 KiB of K+V per token)
_DEFAULT_GPU_KV_FRACTION = 0.5  # of the free GPU memory after the weights are loaded
# A step's fixed cost in prefill tokens (scheduler.py: sizes the groups in which a burst of
# short prefills is admitted), on a GPU / a CPU: see Scheduler.__init__
_STEP_OVERHEAD_TOKENS = {False: 1024.0, True: 64.0}


class Engine:
    """A continuous-batching inference engine with a radix prefix cache.

    ``model`` is a name (``"radixkv-tiny"``), a local Hugging Face folder, or an already loaded
    ``LoadedModel``. The knobs are :class:`EngineConfig`'s: pass ``config=EngineConfig(...)``,
    its fields as keyword arguments (``Engine(model, page_size=8, cascade="off")``), or both
    (the keywords override the config's fields). ``stats()`` reports hit rates, KV usage and,
    with cascade decode attention, KV bytes read with and without it.

    Not thread-safe: drive it from one thread (``AsyncEngine`` does that for asyncio code).
    """

    def __init__(
        self,
        model: str | Path | LoadedModel = "radixkv-tiny",
        *,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        cfg = EngineConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = cfg
        self.model = _load(model, cfg)
        mc = self.model.config
        self.tokenizer: Tokenizer = self.model.tokenizer
        self.kv_pool = _kv_pool(self.model, cfg)
        self.pool = PagePool(self.kv_pool.num_pages)
        self.host_kv_pool, self.copier = _host_tier(self.kv_pool, cfg)
        self.cache = RadixCache(
            self.pool,
            page_size=cfg.page_size,
            policy=cfg.eviction_policy,
            host_pool=None if self.host_kv_pool is None else PagePool(self.host_kv_pool.num_pages),
            copier=self.copier,
            write_policy=cfg.write_policy,
            write_through_threshold=cfg.write_through_threshold,
        )
        self.runner = ModelRunner(self.model.model, self.kv_pool, backend=cfg.attention_backend)
        self.page_size = cfg.page_size
        self.vocab_size: int = mc.vocab_size
        self.max_context: int = mc.max_position_embeddings
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        # the only engine code that calls the cache (kv_manager.py)
        self.seq_kv = SeqKV(self.cache, enable_prefix_cache=cfg.enable_prefix_cache)
        self.scheduler = Scheduler(
            cfg,
            self.seq_kv,
            attention_ratio=attention_cost_ratio(mc),
            step_overhead_tokens=_STEP_OVERHEAD_TOKENS[self.kv_pool.device.type == "cpu"],
        )
        # "auto" picks the cascade from MIN_STEP_SAVED_BYTES of K+V saved per layer a step
        token_bytes = self.kv_pool.bytes_per_page // (cfg.page_size * mc.num_layers)
        self.cascade_planner = CascadePlanner(
            cfg.page_size,
            mode=cfg.cascade,
            min_step_saved_tokens=CascadePlanner.min_step_tokens_for(token_bytes),
        )
        self._intake = RequestIntake(
            cfg,
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            num_pages=self.pool.num_pages,
        )
        self._live: dict[str, RequestGroup] = {}  # unfinished requests (waiting or running)
        self._news: dict[str, RequestGroup] = {}  # requests with news since the last drain()
        self._next_id = 0
        self._stats = EngineStats(kv_pages_total=self.pool.num_pages)
        self._kv_bytes_per_token = self.kv_pool.bytes_per_page // cfg.page_size

    # ------------------------------------------------------------------ the request API
    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Namespace = None,
        stream: bool = True,
        arrival_time: float | None = None,
    ) -> RequestGroup:
        """A checked request, not yet queued: :meth:`submit` queues it. This is the one place
        a request's input is validated (intake.py). Raises ValueError/TypeError on bad input
        and leaves the engine unchanged. ``request_id`` None: ``req-N``."""
        params, text, ids = self._intake.check(prompt, params, namespace)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return self._intake.build(request_id, text, ids, params, namespace, stream, arrival_time)

    def submit(self, request: RequestGroup) -> str:
        """Queue a request from :meth:`prepare` (once); returns its id. ValueError if a live
        request has its id (and nothing is queued)."""
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in use")
        self._live[rid] = request
        self._stats.record_request()
        for seq in request.seqs:
            self.scheduler.add(seq)
        return rid

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Namespace = None,
        stream: bool = True,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request; returns its id. ``step()`` reports it every step it makes progress
        (``stream=True``) or only when finished. Raises ValueError/TypeError on bad input and
        leaves the engine unchanged."""
        return self.submit(
            self.prepare(
                prompt,
                params,
                request_id=request_id,
                namespace=namespace,
                stream=stream,
                arrival_time=arrival_time,
            )
        )

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of requests that progressed (streamed) or finished.
        If the forward raises, the batch's requests end with "error", their final outputs wait
        for :meth:`drain` (or the next step) and the exception propagates."""
        t0 = time.perf_counter()
        self.seq_kv.poll()  # retire finished host-tier copies (no-op without a host tier)
        batch = self.scheduler.schedule()
        # host-tier loads started at admission must land before the forward reads them
        failed = self.seq_kv.finish_loads(batch.seqs)
        if failed:  # a failed copy is a miss: those sequences go back to the queue
            self.scheduler.unschedule_failed_loads(batch, failed)
        self._record_schedule(batch)
        if not batch.seqs:
            if not failed:
                self._fail_unschedulable()
            return self.drain()
        t1 = time.perf_counter()
        logits = self._forward(batch)  # [B, vocab] fp32
        t2 = time.perf_counter()
        rows = self.scheduler.after_forward(batch)  # sequences that reached their last token
        seqs = [batch.seqs[i] for i in rows]
        tokens = sample(logits[rows], [s.params for s in seqs], [s.generator for s in seqs])
        t3 = time.perf_counter()
        self._append_tokens(seqs, tokens)
        outs = self.drain()
        self._stats.record_step(t0, t1, t2, t3)
        return outs

    def drain(self) -> list[RequestOutput]:
        """Outputs of the requests with news since the last ``step()`` or ``drain()`` (streamed
        ones whenever they progressed, the others once finished), then forget that news.
        ``step()`` returns this itself; after a ``step()`` that raised, it holds the final
        outputs of the failed batch's requests."""
        outs = [g.make_output() for g in self._news.values() if g.stream or g.finished]
        self._news.clear()
        return outs

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a request now, releasing its locks and pages. Returns its final output
        (``finish_reason == "abort"`` on unfinished samples). ValueError on an unknown id."""
        group = self._live.get(request_id)
        if group is None:
            raise ValueError(f"abort: unknown or already finished request_id {request_id!r}")
        for seq in group.seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        self._news.pop(request_id, None)
        self._stats.record_abort()
        return group.make_output()

    def has_request(self, request_id: str) -> bool:
        """True while the request is queued or running (not yet finished or aborted)."""
        return request_id in self._live

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        return bool(self._live)

    def iter_outputs(self, request_ids: Collection[str]) -> Generator[RequestOutput, None, None]:
        """Step until every request in ``request_ids`` has finished, yielding their outputs as
        ``step()`` reports them (other queued requests progress too; their outputs are not
        yielded). If the loop is left early (a step raises, the caller stops iterating and
        closes the iterator, KeyboardInterrupt), the requests still live are aborted, so their
        locks and pages are released."""
        ids = set(request_ids)
        try:
            while any(rid in self._live for rid in ids):
                for out in self.step():
                    if out.request_id in ids:
                        yield out
        finally:
            for rid in ids:
                if rid in self._live:
                    self.abort(rid)

    # ------------------------------------------------------------------ inside a step
    def _record_schedule(self, batch: ScheduledBatch) -> None:
        self._stats.record_schedule(
            prefill_tokens=batch.num_prefill_tokens,
            preemptions=len(batch.preempted),
            queries=batch.num_queries,
            query_tokens=batch.num_query_tokens,
            hit_tokens=batch.num_hit_tokens,
            host_hit_tokens=batch.num_host_hit_tokens,
        )

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """One model forward over the batch; if it raises, the batch's requests end with
        "error" and the exception propagates."""
        try:
            cascade, rows = self._plan_cascade(batch)
            return self.runner.forward(batch.model_inputs(), cascade=cascade, cascade_rows=rows)
        except Exception:
            self._fail_batch(batch)
            raise

    def _plan_cascade(
        self, batch: ScheduledBatch
    ) -> tuple[CascadeDecision | None, list[int] | None]:
        """Count the step's decode KV reads; return a CascadeDecision over the step's decode
        sequences (and their batch rows; None when the batch is all decode) when the planner
        finds sharing that pays, else (None, None): plain paged decode. A mixed step (someone
        prefills) plans its decodes too where the runner's backend can split the batch."""
        rows = [
            i
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new))
            if n == 1 and s.num_computed
        ]
        decodes = [batch.seqs[i] for i in rows]
        plain = sum(s.num_computed + 1 for s in decodes)
        read, decision = plain, None
        whole = len(rows) == len(batch.seqs)
        if (
            len(rows) > 1
            and self.cascade_planner.mode != "off"
            and (whole or self.runner.supports_mixed_cascade)
        ):
            d = self.cascade_planner.plan(
                [
                    DecodeEntry(s.locked_node, s.page_table, s.num_computed + 1, s.num_shared_pages)
                    for s in decodes
                ]
            )
            if d.use_cascade:
                decision, read = d, d.kv_tokens_cascade
        per_token = self._kv_bytes_per_token
        self._stats.record_decode_reads(
            plain * per_token, read * per_token, cascade=decision is not None
        )
        return decision, (None if whole or decision is None else rows)

    def _append_tokens(self, seqs: list[Seq], tokens: list[int]) -> None:
        """Append one sampled token to each sequence; finish those that hit a stop token, a
        stop string or ``max_tokens``."""
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            group = seq.group
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                group.metrics.ttft = now - group.metrics.arrival_time
            self._news[group.request_id] = group
            p = seq.params
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                reason, seq.stop_reason = "stop", tok
            elif seq.live_detok and seq.detok.add(tok):
                reason, seq.stop_reason = "stop", seq.detok.stop_matched
            if reason is None and seq.num_output_tokens >= p.max_tokens:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
        self._stats.record_generated(len(tokens))

    def _finish(self, seq: Seq, reason: str, *, insert: bool = True) -> None:
        """The one place a sequence ends (stop, length, abort, error): the scheduler releases
        its KV (publishing its pages unless ``insert=False``), the detokenizer hands over the
        text, and a request whose last sequence this was leaves the live table."""
        self.scheduler.finish(seq, reason, insert=insert)
        d = seq.detok
        if seq.live_detok:
            d.flush()
        else:  # decode once at the end instead of every step
            ids = seq.output_ids
            if isinstance(seq.stop_reason, int):
                ids = ids[:-1]
            d.text = self.tokenizer.decode(ids)
        group = seq.group
        done = group.finished
        if done:
            now = time.monotonic()
            group.metrics.finish_time = now
            group.metrics.latency = now - group.metrics.arrival_time
            self._live.pop(group.request_id, None)
        self._stats.record_finish(reason, request_finished=done)
        self._news[group.request_id] = group

    def _fail_batch(self, batch: ScheduledBatch) -> None:
        """A forward raised: every sequence in the batch ends with "error" (its KV of this step
        is garbage, so nothing it computed is published); the rest keep running."""
        self.scheduler.fail_batch(batch)
        for seq in batch.seqs:
            if not seq.finished:
                self._finish(seq, "error", insert=False)

    def _fail_unschedulable(self) -> None:
        """A step scheduled nothing. With nothing running, nothing could be admitted: the head
        of the queue cannot fit (pages pinned by sessions), so fail it rather than spin."""
        if self.scheduler.waiting and not self.scheduler.running:
            self._finish(self.scheduler.waiting[0], "error", insert=False)

    # ------------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        namespace: Namespace = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. All prompts are validated before
        any is queued. Other queued requests progress too (their outputs are not returned).
        If interrupted, the prompts' requests are aborted."""
        plist = as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        groups = [
            self.prepare(p, sp, namespace=namespace, stream=False)
            for p, sp in zip(plist, params_list)
        ]
        ids = [self.submit(g) for g in groups]
        # plain tqdm: tqdm.auto warns in notebooks without ipywidgets
        from tqdm import tqdm

        with (
            tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar,
            contextlib.closing(self.iter_outputs(ids)) as outs,
        ):
            for out in outs:
                bar.update(int(out.finished))
        return [g.make_output() for g in groups]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, namespace: Namespace = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's output each step it progresses (``delta_text`` is the news);
        the last one has ``finished=True``. Closing the iterator early aborts the request."""
        rid = self.add_request(prompt, params, namespace=namespace, stream=True)
        yield from self.iter_outputs([rid])

    def fork(
        self,
        source: str | Prompt,
        n: int,
        params: SamplingParams | None = None,
        *,
        namespace: Namespace = None,
    ) -> list[str]:
        """Start ``n`` requests continuing one shared state; returns their ids.

        ``source`` is the id of a live request (its current prompt + output so far, in its
        namespace, is the shared state: its computed full pages are already in the cache) or a
        prompt. The state is prefilled once: the first branch computes it, the others wait for
        its pages and then hit them (only the partial last page is recomputed per branch).
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an int >= 1, got {n!r}")
        tokens: Prompt
        if isinstance(source, str) and source in self._live:
            parent = self._live[source]
            tokens = parent.seqs[0].token_ids.tolist()
            namespace = parent.namespace
        else:
            tokens = source
        groups = [self.prepare(tokens, params, namespace=namespace) for _ in range(n)]
        return [self.submit(g) for g in groups]

    def session(self, prompt: Prompt, *, namespace: Namespace = None) -> Session:
        """A :class:`~radixkv.engine.session.Session` holding ``prompt`` as shared state."""
        return Session(self, prompt, namespace=namespace)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges."""
        kv = self.seq_kv
        running = len({id(s.group) for s in self.scheduler.running})
        return self._stats.snapshot(
            cached_pages=kv.num_cached_pages,
            evicted_pages=kv.num_evicted_pages,
            kv_pages_free=kv.num_free_pages,
            num_running=running,
            num_waiting=len(self._live) - running,
            cache=self.cache.stats if kv.tiered else None,
            load_back_seconds=kv.load_back_seconds,
        )

    def check_invariants(self) -> None:
        """Assert the cache's invariants, the scheduler's, and page accounting:
        free + cached + private == total; each running sequence's shared pages are exactly its
        locked node's path; no page is held twice. When nothing is queued or running and no
        session pins anything: every lock count is zero and no private page remains."""
        self.scheduler.check_invariants()
        self.seq_kv.check_invariants(self.scheduler.running, idle=not self._live)

    def reset_prefix_cache(self) -> None:
        """Drop every unlocked cache entry (running requests keep theirs)."""
        self.seq_kv.reset_cache()


def _load(model: str | Path | LoadedModel, cfg: EngineConfig) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return load_model(model, device=device, dtype=cfg.dtype)


def _host_tier(kv: KVPool, cfg: EngineConfig) -> tuple[HostKVPool | None, KVCopier | None]:
    """The host KV tier's buffers and copier when ``host_cache_memory`` is set (ValueError
    naming the field when the budget holds not even one page)."""
    if cfg.host_cache_memory is None:
        return None, None
    try:
        host = HostKVPool.from_memory_budget(cfg.host_cache_memory, kv)
    except ValueError as e:
        raise ValueError(f"host_cache_memory is too small for the host KV tier: {e}") from None
    return host, KVCopier(kv, host)


def _kv_pool(lm: LoadedModel, cfg: EngineConfig) -> KVPool:
    """The paged K/V buffers: ``num_pages`` pages, else as many as ``kv_cache_memory`` bytes
    hold (default: 1 GiB on a CPU, half the free GPU memory), on the model's device and dtype."""
    mc = lm.config
    param = next(lm.model.parameters())
    device, dtype = param.device, param.dtype
    if cfg.num_pages is not None:
        return KVPool(
            mc.num_layers, cfg.num_pages, cfg.page_size, mc.num_kv_heads, mc.head_dim, dtype, device
        )
    budget = cfg.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * _DEFAULT_GPU_KV_FRACTION)
        else:
            budget = _DEFAULT_CPU_KV_BYTES
    # more pages than the context could ever address across max_running is waste
    cap = pages_for(mc.max_position_embeddings, cfg.page_size) * cfg.max_running_requests
    return KVPool.from_memory_budget(
        budget,
        num_layers=mc.num_layers,
        page_size=cfg.page_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        max_pages=cap,
    )


__all__ = ["Engine", "EngineConfig", "Prompt", "SeqStatus"]
