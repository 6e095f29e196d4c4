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
recomputing them). With overlap (``EngineConfig.overlap``, overlap.py) the forward and token
choice run on a device worker while the host schedules and prepares the next step, and a
step's results are processed by the next ``step()`` call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import operator
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from radixkv.attention.registry import BackendChoice, choose_backend
from radixkv.cache import PagePool, RadixCache, TieredRadixCache, WindowSlots, build_cache
from radixkv.cache.events import Listener
from radixkv.cache.storage import (
    StorageBackend,
    kv_format_id,
    load_storage_secret,
    open_storage,
)
from radixkv.cache.tiers import WRITE_THROUGH_SELECTIVE
from radixkv.engine.beam_runner import BeamRunner
from radixkv.engine.cascade_planner import CascadeDecision, CascadePlanner
from radixkv.engine.config import EngineConfig, canonical_options
from radixkv.engine.detokenizer import decode_output
from radixkv.engine.guided import GuideCompiler, mask_logits
from radixkv.engine.intake import Prompt, RequestIntake, as_prompt_list
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.logit_adjust import adjust_logits
from radixkv.engine.logprobs import TokenTexts, prompt_logprobs, step_logprobs
from radixkv.engine.lora import AdapterNamespace, LoRAInfo, LoRARegistry
from radixkv.engine.outputs import EngineStats, Logprob, RequestOutput, WeightUpdate
from radixkv.engine.overlap import (
    DeviceWorker,
    LaunchedStep,
    fill_positions,
    overlappable,
    select_tokens,
)
from radixkv.engine.params import SamplingParams
from radixkv.engine.prefill_cost import attention_cost_ratio, weights_per_active
from radixkv.engine.request import Namespace, RequestGroup, SeqStatus
from radixkv.engine.request import Sequence as Seq
from radixkv.engine.sampler import argmax_rows, sample
from radixkv.engine.scheduler import PreemptionHeld, ScheduledBatch, Scheduler
from radixkv.engine.scoring import label_scores, score_params, score_prompts
from radixkv.engine.session import Session
from radixkv.engine.speculative import Speculator
from radixkv.engine.storage_tier import StorageIO, StorageTier
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool, parse_kv_cache_dtype
from radixkv.model.config import ModelConfig
from radixkv.model.fingerprint import model_fingerprint
from radixkv.model.loader import LoadedModel, load_model
from radixkv.model.lora import LoRAAdapter
from radixkv.model.runner import ModelRunner
from radixkv.model.tokenizer import Tokenizer, encode_chat
from radixkv.model.weight_update import StagedWeights, WeightSource, apply_weights, stage_weights
from radixkv.pages import pages_for

log = logging.getLogger(__name__)

T = TypeVar("T")

# what update_weights does with requests in flight (its docstring)
IN_FLIGHT_POLICIES = ("retract", "abort")

# A conversation: messages as dicts with at least "role" (and usually "content"), as in OpenAI's
# chat API and transformers' apply_chat_template.
Conversation = list[dict[str, Any]]

_DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~1M tokens of radixkv-tiny (1 KiB of K+V per token)
_DEFAULT_GPU_KV_FRACTION = 0.5  # of the free GPU memory after the weights are loaded
# A step's fixed cost in prefill tokens (scheduler.py: sizes the groups in which a burst of
# short prefills is admitted), on a GPU / a CPU: see Scheduler.__init__
_STEP_OVERHEAD_TOKENS = {False: 1024.0, True: 64.0}
# a decode step's per-row fields, read by C-speed maps (Engine._plan_cascade)
_num_computed = operator.attrgetter("num_computed")
_locked_node = operator.attrgetter("locked_node")
_page_table = operator.attrgetter("page_table")
_num_shared_pages = operator.attrgetter("num_shared_pages")


class Engine:
    """A continuous-batching inference engine with a radix prefix cache.

    ``model`` is a name (``"radixkv-tiny"``), a local Hugging Face folder, a Hugging Face repo id
    (``"Qwen/Qwen2.5-0.5B-Instruct"``, fetched through the Hub cache; ``revision=`` picks a
    branch, tag or commit), a GGUF file (``"path/to/model.gguf"``, a folder or repo id with
    ``gguf_file=``, or the packaged ``"smollm2-135m-instruct"``), or an already loaded
    ``LoadedModel``. The knobs are
    :class:`EngineConfig`'s: pass ``config=EngineConfig(...)``, its fields as keyword arguments
    (``Engine(model, page_size=8, cascade="off")``; vLLM's / SGLang's spellings such as
    ``enable_prefix_caching`` are accepted too), or both (the keywords override the config's
    fields). ``stats()`` reports hit rates, KV usage and, with cascade decode attention, KV bytes
    read with and without it. Construction logs one summary line (logger ``radixkv.engine``).

    Not thread-safe: drive it from one thread (``AsyncEngine`` does that for asyncio code).
    """

    def __init__(
        self,
        model: str | Path | LoadedModel = "radixkv-tiny",
        *,
        config: EngineConfig | None = None,
        **options: Any,
    ) -> None:
        options = canonical_options(options)
        cfg = EngineConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.config = cfg
        self.model = _load(model, cfg)
        mc = self.model.config
        self.tokenizer: Tokenizer = self.model.tokenizer
        self.max_context: int = _max_context(mc, cfg.max_model_len)
        self.kv_pool = _kv_pool(self.model, cfg, self.max_context)
        self.pool = PagePool(self.kv_pool.num_pages)
        # hybrid window KV: window slots follow their pages out of the pool
        self.window_slots: WindowSlots | None = None
        window_tokens = 0  # the largest window, with window slots
        if isinstance(self.kv_pool, HybridKVPool):
            self.window_slots = self.kv_pool.slots
            self.pool.on_free = self.window_slots.release
            window_tokens = self.kv_pool.window_tokens
        backend = _storage_backend(cfg)  # checked before any thread starts
        self.host_kv_pool, self.copier = _host_tier(self.kv_pool, cfg)
        # what the storage tier keys pages by: the weights' identity (None: no storage tier)
        self._fingerprint = None if backend is None else model_fingerprint(self.model.model, mc)
        self.cache = build_cache(
            self.pool,
            page_size=cfg.page_size,
            policy=cfg.eviction_policy,
            host_pool=None if self.host_kv_pool is None else PagePool(self.host_kv_pool.num_pages),
            copier=self.copier,
            write_policy=cfg.write_policy,
            write_through_threshold=_host_hit_threshold(cfg),
        )
        # the engine's door to storage (storage_tier.py): prefetches into the host tier,
        # writes of host pages (it observes the cache's host tier from here on)
        self.storage = _storage_tier(
            self.cache, self.kv_pool, self.host_kv_pool, cfg, backend, self._fingerprint
        )
        self.backend_choice: BackendChoice = choose_backend(cfg.attention_backend, self.kv_pool)
        self.runner = ModelRunner(self.model.model, self.kv_pool, backend=self.backend_choice.name)
        self.page_size = cfg.page_size
        self.vocab_size: int = mc.vocab_size
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(mc.eos_token_ids)
        # the engine's door to the cache (kv_manager.py); the storage tier is the only other
        # engine code that calls it
        self.seq_kv = SeqKV(
            self.cache,
            enable_prefix_cache=cfg.enable_prefix_cache,
            window=self.window_slots,
            window_tokens=window_tokens,
        )
        self.scheduler = Scheduler(
            cfg,
            self.seq_kv,
            attention_ratio=attention_cost_ratio(mc),
            step_overhead_tokens=_STEP_OVERHEAD_TOKENS[self.kv_pool.device.type == "cpu"]
            * weights_per_active(mc),
        )
        # "auto" picks the cascade from MIN_STEP_SAVED_VALUES of K+V saved per layer a step
        token_values = 2 * self.kv_pool.num_kv_heads * self.kv_pool.head_dim
        value_bytes = self.kv_pool.compute_dtype.itemsize  # attention reads pages converted
        self.cascade_planner = CascadePlanner(
            cfg.page_size,
            mode=cfg.cascade,
            min_step_saved_tokens=CascadePlanner.min_step_tokens_for(token_values, value_bytes),
            layer_windows=mc.layer_windows,
        )
        self.speculator: Speculator | None = None  # prompt-lookup drafts (speculative.py)
        if cfg.num_speculative_tokens:
            self.speculator = Speculator(
                self.seq_kv,
                num_tokens=cfg.num_speculative_tokens,
                lookup_min=cfg.prompt_lookup_min,
                lookup_max=cfg.prompt_lookup_max,
                max_context=self.max_context,
                eos_token_ids=self.eos_token_ids,
                jump_forward=cfg.guided_jump_forward,
            )
        self._token_texts = TokenTexts(self.tokenizer)  # logprobs' token strings, memoised
        # beam search requests (SamplingParams.beam_width): their beams' forks and steps
        self.beams = BeamRunner(
            self.scheduler,
            self.seq_kv,
            self.kv_pool.copy_pages,
            self.tokenizer,
            self.eos_token_ids,
            self._token_texts,
        )
        self._intake = RequestIntake(
            cfg,
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            num_pages=self.pool.num_pages,
            guides=GuideCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids),
        )
        self.weight_version = "default"  # a label of the weights served (update_weights)
        self._live: dict[str, RequestGroup] = {}  # unfinished requests (waiting or running)
        self._news: dict[str, RequestGroup] = {}  # requests with news since the last drain()
        self._next_id = 0
        self._stats = EngineStats(kv_pages_total=self.pool.num_pages)
        self._kv_bytes_per_token = self.kv_pool.bytes_per_page // cfg.page_size
        # overlap (overlap.py): the step whose forward runs on the device worker, not yet
        # processed, and the live requests whose steps must not overlap
        self.overlap = self._overlap_mode()
        self._device = DeviceWorker(self.runner)
        self._in_flight: LaunchedStep | None = None
        self._sync_ids: set[str] = set()
        # LoRA adapters by name (lora.py); requests name theirs (``lora=``)
        self.loras = LoRARegistry(
            self.runner.loras, mc, self.kv_pool.device, self.kv_pool.compute_dtype
        )
        for name, path in cfg.lora_modules or ():
            self.load_lora(name, path)
        self._closed = False
        self._log_startup()

    def _overlap_mode(self) -> bool:
        """Whether steps overlap (``EngineConfig.overlap``; "auto": on a CUDA device). Not with
        speculative decoding, a host or storage KV tier, or hybrid window KV (overlap.py); an
        explicit "on" that cannot be is logged."""
        mode = self.config.overlap
        on = self.kv_pool.device.type == "cuda" if mode == "auto" else mode == "on"
        if not on:
            return False
        why = [
            what
            for what, present in (
                ("speculative decoding", self.speculator is not None),
                ("a host or storage KV tier", self.copier is not None),
                ("hybrid window KV", self.window_slots is not None),
            )
            if present
        ]
        if why:
            if mode == "on":
                log.warning("overlap is off: steps run sequentially with %s", ", ".join(why))
            return False
        return True

    def _log_startup(self) -> None:
        """One INFO line saying what was built, and a WARNING when "auto" left a CUDA pool on
        the torch attention kernels (it works, at a fraction of FlashInfer's speed)."""
        kv, cfg, choice = self.kv_pool, self.config, self.backend_choice
        # the torch backend's prefill kernel depends on the CPU (measured: matmul_attention.pays)
        path = getattr(self.runner.attn, "prefill_path", None)
        packed = self.runner.packed_weight_bytes  # a second copy of these (radixkv/onednn.py)
        packed_note = (
            f"; linear weights packed for oneDNN (+{packed / 2**20:.1f} MiB; RADIXKV_PREPACK=0 "
            "turns it off)"
            if packed
            else ""
        )
        windows = self.model.config.layer_windows
        window_note = (
            f", sliding window {'/'.join(map(str, sorted(set(windows) - {0})))} on "
            f"{sum(1 for w in windows if w)} of them"
            if windows
            else ""
        )
        window_kv_note = (
            f"; hybrid window KV: the {kv.window.num_layers} windowed layers keep "
            f"{kv.num_slots} window slots (window_kv_ratio {cfg.window_kv_ratio})"
            if isinstance(kv, HybridKVPool)
            else ""
        )
        log.info(
            "radixkv engine: model %s (%s, %d layers%s, max context %d tokens) on %s in %s; "
            "attention %s (%s)%s; KV pool %d pages x %d tokens = %d tokens (%.1f MiB, %s); "
            "prefix cache %s%s",
            self.model.name,
            self.model.config.architecture,
            self.model.config.num_layers,
            window_note,
            self.max_context,
            kv.device,
            str(kv.compute_dtype).removeprefix("torch."),
            choice.name,
            choice.reason,
            f", prefill by {path}" if path else "",
            kv.num_pages,
            cfg.page_size,
            kv.num_pages * cfg.page_size,
            kv.total_bytes / 2**20,
            str(kv.dtype).removeprefix("torch."),
            f"on ({cfg.eviction_policy} eviction)" if cfg.enable_prefix_cache else "off",
            packed_note + window_kv_note,
        )
        if choice.fallback:
            log.warning(
                "attention backend auto fell back to the torch kernels on %s: %s; pass "
                "attention_backend='torch' (--attention-backend torch) to silence this",
                kv.device,
                choice.reason,
            )

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
        lora: str | None = None,
    ) -> RequestGroup:
        """A checked request, not yet queued: :meth:`submit` queues it. This is the one place
        a request's input is validated (intake.py). Raises ValueError/TypeError on bad input
        and leaves the engine unchanged. ``request_id`` None: ``req-N``. ``lora``: the name of
        a loaded LoRA adapter to run it with (:meth:`load_lora`; None: the base model)."""
        adapter = None if lora is None else self.loras.get(lora)
        params, text, ids = self._intake.check(prompt, params, namespace)
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = self._intake.build(
            request_id, text, ids, params, namespace, stream, arrival_time, adapter
        )
        if params.beam_width:
            self.beams.start(group)
        return group

    def compile_guided(self, params: SamplingParams) -> None:
        """Compile ``params.guided`` now (nothing to do without one), so that submitting a
        request with it does not: compiled languages are kept (engine/guided.py). Thread-safe:
        an asyncio front end calls it in a worker thread, as a large schema on a large
        vocabulary takes seconds. ValueError when it cannot be compiled."""
        if params.guided is not None:
            self._intake.guides.compile(params.guided)

    def submit(self, request: RequestGroup) -> str:
        """Queue a request from :meth:`prepare` (once); returns its id. ValueError if a live
        request has its id (and nothing is queued)."""
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in use")
        lora = request.lora
        if lora is not None and not self.loras.is_loaded(lora):  # unloaded since prepare()
            raise ValueError(f"LoRA adapter {lora.name!r} was unloaded")
        self._live[rid] = request
        if self.overlap and not overlappable(request):
            self._sync_ids.add(rid)
        request.weight_version = self.weight_version
        self._stats.record_request()
        if self.storage is not None:  # look the prompt up in storage meanwhile
            ids = request.seqs[0].token_ids
            request.prefetch = self.storage.start_prefetch(request.cache_namespace, ids)
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
        lora: str | None = None,
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
                lora=lora,
            )
        )

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns outputs of requests that progressed (streamed) or finished.
        If the forward raises, the batch's requests end with "error", their final outputs wait
        for :meth:`drain` (or the next step) and the exception propagates.

        With overlap (``EngineConfig.overlap``, overlap.py) a step launches its batch on the
        device and then processes the batch launched by the previous call, so a batch's
        outputs (and a forward's error) come one call later; requests stay live meanwhile."""
        if self.overlap and self._may_overlap():
            return self._step_overlapped()
        self._sync()
        return self._step_sequential()

    def _may_overlap(self) -> bool:
        """No live request wants what only a sequential step gives (overlap.overlappable)."""
        if self._sync_ids:
            self._sync_ids = {rid for rid in self._sync_ids if rid in self._live}
        return not self._sync_ids

    def _sync(self, *, raise_errors: bool = True) -> None:
        """Process the step in flight, if any (its outputs join the news). A forward that
        raised ends its batch's requests with "error" (logged) and propagates unless
        ``raise_errors`` is False."""
        launched = self._in_flight
        if launched is None:
            return
        self._in_flight = None
        try:
            self._process_launched(launched)
        except Exception:
            if raise_errors:
                raise

    def _step_overlapped(self) -> list[RequestOutput]:
        """:meth:`step` with overlap: schedule, launch, process the previous launch."""
        t0 = time.perf_counter()
        self.seq_kv.poll()
        sched = self.scheduler
        sched.hold_preemption = self._in_flight is not None
        try:
            batch = sched.schedule()
        except PreemptionHeld:  # preempt only with nothing in flight
            sched.hold_preemption = False
            self._sync()
            batch = sched.schedule()
        finally:
            sched.hold_preemption = False
        self._record_schedule(batch)
        if not batch.seqs:
            if self._in_flight is not None:
                self._sync()
            else:
                self._fail_unschedulable()
            return self.drain()
        t1 = time.perf_counter()
        launched = self._launch(batch)
        prev, self._in_flight = self._in_flight, launched
        t2 = time.perf_counter()
        if prev is not None:
            self._process_launched(prev)
        t3 = time.perf_counter()
        outs = self.drain()
        self._stats.record_step(t0, t1, t2, t3)
        return outs

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Build ``batch``'s inputs here and queue its device work (overlap.py); advance its
        counters and give each row that samples a pending token (none to a sequence's last
        possible token, so it is not scheduled again before it is processed)."""
        prev = self._in_flight
        slot = 0 if prev is None else 1 - prev.slot  # the step in flight keeps its plan
        try:
            cascade, rows = self._plan_cascade(batch)
            step = self.runner.build(batch.model_inputs(), cascade, rows)
            attn = self.runner.plan(step, slot)
        except Exception as e:
            self._fail_batch(batch, e)
            raise
        fill = fill_positions(batch, prev)
        sampling = self.scheduler.advance(batch)
        seqs = batch.seqs
        row_of: dict[Seq, int] = {}
        for i in sampling:
            seq = seqs[i]
            if seq.num_output_tokens + seq.num_pending + 1 < seq.params.max_tokens:
                seq.num_pending += 1
                row_of[seq] = i
        future = self._device.launch(step, attn, fill, prev, select_tokens(batch, sampling))
        upto = [s.num_computed for s in seqs]
        return LaunchedStep(batch, sampling, row_of, upto, slot, future)

    def _process_launched(self, launched: LaunchedStep) -> None:
        """A launched step's results: wait for its tokens, then for each sequence still live
        publish the pages it computed and accept its token (stops, outputs), its
        ``num_computed`` seen as of this step (a later step in flight may have advanced it:
        nothing of that step is published or released here). If its forward raised, its
        sequences end with "error" and the exception propagates."""
        batch = launched.batch
        try:
            tokens = launched.tokens()
        except Exception as e:
            for seq in batch.seqs:
                seq.num_pending = 0
            live = [s for s in batch.seqs if not s.finished]
            failed = ScheduledBatch(seqs=live, num_new=[0] * len(live))
            self._fail_batch(failed, e)
            raise
        seqs = batch.seqs
        ahead: dict[Seq, int] = {}  # sequences a later launch advanced: their num_computed
        for seq, upto in zip(seqs, launched.upto):
            if seq.finished:  # ended while this step ran: its row is void
                continue
            now = seq.num_computed
            if now != upto:
                ahead[seq] = now
                seq.num_computed = upto
            self.scheduler.publish(seq)
        row_of = launched.row_of
        took: list[Seq] = []
        toks: list[int] = []
        for i in launched.rows:
            seq = seqs[i]
            if seq.finished:
                continue
            if seq in row_of:
                seq.num_pending -= 1
            took.append(seq)
            toks.append(tokens[i])
        self._append_tokens(took, toks, {}, {})
        for seq, now in ahead.items():
            if not seq.finished:
                seq.num_computed = now

    def _step_sequential(self) -> list[RequestOutput]:
        """:meth:`step` without overlap."""
        t0 = time.perf_counter()
        self.seq_kv.poll()  # retire finished host-tier copies
        if self.storage is not None:  # found pages join the host tier before admission
            self.storage.land_prefetches()
        batch = self.scheduler.schedule()
        # host-tier loads started at admission must land before the forward reads them
        failed = self.seq_kv.finish_loads(batch.seqs)
        if failed:  # a failed copy is a miss: those sequences go back to the queue
            self.scheduler.unschedule_failed_loads(batch, failed)
        self._record_schedule(batch)
        if not batch.seqs:
            if failed:
                return self.drain()
            if self.seq_kv.copies_in_flight:
                # host-tier backups lock their pages until retired: with nothing running,
                # they may be all that keeps the queue's head out; wait, then admit next step
                self.seq_kv.wait_copies()
                return self.drain()
            # requests waiting for their storage prefetch: wait a little for it (nothing else
            # to run), else the queue's head cannot be admitted at all
            if self.storage is None or not self.storage.wait_prefetch():
                self._fail_unschedulable()
            return self.drain()
        t1 = time.perf_counter()
        spec = self.speculator
        drafts = spec.propose(batch) if spec is not None else {}  # {row: draft tokens}
        owing = [
            i
            for i, s in enumerate(batch.seqs)
            if s.group.prompt_logprobs is not None and s.owes_prompt_logprobs
        ]  # (the property asked only of the few requests that want prompt logprobs)
        past = [batch.seqs[i].num_computed for i in owing]
        # logits [B, vocab] fp32; hidden [num_new, hidden] of the owing rows, then the drafted
        logits, hidden = self._forward(batch, owing, drafts)
        if self.seq_kv.landing and self._landing_failed(batch, drafts):
            return self.drain()
        t2 = time.perf_counter()
        owed_failed: list[tuple[Seq, Exception]] = []
        if owing:
            owed_failed = self._record_prompt_logprobs([batch.seqs[i] for i in owing], past, hidden)
        accepted: dict[Seq, list[int]] = {}  # drafted sequences: the drafts they keep
        drawn: dict[int, int] = {}  # drafted sampled or guided rows: verification's token
        kept_logits: dict[Seq, torch.Tensor] = {}  # ... wanting logprobs: the drafts' logits
        spec_failed: list[tuple[Seq, Exception]] = []  # rows whose verification raised
        if spec is not None and drafts:  # cut rejected drafts before the step is recorded
            accepted, drawn, kept_logits, spec_failed = spec.verify(
                batch, drafts, hidden[len(owing) :], logits, self.runner.logits
            )
        rows = self.scheduler.after_forward(batch)  # sequences that reached their last token
        if spec is not None and drafts:
            spec.release_rejected(accepted)  # the slots of the drafts cut
            self._stats.record_speculation(
                sum(map(len, drafts.values())), sum(map(len, accepted.values()))
            )
        for seq, e in owed_failed:
            self._fail_sequence(seq, "prompt logprobs", e)
        for seq, e in spec_failed:
            self._fail_sequence(seq, "speculative verification", e)
        if owed_failed or spec_failed:
            rows = [i for i in rows if not batch.seqs[i].finished]
        in_batch = batch.seqs
        beam_rows = [i for i in rows if in_batch[i].group.beam is not None]
        if beam_rows:  # beam search: the rows wait for their requests' other beams
            failed_beams = self.beams.observe([batch.seqs[i] for i in beam_rows], logits[beam_rows])
            self._fail_beam_searches(failed_beams)
            rows = [i for i in rows if batch.seqs[i].group.beam is None]
        seqs, tokens, entries = self._pick_tokens(logits, rows, drawn, accepted, kept_logits, batch)
        t3 = time.perf_counter()
        self._append_tokens(seqs, tokens, accepted, entries)
        if beam_rows:
            self._advance_beams()
        outs = self.drain()
        self._stats.record_step(t0, t1, t2, t3)
        return outs

    def _pick_tokens(
        self,
        logits: torch.Tensor,
        rows: list[int],
        drawn: dict[int, int],
        accepted: dict[Seq, list[int]],
        kept_logits: dict[Seq, torch.Tensor],
        batch: ScheduledBatch,
    ) -> tuple[list[Seq], list[int], dict[Seq, list[dict[int, Logprob]]]]:
        """The sampled token (and logprobs entries) of each batch row in ``rows``: logit
        adjustments, the guided mask, sampling, logprobs, each batched over the rows and
        contained (:meth:`_contained`): a row whose stage raises ends with "error" and drops
        out; the sequences that remain, their tokens and entries are returned."""
        # every row (rows ascend): ``logits`` itself, copied before a stage modifies it
        whole = len(rows) == logits.shape[0]
        seqs = list(batch.seqs) if whole else [batch.seqs[i] for i in rows]
        params = [s.group.params for s in seqs]
        # requests mostly share their params objects: ask each distinct one once
        distinct = {id(p): p for p in params}.values()
        picked = logits if whole else logits[rows]  # never modified: ``logits`` stays raw
        if any(p.adjusts_logits for p in distinct):  # the raw logits; logprobs stay raw

            def adjust(js: list[int]) -> torch.Tensor:
                ss = [seqs[j] for j in js]
                return adjust_logits(
                    picked if len(js) == len(seqs) else logits[[rows[j] for j in js]],
                    [s.params for s in ss],
                    [s.token_ids for s in ss],
                    [s.num_prompt_tokens for s in ss],
                    self.eos_token_ids,
                )

            seqs, rows, picked = self._contained_rows("logit adjustment", seqs, rows, adjust)
        # after the adjustments: the mask is final (a drafted row's was applied by verify)
        guides = [s.guide for s in seqs]  # (list.count: the common no-grammar test in C)
        if guides.count(None) < len(guides) and any(
            g is not None and i not in drawn for i, g in zip(rows, guides)
        ):
            if picked is logits:
                picked = logits.clone()  # masking is in place

            def guide(js: list[int]) -> torch.Tensor:
                part = picked if len(js) == len(seqs) else picked[js]  # masking is idempotent
                g = [None if rows[j] in drawn else seqs[j].guide for j in js]
                return mask_logits(part, g)

            seqs, rows, picked = self._contained_rows("guided decoding", seqs, rows, guide)
        if len(params) != len(seqs):  # a stage dropped rows
            params = [s.group.params for s in seqs]
        # no row samples: each takes its argmax (what ``sample`` gives such rows), without
        # building per-row lists
        greedy = not any(p.temperature > 0.0 for p in distinct)

        def draw(js: list[int]) -> list[int]:
            every = len(js) == len(seqs)
            part = picked if every else picked[js]
            if greedy:
                return argmax_rows(part)
            ps = params if every else [params[j] for j in js]
            return sample(part, ps, [seqs[j].generator for j in js])

        kept, tokens = self._contained("sampling", seqs, draw)
        if len(kept) < len(seqs):
            seqs, rows = [seqs[j] for j in kept], [rows[j] for j in kept]
        if drawn:  # drafted sampled rows: verification drew their token
            tokens = [drawn.get(i, t) for i, t in zip(rows, tokens)]
        entries: dict[Seq, list[dict[int, Logprob]]] = {}
        lps = [s.logprobs for s in seqs]
        if lps.count(None) < len(lps):

            def logprobs(js: list[int]) -> list[list[dict[int, Logprob]] | None]:
                ss = [seqs[j] for j in js]
                if all(s.logprobs is None for s in ss):  # one row alone that wants none
                    return [None] * len(ss)
                got = self._step_logprobs(
                    logits, [rows[j] for j in js], ss, [tokens[j] for j in js], accepted,
                    kept_logits,
                )  # fmt: skip
                return [got.get(s) for s in ss]

            kept, lists = self._contained("logprobs", seqs, logprobs)
            entries = {seqs[j]: e for j, e in zip(kept, lists) if e is not None}
            if len(kept) < len(seqs):
                seqs, tokens = [seqs[j] for j in kept], [tokens[j] for j in kept]
        return seqs, tokens, entries

    def _contained(
        self, stage: str, seqs: list[Seq], fn: Callable[[list[int]], Sequence[T]]
    ) -> tuple[list[int], Sequence[T]]:
        """Run a per-sequence stage batched: ``fn(positions)`` gives one result per position
        of ``seqs``. If the batch raises, each position runs alone and those that raise end
        with "error" (:meth:`_fail_sequence`); the others' results are what the batch would
        have given (each row's maths is its own). Returns the positions kept and their
        results. The common path costs one ``try`` (free in CPython 3.11+)."""
        every = list(range(len(seqs)))
        try:
            return every, fn(every)
        except Exception as batch_error:
            if len(seqs) == 1:
                self._fail_sequence(seqs[0], stage, batch_error)
                return [], []
        kept: list[int] = []
        out: list[T] = []
        for j in every:
            try:
                (r,) = fn([j])
            except Exception as e:
                self._fail_sequence(seqs[j], stage, e)
                continue
            kept.append(j)
            out.append(r)
        return kept, out

    def _contained_rows(
        self,
        stage: str,
        seqs: list[Seq],
        rows: list[int],
        fn: Callable[[list[int]], torch.Tensor],
    ) -> tuple[list[Seq], list[int], torch.Tensor]:
        """:meth:`_contained` for a stage giving a ``[len(positions), V]`` tensor: the
        sequences and batch rows kept and their rows of it."""
        kept, out = self._contained(stage, seqs, fn)
        if len(kept) == len(seqs):
            return seqs, rows, out if isinstance(out, torch.Tensor) else torch.stack(out)
        rest = torch.stack(out) if out else torch.empty(0, 0)
        return [seqs[j] for j in kept], [rows[j] for j in kept], rest

    def _fail_sequence(self, seq: Seq, stage: str, error: BaseException) -> None:
        """A per-sequence stage raised for ``seq``: it alone ends with "error" (its pages
        released, nothing of it published; the error is its request's ``error``) and the
        step goes on for every other sequence."""
        group = seq.group
        msg = f"{stage} failed: {error}" if str(error) else f"{stage} failed: {error!r}"
        if group.error is None:
            group.error = msg
        log.warning("request %s: %s; it alone ends with error", group.request_id, msg)
        self._stats.record_sequence_error()
        if not seq.finished:
            self._finish(seq, "error", insert=False)
        self._news[group.request_id] = group

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
        self._sync(raise_errors=False)  # (it may finish now: its final output is returned)
        if request_id in self._live:
            self._abort_group(group)
        self._news.pop(request_id, None)
        return group.make_output()

    def _abort_group(self, group: RequestGroup, *, insert: bool = True) -> None:
        """End every unfinished sequence of ``group`` with "abort" (publishing their computed
        pages unless ``insert=False``) and count the abort."""
        for seq in group.seqs:
            if not seq.finished:
                self._finish(seq, "abort", insert=insert)
        self._stats.record_abort()

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
        for outs in self._iter_steps(request_ids):
            yield from outs

    def _iter_steps(
        self, request_ids: Collection[str]
    ) -> Generator[list[RequestOutput], None, None]:
        """:meth:`iter_outputs` one step at a time: each step's outputs of these requests (an
        empty list for a step without news of them), same abort-on-exit guarantee."""
        ids = set(request_ids)
        try:
            while any(rid in self._live for rid in ids):
                yield [out for out in self.step() if out.request_id in ids]
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
            storage_hit_tokens=batch.num_storage_hit_tokens,
        )

    def _forward(
        self, batch: ScheduledBatch, hidden_of: list[int], drafts: dict[int, list[int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One model forward over the batch: last-token logits, and the hidden states of every
        new token of the batch rows ``hidden_of`` and then of the drafted rows ``drafts``; if
        it raises, the drafts are taken back out, the batch's requests end with "error" and
        the exception propagates."""
        try:
            cascade, rows = self._plan_cascade(batch)
            inputs = batch.model_inputs()
            keep = hidden_of + list(drafts)
            if keep:
                return self.runner.forward_hidden(inputs, keep, cascade=cascade, cascade_rows=rows)
            return self.runner.forward(inputs, cascade=cascade, cascade_rows=rows), []
        except Exception as e:
            if self.speculator is not None:
                self.speculator.discard(batch, drafts)
            self._fail_batch(batch, e)
            raise

    def _landing_failed(self, batch: ScheduledBatch, drafts: dict[int, list[int]]) -> bool:
        """After a forward that read host-tier loads layer by layer as they landed: wait for
        them; if one failed, its sequences go back to the queue (a miss, as for a load that
        failed before the forward) and the step is undone for the others (their slots of the
        step given back, drafts taken out: their forward's results are dropped and the next
        step computes the same tokens again). True when the step was undone."""
        failed = self.seq_kv.finish_landing()
        if not failed:
            return False
        if self.speculator is not None:
            self.speculator.discard(batch, drafts)
        self.scheduler.unschedule_failed_loads(batch, failed)
        self.scheduler.fail_batch(batch)  # only gives back the slots past num_computed
        return True

    def _plan_cascade(
        self, batch: ScheduledBatch
    ) -> tuple[CascadeDecision | None, list[int] | None]:
        """Count the step's decode KV reads; return a CascadeDecision over the step's decode
        sequences (and their batch rows; None when the batch is all decode) when the planner
        finds sharing that pays, else (None, None): plain paged decode. A mixed step (someone
        prefills) plans its decodes too where the runner's backend can split the batch."""
        seqs = batch.seqs
        past = list(map(_num_computed, seqs))
        if batch.num_new.count(1) == len(seqs) and all(past):  # decode only: every row
            rows, decodes = list(range(len(seqs))), seqs
        else:
            rows = [i for i, (p, n) in enumerate(zip(past, batch.num_new)) if n == 1 and p]
            decodes = [seqs[i] for i in rows]
            past = [past[i] for i in rows]
        plain = sum(past) + len(past)
        read, decision = plain, None
        whole = len(rows) == len(seqs)
        if (
            len(rows) > 1
            and self.cascade_planner.mode != "off"
            and self.runner.supports_cascade
            and (whole or self.runner.supports_mixed_cascade)
        ):
            # the entries column by column, read by C-speed maps (a decode step of 256 rows)
            d = self.cascade_planner.plan_columns(
                list(map(_locked_node, decodes)),
                list(map(_page_table, decodes)),
                list(map((1).__add__, past)),
                list(map(_num_shared_pages, decodes)),
            )
            if d.use_cascade:
                decision, read = d, d.kv_tokens_cascade
        per_token = self._kv_bytes_per_token
        self._stats.record_decode_reads(
            plain * per_token, read * per_token, cascade=decision is not None
        )
        return decision, (None if whole or decision is None else rows)

    def _step_logprobs(
        self,
        logits: torch.Tensor,
        rows: list[int],
        seqs: list[Seq],
        tokens: list[int],
        drafted: dict[Seq, list[int]],
        draft_logits: dict[Seq, torch.Tensor],
    ) -> dict[Seq, list[dict[int, Logprob]]]:
        """The logprobs entries of this step's tokens for the sequences that asked for them
        (the others' rows are not touched): per sequence, one for each kept draft (from
        ``draft_logits``, speculative.py) and then one for the sampled token, the order
        ``_append_tokens`` appends them in."""
        want = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        idx = torch.tensor([rows[i] for i in want], device=logits.device)
        parts = [logits.index_select(0, idx)]
        ids: list[int] = []
        top: list[int] = []
        asked: list[tuple[int, ...]] = []
        counts: list[int] = []
        for i in want:
            seq = seqs[i]
            ahead = drafted.get(seq, [])
            if ahead:
                parts.append(draft_logits[seq].to(logits.device))
            ids += ahead
            top += [seq.params.logprobs or 0] * len(ahead)
            asked += [seq.params.logprob_token_ids] * len(ahead)
            counts.append(len(ahead))
        # rows: the sampled tokens' (want order), then each sequence's kept drafts'
        asked = [seqs[i].params.logprob_token_ids for i in want] + asked
        flat = step_logprobs(
            torch.cat(parts) if len(parts) > 1 else parts[0],
            [tokens[i] for i in want] + ids,
            [seqs[i].params.logprobs or 0 for i in want] + top,
            self._token_texts,
            asked if any(asked) else (),
        )
        out: dict[Seq, list[dict[int, Logprob]]] = {}
        at = len(want)
        for j, (i, n) in enumerate(zip(want, counts)):
            out[seqs[i]] = [*flat[at : at + n], flat[j]]
            at += n
        return out

    def _record_prompt_logprobs(
        self, seqs: list[Seq], past: list[int], hidden: list[torch.Tensor]
    ) -> list[tuple[Seq, Exception]]:
        """Append the prompt logprobs this step's chunk yields to each sequence's request: the
        chunk's position q (``past`` + row) predicts prompt token q + 1. Positions that already
        have theirs (recomputed after a preemption) and the prompt's last position (it predicts
        the first output token) are skipped."""
        failed = []
        for seq, p0, h in zip(seqs, past, hidden):
            try:
                self._record_prompt_logprobs_of(seq, p0, h)
            except Exception as e:  # this sequence alone ends with "error", after the step's
                failed.append((seq, e))  # bookkeeping (Scheduler.after_forward) counted it
        return failed

    def _record_prompt_logprobs_of(self, seq: Seq, p0: int, h: torch.Tensor) -> None:
        owed = seq.group.prompt_logprobs
        assert owed is not None
        first = len(owed) - 1  # the next position owed; the match stopped at or before it
        assert p0 <= first, (seq, p0, first)
        end = min(p0 + h.shape[0], seq.num_prompt_tokens - 1)
        if end <= first:
            return
        owed += prompt_logprobs(
            h[first - p0 : end - p0],
            self.runner.logits,
            seq.token_ids[first + 1 : end + 1].tolist(),
            seq.params.prompt_logprobs or 0,  # (set: the group owes them)
            self._token_texts,
            self.vocab_size,
            seq.params.logprob_token_ids,
        )

    def _append_tokens(
        self,
        seqs: list[Seq],
        tokens: list[int],
        drafted: dict[Seq, list[int]],
        entries: dict[Seq, list[dict[int, Logprob]]],
    ) -> None:
        """Append each sequence's accepted drafts (speculative decoding: already in its tokens
        and computed, taken through the same checks here) and one sampled token, with their
        logprobs ``entries`` when it wants them, then (guided decoding, jump-forward) the
        tokens its language forces; finish those that hit a stop token, a stop string, the
        end of their guided language or ``max_tokens``."""
        now = time.monotonic()
        jump = self.config.guided_jump_forward
        eos = self.eos_token_ids
        news = self._news
        appended = 0
        for seq, tok in zip(seqs, tokens):
            group = seq.group
            metrics = group.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.ttft = now - metrics.arrival_time
            if group.stream or len(group.seqs) > 1:
                # a request that does not stream reports only when it finishes (drain), and
                # _finish records it then, at this same place in the outputs' order (with
                # several samples, in several rows, the first row's place is kept here)
                news[group.request_id] = group
            if seq.guide is None and seq.logprobs is None and (not drafted or seq not in drafted):
                # the common token (no drafts, logprobs or grammar): _accept's checks, inline
                try:
                    seq.token_ids.append(tok)
                    p = group.params
                    reason = None
                    if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                        seq.stop_reason = tok
                        reason = "stop"
                    elif seq.live_detok and seq.detok.add(tok):
                        seq.stop_reason = seq.detok.stop_matched
                        reason = "stop"
                    elif len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens:
                        reason = "length"
                    appended += 1
                    if reason is not None:
                        self._finish(seq, reason)
                except Exception as e:
                    self._fail_sequence(seq, "appending its token", e)
                continue
            ahead = drafted.get(seq)
            logged = iter(entries.get(seq, ()))
            reason = None
            try:  # free unless it raises: then this sequence alone ends with "error"
                if ahead:  # only a stop string can end the output inside them (speculative.py)
                    del seq.token_ids[-len(ahead) :]
                    for d in ahead:
                        reason = self._accept(seq, d, next(logged, None))
                        appended += 1
                        if reason is not None:  # the drafts past it were computed, not output
                            seq.num_computed = min(seq.num_computed, len(seq.token_ids))
                            break
                if reason is None:
                    reason = self._accept(seq, tok, next(logged, None))
                    appended += 1
                guide = seq.guide
                if jump and guide is not None and seq.logprobs is None:
                    while reason is None and (forced := guide.forced()) is not None:
                        reason = self._accept(seq, forced)  # computed with the next step's chunk
                        appended += 1
                if reason is not None:
                    self._finish(seq, reason)
            except Exception as e:  # a grammar, a stop string, the detokenizer...
                self._fail_sequence(seq, "appending its token", e)
        self._stats.record_generated(appended)

    def _advance_beams(self) -> None:
        """Take the step of each beam search request whose beams all have their logits now,
        and end the searches that are over."""
        ended, appended, failed = self.beams.advance()
        self._stats.record_generated(appended)
        self._fail_beam_searches(failed)
        for group in ended:
            self._end_beam_search(group, None)

    def _fail_beam_searches(self, failed: list[tuple[RequestGroup, Exception]]) -> None:
        """Beam search requests whose step raised (beam_runner.py contains it per request):
        each ends alone with "error", through one of its live beams (there is always one)."""
        for group, e in failed:
            live = next(s for s in group.seqs if not s.finished)
            self._fail_sequence(live, "beam search", e)

    def _end_beam_search(self, group: RequestGroup, reason: str | None) -> None:
        """End a beam search request (``reason`` None: the search is over; "abort"/"error":
        cut short, its live beams compete as they are): its beams' pages are released
        (published), its outputs set, and it leaves the live table."""
        outs = self.beams.finish(group, reason)
        self._retire(group)
        reasons = [o.finish_reason or "stop" for o in outs] or [reason or "stop"]
        for i, r in enumerate(reasons):
            self._stats.record_finish(r, request_finished=i == len(reasons) - 1)
        self._news[group.request_id] = group

    def _accept(self, seq: Seq, tok: int, entry: dict[int, Logprob] | None = None) -> str | None:
        """Append ``tok`` to ``seq`` (and its logprobs ``entry``); the finish reason it brings,
        or None."""
        seq.token_ids.append(tok)
        if entry is not None:
            assert seq.logprobs is not None
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[tok].logprob
        p = seq.params
        guide = seq.guide
        if guide is not None and tok not in self.eos_token_ids:
            guide.advance(tok)
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            seq.stop_reason = tok
            return "stop"
        if seq.live_detok and seq.detok.add(tok):
            seq.stop_reason = seq.detok.stop_matched
            return "stop"
        if guide is not None and guide.only_end:
            return "stop"  # the output is complete: no step spent on an EOS token
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Seq, reason: str, *, insert: bool = True) -> None:
        """The one place a sequence ends (stop, length, abort, error): the scheduler releases
        its KV (publishing its pages unless ``insert=False``), the detokenizer hands over the
        text, and a request whose last sequence this was leaves the live table. A beam of a
        beam search ends its whole request with ``reason``."""
        if seq.group.beam is not None:
            if not insert:  # its KV is not to be published; the other beams' is
                self.scheduler.finish(seq, reason, insert=False)
            self._end_beam_search(seq.group, reason)
            return
        self.scheduler.finish(seq, reason, insert=insert)
        d = seq.detok
        group = seq.group
        try:  # the KV is released already: a failing detokenizer costs only this text
            if seq.live_detok:
                d.flush()
            else:  # decode once at the end instead of every step
                d.text = decode_output(
                    self.tokenizer,
                    seq.output_ids,
                    ends_with_stop_token=isinstance(seq.stop_reason, int),
                    skip_special_tokens=seq.params.skip_special_tokens,
                )
        except Exception as e:
            msg = f"detokenizing failed: {e}"
            group.error = group.error or msg
            log.warning("request %s: %s; it alone ends with error", group.request_id, msg)
            self._stats.record_sequence_error()
            reason = seq.finish_reason = "error"
        done = group.finished
        if done:
            self._retire(group)
        self._stats.record_finish(reason, request_finished=done)
        self._news[group.request_id] = group

    def _retire(self, group: RequestGroup) -> None:
        """A request is over: its latency is recorded and it leaves the live table."""
        now = time.monotonic()
        group.metrics.finish_time = now
        group.metrics.latency = now - group.metrics.arrival_time
        self._live.pop(group.request_id, None)

    def _fail_batch(self, batch: ScheduledBatch, error: BaseException) -> None:
        """A forward raised (shared state: the model, the KV pool): every sequence in the batch
        ends with "error", its request's ``error`` saying why (its KV of this step is garbage,
        so nothing it computed is published); the rest keep running. Logged and counted
        (``num_batch_failures``): the engine is clean again (pages and locks released)."""
        self.scheduler.fail_batch(batch)
        msg = f"the batch's model forward failed: {error!r}"
        for seq in batch.seqs:
            if seq.group.error is None:
                seq.group.error = msg
            if not seq.finished:
                self._finish(seq, "error", insert=False)
        self._stats.record_batch_failure()
        log.error(
            "step failed in shared state (%r): its %d sequences ended with error, their pages "
            "and locks released; the engine serves on",
            error,
            len(batch.seqs),
        )

    def _fail_unschedulable(self) -> None:
        """A step scheduled nothing. With nothing running, nothing could be admitted: the head
        of the queue cannot fit (pages pinned by sessions), so fail it rather than spin."""
        if self.scheduler.waiting and not self.scheduler.running:
            head = self.scheduler.waiting[0]
            head.group.error = head.group.error or (
                "the request cannot be admitted: its pages do not fit beside those that "
                "sessions pin"
            )
            self._finish(head, "error", insert=False)

    # ------------------------------------------------------------------ convenience
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        namespace: Namespace = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. All prompts are validated before
        any is queued. Other queued requests progress too (their outputs are not returned).
        If interrupted, the prompts' requests are aborted. ``sampling_params`` is vLLM's name
        for ``params`` (give one of them). The progress bar (``use_tqdm``) counts finished
        requests and shows prompt and output tokens per second. ``lora``: a loaded adapter's
        name for every prompt, or one name (or None) per prompt: they run in the same batches."""
        params = _one_params(params, sampling_params)
        plist = as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params] * len(plist)
        else:
            params_list = list(params)
            if len(params_list) != len(plist):
                raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
        if lora is None or isinstance(lora, str):
            loras: list[str | None] = [lora] * len(plist)
        else:
            loras = list(lora)
            if len(loras) != len(plist):
                raise ValueError(f"{len(plist)} prompts but {len(loras)} LoRA adapter names")
        groups = [
            self.prepare(p, sp, namespace=namespace, stream=False, lora=name)
            for p, sp, name in zip(plist, params_list, loras)
        ]
        return self._run_to_completion(groups, use_tqdm)

    def score(
        self,
        query: Prompt,
        items: Prompt | Sequence[Prompt],
        label_token_ids: Sequence[int],
        *,
        apply_softmax: bool = False,
        item_first: bool = False,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> list[list[float]]:
        """Score each item against ``query``: per item, the probability of each of
        ``label_token_ids`` as the next token after ``query + item`` (``item + query`` with
        ``item_first``), in label order; with ``apply_softmax`` renormalised over the labels
        (SGLang's ``Engine.score``; scoring.py). Query and items are both text (concatenated,
        then tokenized) or both token-id lists. With the query first, the prefix cache computes
        it once for all items. Everything is validated before any item runs."""
        prompts = score_prompts(query, items, item_first=item_first)
        params = score_params(label_token_ids)
        outs = self.generate(prompts, params, use_tqdm=False, namespace=namespace, lora=lora)
        scores = []
        for out in outs:
            (entry,) = out.outputs[0].logprobs or [{}]
            scores.append(label_scores(entry, params.logprob_token_ids, apply_softmax))
        return scores

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        namespace: Namespace = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of message dicts) or a list of them;
        outputs in input order. Each conversation becomes token ids exactly as the HTTP server's
        chat completions make them (:func:`~radixkv.model.tokenizer.encode_chat`: the chat
        template rendered with ``tools`` and ``chat_template_kwargs``, then encoded without
        adding special tokens), so the same conversation gives the same ids, and shares the same
        cache entries, from Python and over HTTP. Raises ValueError (the template's message)
        before anything is queued when a conversation is rejected."""
        convs = _as_conversations(messages)
        prompts = [
            encode_chat(
                self.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conv in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm, namespace=namespace, lora=lora)

    def _run_to_completion(self, groups: list[RequestGroup], use_tqdm: bool) -> list[RequestOutput]:
        """Queue prepared requests, step until they finish, return their outputs in order."""
        ids = [self.submit(g) for g in groups]
        # plain tqdm: tqdm.auto warns in notebooks without ipywidgets
        from tqdm import tqdm

        stats = self._stats
        out0, t0 = stats.generated_tokens, time.perf_counter()
        prompt_tokens = 0  # of the requests finished so far
        with (
            tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req") as bar,
            contextlib.closing(self._iter_steps(ids)) as steps,
        ):
            for outs in steps:
                done = [out for out in outs if out.finished]  # not streamed: once, at the end
                bar.update(len(done))
                prompt_tokens += sum(len(out.prompt_token_ids) for out in done)
                if use_tqdm:
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(
                        f"in {prompt_tokens / elapsed:,.0f} tok/s, "
                        f"out {(stats.generated_tokens - out0) / elapsed:,.0f} tok/s",
                        refresh=False,
                    )
        return [g.make_output() for g in groups]

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        sampling_params: SamplingParams | None = None,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield this request's output each step it progresses (``delta_text`` is the news);
        the last one has ``finished=True``. Closing the iterator early aborts the request.
        ``sampling_params`` is another name for ``params``."""
        params = _one_params(params, sampling_params)
        rid = self.add_request(prompt, params, namespace=namespace, stream=True, lora=lora)
        yield from self.iter_outputs([rid])

    def fork(
        self,
        source: str | Prompt,
        n: int,
        params: SamplingParams | None = None,
        *,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> list[str]:
        """Start ``n`` requests continuing one shared state; returns their ids.

        ``source`` is the id of a live request (its current prompt + output so far, in its
        namespace and with its LoRA adapter, is the shared state: its computed full pages are
        already in the cache) or a prompt. The state is prefilled once: the first branch
        computes it, the others wait for its pages and then hit them (only the partial last
        page is recomputed per branch).
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an int >= 1, got {n!r}")
        tokens: Prompt
        self._sync(raise_errors=False)  # the source's tokens are all known
        if isinstance(source, str) and source in self._live:
            parent = self._live[source]
            tokens = parent.seqs[0].token_ids.tolist()
            namespace = parent.namespace
            lora = None if parent.lora is None else parent.lora.name
        else:
            tokens = source
        groups = [self.prepare(tokens, params, namespace=namespace, lora=lora) for _ in range(n)]
        return [self.submit(g) for g in groups]

    def session(
        self, prompt: Prompt, *, namespace: Namespace = None, lora: str | None = None
    ) -> Session:
        """A :class:`~radixkv.engine.session.Session` holding ``prompt`` as shared state (run
        with the LoRA adapter ``lora``, if given)."""
        return Session(self, prompt, namespace=namespace, lora=lora)

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str | Path) -> LoRAInfo:
        """Load the PEFT LoRA adapter folder ``path`` under ``name``; requests then pick it with
        ``lora=name``, in the same batches as the base model's and other adapters'. Its KV is
        cached apart (engine/lora.py). ValueError (the file and problem) when it cannot be
        read or does not fit the model, or the name is taken; nothing changes then."""
        return self.attach_lora(self.loras.read(name, path))

    def attach_lora(self, adapter: LoRAAdapter) -> LoRAInfo:
        """:meth:`load_lora`'s second half, an adapter already read (``loras.read``: AsyncEngine
        reads the files off its loop), after the step in flight, whose forward reads the
        model's adapters, has finished."""
        self._sync(raise_errors=False)
        return self.loras.attach(adapter)

    def unload_lora(self, name: str) -> LoRAInfo:
        """Detach the adapter ``name`` and drop its unlocked cache entries. ValueError when no
        adapter has that name or live requests use it (abort or finish them first)."""
        info = self.loras.get(name)
        self._sync(raise_errors=False)
        users = [rid for rid, g in self._live.items() if g.lora is not None and g.lora.name == name]
        if users:
            more = f" and {len(users) - 1} more" if len(users) > 1 else ""
            raise ValueError(f"LoRA adapter {name!r} is in use by request {users[0]!r}{more}")
        stale = self.loras.namespaces_of(info, self.seq_kv.namespaces())
        self.loras.unload(name)
        self.seq_kv.reset_cache(stale)
        return info

    def list_loras(self) -> list[LoRAInfo]:
        """The loaded LoRA adapters, in load order."""
        return self.loras.infos()

    def cache_namespace(self, namespace: Namespace, lora: str | None) -> Namespace:
        """The prefix-cache namespace of requests in ``namespace`` run with ``lora``."""
        if lora is None:
            return namespace
        return AdapterNamespace(self.loras.get(lora).digest, namespace)

    # ------------------------------------------------------------------ weight updates
    def stage_weights(self, weights: WeightSource) -> StagedWeights:
        """Read and check new weights for :meth:`update_weights` without changing anything: a
        checkpoint folder (or Hub repo id) of this model's architecture and sizes, or a mapping
        (or iterable of pairs) of parameter names to tensors, the names the checkpoints use
        (``model.layers.0.mlp.up_proj.weight``...; some parameters or all). Thread-safe (an
        asyncio front end reads in a worker thread while steps go on). ModelLoadError,
        ValueError or TypeError naming the file, tensor and problem."""
        return stage_weights(self.model.model, self.model.config, weights)

    @staticmethod
    def check_update_options(in_flight: str, weight_version: str | None) -> None:
        """ValueError unless :meth:`update_weights` takes these options."""
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_POLICIES}, got {in_flight!r}")
        if weight_version is not None and (
            not isinstance(weight_version, str) or not weight_version.strip()
        ):
            raise ValueError(f"weight_version must be a non-empty string, got {weight_version!r}")

    def update_weights(
        self,
        weights: WeightSource | StagedWeights,
        *,
        weight_version: str | None = None,
        in_flight: str = "retract",
    ) -> WeightUpdate:
        """Serve new weights from the next step on, in place, without a restart (RL rollouts,
        online fine-tuning). ``weights``: what :meth:`stage_weights` takes, or its result.

        No KV computed under the old weights is used again: every cached page of the device
        and host tiers is dropped (session pins too: a session's next turn recomputes its
        state), a storage tier keys what it stores and finds by the new weights' identity from
        now on (what it holds stays, for engines still on the old weights), and prefetches in
        flight are dropped. Requests in flight (``in_flight``):

        * ``"retract"`` (default): running sequences go back to the front of the queue with the
          tokens they have; their KV is recomputed under the new weights when they are admitted
          again, and generation goes on. Their later tokens come from the new weights; outputs
          say which version made them last (``RequestOutput.weight_version``).
        * ``"abort"``: every queued or running request ends now (finish reason "abort"; the
          next :meth:`step` or :meth:`drain` returns their final outputs).

        ``weight_version``: the new label (default: unchanged; outputs and stats carry it).
        Bad weights raise (as :meth:`stage_weights`) and nothing changes, requests included.
        LoRA adapters stay loaded and apply to the new weights."""
        t0 = time.perf_counter()
        self.check_update_options(in_flight, weight_version)
        staged = weights if isinstance(weights, StagedWeights) else self.stage_weights(weights)
        self._sync(raise_errors=False)
        live = list(self._live.values())
        aborted = retracted = 0
        if in_flight == "abort":
            for group in live:
                self._abort_group(group, insert=False)
            aborted = len(live)
        else:
            retracted = len(self.scheduler.retract_all())
        apply_weights(self.model.model, staged)
        pins = self.seq_kv.num_pins
        dropped, dropped_host = self.seq_kv.invalidate()
        if self.storage is not None and self._fingerprint is not None:
            if staged.complete:  # as a fresh load of these weights: a fleet shares their pages
                fp = model_fingerprint(self.model.model, self.model.config)
            else:  # only some tensors: the exact digest of what changed
                fp = hashlib.blake2b(self._fingerprint + staged.digest(), digest_size=16).digest()
            self._fingerprint = fp
            self.storage.rekey(_kv_format(fp, self.kv_pool))
        if weight_version is not None:
            self.weight_version = weight_version
        for group in live:
            group.weight_version = self.weight_version
            group.prefetch = None  # what it brings is of the old weights' KV format
        update = WeightUpdate(
            weight_version=self.weight_version,
            tensors=len(staged.tensors),
            bytes=staged.num_bytes,
            complete=staged.complete,
            retracted=retracted,
            aborted=aborted,
            dropped_pages=dropped,
            dropped_host_pages=dropped_host,
            pins=pins,
            seconds=time.perf_counter() - t0,
        )
        self._stats.record_weight_update(update)
        log.info(
            "weights updated to version %s from %s (%d tensors, %.1f MiB%s): %d sequences "
            "retracted, %d requests aborted, %d cached pages dropped, in %.2f s",
            update.weight_version,
            staged.source,
            update.tensors,
            update.bytes / 2**20,
            "" if staged.complete else ", partial",
            retracted,
            aborted,
            dropped + dropped_host,
            update.seconds,
        )
        return update

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """A snapshot of the counters and gauges."""
        kv = self.seq_kv
        groups = {id(s.group) for s in self.scheduler.running}
        running = len(groups)
        run_loras, wait_loras = set(), set()
        for g in self._live.values():
            if g.lora is not None:
                (run_loras if id(g) in groups else wait_loras).add(g.lora.name)
        counters = kv.cache_stats()
        return self._stats.snapshot(
            cached_pages=kv.num_cached_pages,
            evicted_pages=counters.evicted_pages,
            kv_pages_free=kv.num_free_pages,
            num_running=running,
            num_waiting=len(self._live) - running,
            locked_pages=kv.num_locked_pages,
            private_pages=kv.num_private_pages,
            cache=counters if kv.tiered else None,
            # waits before the forward, and of layer-wise loads inside it (per layer)
            load_back_seconds=kv.load_back_seconds + self.kv_pool.loads.waited_seconds,
            storage=None if self.storage is None else self.storage.stats(),
            loras=(len(self.loras.infos()), sorted(run_loras), sorted(wait_loras)),
            window=self.window_slots,
            window_trimmed_tokens=kv.window_trimmed_tokens,
        )

    def check_invariants(self) -> None:
        """Assert the cache's invariants, the scheduler's, and page accounting:
        free + cached + private == total; each running sequence's shared pages are exactly its
        locked node's path; no page is held twice. When nothing is queued or running and no
        session pins anything: every lock count is zero and no private page remains."""
        self.scheduler.check_invariants()
        self.seq_kv.check_invariants(self.scheduler.running, idle=not self._live)

    def reset_prefix_cache(self) -> None:
        """Drop every unlocked cache entry (running requests keep theirs). Storage keeps its
        pages: they are keyed by content, model and namespace, so they stay valid."""
        self._sync(raise_errors=False)
        self.seq_kv.reset_cache()

    def add_cache_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` for every cache event (cache/events.py), on the thread
        that drives the engine: add it from there too (AsyncEngine does)."""
        self.seq_kv.add_listener(listener)

    def remove_cache_listener(self, listener: Listener) -> None:
        """Stop calling ``listener`` (ValueError if it was not added)."""
        self.seq_kv.remove_listener(listener)

    def flush_storage(self, timeout: float | None = 30.0) -> bool:
        """Wait until the pages queued for the storage tier are written (True), or ``timeout``
        seconds passed (False); True at once without a storage tier."""
        if self.storage is None:
            return True
        return self.storage.flush(timeout)  # backups in flight report their pages first

    def close(self) -> None:
        """Stop the background threads: finish the storage writes queued (under the
        ``write_back`` storage policy, first queue every page held only in the host tier, which
        would be lost otherwise), then stop the storage and host-tier threads. Idempotent; the
        engine must not be stepped afterwards."""
        if self._closed:
            return
        self._closed = True
        self._sync(raise_errors=False)
        self._device.close()
        if self.storage is not None:
            self.storage.close()
        if self.copier is not None:
            self.seq_kv.wait_copies()
            self.copier.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load(model: str | Path | LoadedModel, cfg: EngineConfig) -> LoadedModel:
    if isinstance(model, LoadedModel):
        given = [
            n for n in ("revision", "gguf_file", "tokenizer", "chat_template") if getattr(cfg, n)
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} apply when the engine loads the model; pass them to "
                "load_model() for an already loaded one"
            )
        return model
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return load_model(
        model,
        device=device,
        dtype=cfg.dtype,
        revision=cfg.revision,
        tokenizer=cfg.tokenizer,
        chat_template=cfg.chat_template,
        gguf_file=cfg.gguf_file,
    )


def _max_context(mc: ModelConfig, max_model_len: int | None) -> int:
    """The longest prompt + output served: ``max_model_len`` when set (ValueError past what the
    model was built for), else the model's ``max_position_embeddings``."""
    model_max = mc.max_position_embeddings
    if max_model_len is None:
        return model_max
    if max_model_len > model_max:
        where = "max_position_embeddings in its config.json"
        if mc.rope_scaling is not None and mc.rope_scaling["rope_type"] == "longrope":
            where = (
                "LongRoPE models are served up to their original_max_position_embeddings: "
                "past it transformers re-rotates every cached token"
            )
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's context length {model_max} "
            f"({where})"
        )
    return max_model_len


def _host_tier(kv: KVPool, cfg: EngineConfig) -> tuple[HostKVPool | None, KVCopier | None]:
    """The host KV tier's buffers and copier when ``host_cache_memory`` is set (ValueError
    naming the field when the budget holds not even one page)."""
    budget = cfg.host_cache_memory
    if budget is None:
        if cfg.kv_storage is None:
            return None, None
        # storage lands pages in host memory: a host tier as large as the device pool, capped
        budget = min(kv.bytes_per_page * kv.num_pages, _DEFAULT_STORAGE_HOST_BYTES)
    try:
        host = HostKVPool.from_memory_budget(budget, kv)
    except ValueError as e:
        raise ValueError(f"host_cache_memory is too small for the host KV tier: {e}") from None
    # "auto" is all at once for now on every device (EngineConfig.host_layerwise_load says why)
    layerwise = cfg.host_layerwise_load == "on"
    return host, KVCopier(kv, host, layerwise=layerwise)


_DEFAULT_STORAGE_HOST_BYTES = 4 << 30  # host tier with storage and no host_cache_memory: at most


def _storage_backend(cfg: EngineConfig) -> StorageBackend | None:
    """The storage backend ``kv_storage`` names (ValueError naming the field on a bad URL;
    nothing is connected yet: a store that is down is a runtime fault, not a config error)."""
    if cfg.kv_storage is None:
        return None
    if not cfg.enable_prefix_cache:
        raise ValueError("kv_storage needs the prefix cache (enable_prefix_cache=True)")
    try:
        return open_storage(cfg.kv_storage, timeout=float(cfg.kv_storage_timeout))
    except ValueError as e:
        raise ValueError(f"kv_storage: {e}") from None


def _kv_format(fingerprint: bytes, kv: KVPool) -> bytes:
    """The storage key of the KV that weights with ``fingerprint`` compute into ``kv``."""
    return kv_format_id(
        fingerprint, str(kv.dtype), kv.page_size, kv.num_layers, kv.num_kv_heads, kv.head_dim
    )


def _storage_write_threshold(cfg: EngineConfig) -> int:
    """Matches through a host page before ``write_through_selective`` writes it to storage:
    ``kv_storage_write_threshold``, by default ``write_through_threshold``."""
    s = cfg.kv_storage_write_threshold
    return cfg.write_through_threshold if s is None else s


def _host_hit_threshold(cfg: EngineConfig) -> int:
    """The cache's ``write_through_threshold``: the host tier's when its write policy counts
    hits, else the storage tier's, since the cache reports a host page's hits to its observer
    at that one count (EngineConfig refuses a storage threshold above the host tier's when
    both count hits: it could not be honoured)."""
    if cfg.write_policy == WRITE_THROUGH_SELECTIVE or cfg.kv_storage is None:
        return cfg.write_through_threshold
    return _storage_write_threshold(cfg)


def _storage_tier(
    cache: RadixCache,
    kv: KVPool,
    host: HostKVPool | None,
    cfg: EngineConfig,
    backend: StorageBackend | None,
    fingerprint: bytes | None,
) -> StorageTier | None:
    """The storage tier over ``backend`` and ``cache`` (None: no storage tier), keyed by the
    KV format of the weights with ``fingerprint``."""
    if backend is None or fingerprint is None:
        return None
    assert host is not None  # _host_tier gives storage a host tier
    assert isinstance(cache, TieredRadixCache)  # build_cache made it so, given the host pool
    try:
        secret = load_storage_secret(cfg.kv_storage_secret_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"kv_storage_secret_file: {e}") from None
    io = StorageIO(
        backend,
        host,
        format_id=_kv_format(fingerprint, kv),
        page_size=kv.page_size,
        timeout=float(cfg.kv_storage_timeout),
        write_queue_pages=cfg.kv_storage_write_queue,
        secret=secret,
    )
    try:
        return StorageTier(
            cache,
            io,
            write_policy=cfg.kv_storage_write_policy,
            write_threshold=_storage_write_threshold(cfg),
            prefetch_threshold=cfg.kv_storage_prefetch_threshold,
        )
    except Exception:
        io.close()  # its threads run already
        raise


def _hybrid_window_kv(lm: LoadedModel, cfg: EngineConfig) -> bool:
    """Whether the windowed layers keep their K/V in window slots (``window_kv``); ValueError
    naming the field when "hybrid" cannot be."""
    windows = lm.config.layer_windows
    tiers = cfg.host_cache_memory is not None or cfg.kv_storage is not None
    if cfg.window_kv == "hybrid":
        if not windows:
            raise ValueError(
                f"window_kv='hybrid' needs a model with sliding-window layers; {lm.name} has none"
            )
        if tiers:
            raise ValueError(
                "window_kv='hybrid' does not combine with a host or storage KV tier "
                "(host_cache_memory, kv_storage): those copy whole pages; use window_kv='full'"
            )
        return True
    return cfg.window_kv == "auto" and bool(windows) and not tiers


def _kv_pool(lm: LoadedModel, cfg: EngineConfig, max_context: int) -> KVPool | HybridKVPool:
    """The paged K/V buffers: ``num_pages`` pages, else as many as ``kv_cache_memory`` bytes
    hold (default: 1 GiB on a CPU, half the free GPU memory), on the model's device, storing
    ``kv_cache_dtype`` (default: the model's dtype) and computing in the model's. With hybrid
    window KV, a :class:`HybridKVPool` whose window slots are ``window_kv_ratio`` of the pages
    (at least one sequence's window and a page more) and share that budget with them."""
    mc = lm.config
    param = next(lm.model.parameters())
    device, compute = param.device, param.dtype
    dtype = parse_kv_cache_dtype(cfg.kv_cache_dtype, compute)
    if _hybrid_window_kv(lm, cfg):
        return _hybrid_pool(lm, cfg, max_context, dtype, device, compute)
    if cfg.num_pages is not None:
        return KVPool(
            mc.num_layers,
            cfg.num_pages,
            cfg.page_size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            device,
            compute_dtype=compute,
        )
    budget = _kv_budget(cfg, device)
    # more pages than the context could ever address across max_running is waste
    cap = pages_for(max_context, cfg.page_size) * cfg.max_running_requests
    return KVPool.from_memory_budget(
        budget,
        num_layers=mc.num_layers,
        page_size=cfg.page_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        max_pages=cap,
        compute_dtype=compute,
    )


def _kv_budget(cfg: EngineConfig, device: torch.device) -> int:
    """Bytes for K/V: ``kv_cache_memory``, else 1 GiB on a CPU or half the free GPU memory."""
    if cfg.kv_cache_memory is not None:
        return int(cfg.kv_cache_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * _DEFAULT_GPU_KV_FRACTION)
    return _DEFAULT_CPU_KV_BYTES


def _hybrid_pool(
    lm: LoadedModel,
    cfg: EngineConfig,
    max_context: int,
    dtype: torch.dtype,
    device: torch.device,
    compute: torch.dtype,
) -> HybridKVPool:
    mc = lm.config
    windows, ps, ratio = mc.layer_windows, cfg.page_size, cfg.window_kv_ratio
    if cfg.num_pages is not None:
        pages = cfg.num_pages
    else:
        pages = HybridKVPool.pages_in_budget(
            windows, _kv_budget(cfg, device), ratio, ps, mc.num_kv_heads, mc.head_dim, dtype
        )
        pages = min(pages, pages_for(max_context, ps) * cfg.max_running_requests)
    # a lone sequence must fit: its window's pages, its partial page and one new page
    least = pages_for(max(windows) - 1, ps) + 2
    slots = min(pages, max(least, math.ceil(ratio * pages)))
    if pages < 1:
        raise ValueError(
            f"kv_cache_memory {cfg.kv_cache_memory} holds no page with hybrid window KV"
        )
    return HybridKVPool.build(
        windows, pages, slots, ps, mc.num_kv_heads, mc.head_dim, dtype, device,
        compute_dtype=compute,
    )  # fmt: skip


def _one_params(params: Any, sampling_params: Any) -> Any:
    """``params`` or its vLLM spelling ``sampling_params``; TypeError when both are given."""
    if sampling_params is None:
        return params
    if params is not None:
        raise TypeError("params and sampling_params are the same argument: pass one of them")
    return sampling_params


def _as_conversations(messages: object) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them -> a list of them."""
    if isinstance(messages, list | tuple) and messages:
        if all(isinstance(m, dict) for m in messages):
            return [list(messages)]
        if all(
            isinstance(c, list | tuple) and all(isinstance(m, dict) for m in c) for c in messages
        ):
            return [list(c) for c in messages]
    raise TypeError(
        "messages must be a conversation (a non-empty list of message dicts, e.g. "
        "[{'role': 'user', 'content': 'hi'}]) or a list of conversations"
    )


__all__ = ["Conversation", "Engine", "EngineConfig", "Prompt", "SeqStatus"]
