"""Continuous batching: which sequences run this step and how many tokens each computes.

Each ``schedule()`` builds one mixed batch, in this order:

1. running sequences, oldest first: one decode token each, or the next prefill chunk of those
   still prefilling (within the step budget; with ``prefill_budget="attention"`` a chunk
   of n tokens on p computed ones counts n + (n*p + n*n/2) / R, see prefill_cost.py). When the
   pool cannot supply a page, the most recently admitted running sequence is preempted (its
   computed full pages are inserted into the trie, everything is released, it goes back to the
   front of the queue and later resumes by hitting its own pages), so the oldest sequence
   always progresses;
2. admission of waiting sequences in the order of the schedule policy (schedule_policy.py:
   ``lpm``, longest cached prefix first; ``fcfs``, arrival; ``priority``, the requests'
   priority, then as lpm), while the budget, ``max_running_requests`` and the pool allow.
   With fair admission (``EngineConfig.fair_admission``, the default) and requests that name
   a tenant (``SamplingParams.tenant``), the tenants are interleaved, the one with the fewest
   running sequences first, each in the policy's order, none past ``tenant_max_running``
   (schedule_policy.fair_order).
   ``max_running_requests`` counts running slots: one per running sequence, except that a beam
   search request holds ``beam_width`` slots from the admission of its first beam until none of
   its beams runs (its beams fork into them without admission, beam_runner.py).

The running list is kept in priority order (then admission order), so "most recently admitted"
above reads "lowest priority, then most recently admitted"; and before step 1, running sequences
of a lower priority than the best waiting one are preempted while that one could not otherwise
get a running slot or its first chunk's pages. Only the ``priority`` policy takes priorities
other than 0 (intake.py refuses them under the others, the one place that rule is checked), so
under the others both rules change nothing: every priority is 0.

The step budget is ``min(max_prefill_tokens, chunked_prefill_size)`` prefill tokens in all (as in
SGLang, where admitted requests draw on the chunk budget too): a burst of short prompts then
runs as several short steps instead of one long one, so the first of them get their first token
sooner and running streams stall at most one chunk's time. Decode tokens are not counted. While
requests wait, running prefills are held to half the budget until admission is done (then get
what is left), so a long prompt cannot keep short ones waiting until its prefill ends.

In-batch prefix sharing (engine/inflight.py): a candidate whose first uncached page another
running sequence is computing waits for it and then hits it instead of computing it again.
Likewise, with a storage tier, a candidate whose prefix is being prefetched from storage waits
for it (up to the storage timeout) while the others are admitted.

A burst of waiting requests whose remaining prefills are short (they hit a cached prefix, say
50 requests behind a 4,096-token system prompt that one of them just computed) is admitted in
small groups rather than as many as the budget holds: all of a step's admissions get their
first token when the step ends, so ``n`` requests of equal work ``w`` in groups of ``g``, with a
per-step overhead ``d`` (scheduling, the weights read once per step, the running sequences'
decode rows), wait ``(g*w + d) * (n/g + 1) / 2`` on average, least at ``g = sqrt(n * d / w)``. A
step admits at most that many (``d`` is ``step_overhead_tokens``, in budget units, which the
engine sets per device, see ``Scheduler.__init__``, plus a token per decode row of the step);
when the cap stops admission, running prefills held back to half the budget are not topped up,
so the step stays short.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass, field

from radixkv.engine.config import EngineConfig
from radixkv.engine.inflight import InflightPages
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.names import SCHEDULE_POLICIES
from radixkv.engine.prefill_cost import chunk_cost, max_chunk
from radixkv.engine.request import RequestGroup, SeqStatus, Sequence
from radixkv.engine.schedule_policy import fair_order
from radixkv.model.runner import SeqInput
from radixkv.pages import pages_for


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: ``seqs[i]`` computes ``num_new[i]`` tokens starting at its
    ``num_computed``. ``preempted`` lists sequences sent back to the queue this step. The
    ``*_queries`` / ``*_tokens`` counters are the prefix-cache lookups of the sequences admitted
    for the first time this step (for ``EngineStats``)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    prefill_cost: float = 0.0  # num_prefill_tokens in the scheduler's budget units
    num_decode: int = 0
    num_queries: int = 0  # sequences admitted for the first time
    num_query_tokens: int = 0  # their prompt tokens
    num_hit_tokens: int = 0  # of those, served from the prefix cache
    num_host_hit_tokens: int = 0  # of those, loaded back from the host tier
    num_storage_hit_tokens: int = 0  # of those, brought to the host tier from storage
    first_admissions: list[Sequence] = field(default_factory=list)  # the ones counted above

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    def __len__(self) -> int:
        return len(self.seqs)

    def group_by_adapter(self) -> None:
        """Reorder the rows so each LoRA adapter's sequences are adjacent (stable: the base
        model's first, then by adapter slot): each linear layer then adds an adapter's delta
        to one run of rows, a view, instead of gathering and scattering rows."""
        order = sorted(range(len(self.seqs)), key=lambda i: self.seqs[i].lora_slot)
        self.seqs = [self.seqs[i] for i in order]
        self.num_new = [self.num_new[i] for i in order]

    def model_inputs(self) -> list[SeqInput]:
        """What the model runner computes: each sequence's new tokens over its page table. A
        token still pending (overlap.py: sampled by the step in flight) is given as 0; the
        device fills it in before the forward."""
        out = []
        for s, n in zip(self.seqs, self.num_new):
            a = s.num_computed
            ids = s.token_ids[a : a + n]
            if len(ids) < n:  # (only ever the decode token of a sequence with num_pending)
                ids = [*ids, *[0] * (n - len(ids))]
            out.append(SeqInput(ids, s.page_table, a, s.lora_slot))
        return out


class PreemptionHeld(Exception):
    """``schedule()`` would preempt while ``Scheduler.hold_preemption`` is set (a step is in
    flight, engine/overlap.py): nothing was preempted and the batch's reservations were
    rolled back; finish the step in flight and schedule again."""


class Scheduler:
    """Owns the waiting queue and the running list (in admission order).

    Mutates sequences' status and, through ``SeqKV``, their pages. Not thread-safe.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: SeqKV,
        *,
        attention_ratio: float,
        step_overhead_tokens: float | None = None,
    ) -> None:
        """``attention_ratio``: R of the model (prefill_cost.py), used when
        ``config.prefill_budget == "attention"``. ``step_overhead_tokens``: a step's fixed cost
        in budget units, which sizes the admission groups of a burst (module docstring); None
        admits as many as the budget holds. The engine passes 64 on a CPU (a prefill token of
        radixkv-tiny costs about a quarter of a millisecond per core; a step's overhead and a few
        dozen decode rows about 15 ms) and 1024 on a GPU (where a step's launch and weight-read
        costs are worth about that many prefill tokens), times the model's stored over active
        linear weights (prefill_cost.weights_per_active: 1 for a dense model, 6.25 for
        bench_moe_peers.py's 32-expert top-4 model, whose one-request prefill step measured
        about 150 (fp32) to 265 (bf16) tokens' worth of fixed cost)."""
        self.kv = kv
        self.page_size = config.page_size
        self.max_running = config.max_running_requests
        self.chunk_size = config.chunk_size
        # prefill tokens (budget units) of one whole step: see the module docstring
        self.step_budget = config.step_prefill_budget
        self.policy = config.schedule_policy
        self.step_overhead_tokens = step_overhead_tokens
        self._admission_order = SCHEDULE_POLICIES[config.schedule_policy]
        # fair admission (schedule_policy.fair_order): tenants interleaved once any request
        # names one (until then every request is the engine user's: the policy's order as is)
        self.fair = config.fair_admission
        self.tenant_max_running = config.tenant_max_running
        self._tenanted = config.tenant_max_running is not None
        # None: the budget counts new tokens only
        self._ratio = attention_ratio if config.prefill_budget == "attention" else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._inflight = InflightPages(self.page_size, enabled=kv.enabled)  # see inflight.py
        # set while a step is in flight (engine/overlap.py): preempting then would release the
        # KV of sequences whose last token is not known yet; schedule() raises PreemptionHeld
        self.hold_preemption = False

    # ------------------------------------------------------------------ queue ops
    def add(self, seq: Sequence, *, front: bool = False) -> None:
        """Queue a sequence holding no pages (``front``: ahead of the others, as a preempted
        one goes)."""
        seq.status = SeqStatus.WAITING
        if seq.tenant is not None:
            self._tenanted = True
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Run a sequence that already holds the pages of its computed tokens (a beam forked
        from a running one, beam_runner.py): it decodes from the next step on."""
        seq.status = SeqStatus.RUNNING
        self._start_running(seq)

    def detach(self, seq: Sequence, *, insert: bool = True) -> None:
        """Take a sequence out of the queues and release its pages and locks (publishing its
        computed full pages unless ``insert=False``); its status is left to the caller."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)
        self._inflight.drop(seq)
        self.kv.release(seq, insert=insert)

    def finish(self, seq: Sequence, reason: str, *, insert: bool = True) -> None:
        """End a sequence however it ends: release its pages and locks, drop it from the queues."""
        self.detach(seq, insert=insert)
        seq.status = SeqStatus.FINISHED
        if seq.finish_reason is None:
            seq.finish_reason = reason

    def preempt(self, seq: Sequence, *, insert: bool = True) -> None:
        """Send a running sequence to the front of the queue, releasing its pages and locks
        (publishing its computed full pages unless ``insert=False``); it keeps its tokens."""
        self.running.remove(seq)
        self._inflight.drop(seq)
        self.kv.release(seq, insert=insert)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def retract_all(self) -> list[Sequence]:
        """Preempt every running sequence without publishing its pages: its KV must not be
        reused (the weights changed). They queue ahead of the others in running order and are
        recomputed when admitted again."""
        retracted = list(self.running)
        for seq in reversed(retracted):  # the last first: each goes to the front
            self.preempt(seq, insert=False)
        return retracted

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.policy == "priority":  # elsewhere all priorities are 0: nothing to scan for
            self._preempt_for_priority(batch)
        held_back = self._schedule_running(batch)
        if not self._admit(batch, self.step_budget - batch.prefill_cost):
            self._top_up(batch, held_back)
        if not batch.seqs and self.waiting:
            self._unpark(batch)
        if any(s.lora_slot for s in batch.seqs):
            batch.group_by_adapter()
        return batch

    def _preempt_for_priority(self, batch: ScheduledBatch) -> None:
        """Make way for the best waiting sequence: preempt running ones of a lower priority,
        lowest first, while it lacks a running slot or the pages of its first chunk (counting
        what it would hit in the cache)."""
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=lambda s: s.params.priority)  # earliest among equals
        remaining = len(best.token_ids) - self.kv.peek_match_len(best)
        first = min(remaining, self.chunk_size or remaining)
        need = self._slots_needed(best)
        while self.running and self.running[-1].params.priority > best.params.priority:
            if self._slots_taken() + need <= self.max_running and self._has_room(best, first):
                return
            self._check_hold(batch)
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)

    def _check_hold(self, batch: ScheduledBatch) -> None:
        """About to preempt: under ``hold_preemption``, undo the batch's reservations and
        raise PreemptionHeld instead."""
        if self.hold_preemption:
            for seq in batch.seqs:
                self.kv.rollback_uncomputed(seq)
            raise PreemptionHeld

    def _slots_taken(self) -> int:
        """Running slots in use (module docstring): one per running sequence, and
        ``beam_width`` for a beam search request with any running beam."""
        beams: dict[RequestGroup, int] = {}
        for s in self.running:
            if s.group.params.beam_width:
                beams[s.group] = beams.get(s.group, 0) + 1
        return len(self.running) + sum(g.params.beam_width - k for g, k in beams.items())

    @staticmethod
    def _slots_needed(seq: Sequence) -> int:
        """Slots that admitting ``seq`` takes: a beam's request holds its slots already while
        another of its beams runs."""
        w = seq.group.params.beam_width
        if not w:
            return 1
        return 0 if any(s.status is SeqStatus.RUNNING for s in seq.group.seqs) else w

    def _start_running(self, seq: Sequence) -> None:
        """Into the running list after every sequence of the same or a better priority (at
        the end when all priorities are 0: admission order)."""
        bisect.insort_right(self.running, seq, key=lambda s: s.params.priority)

    def _schedule_running(self, batch: ScheduledBatch) -> list[int]:
        """Oldest first: each running sequence decodes one token or computes its next prefill
        chunk. A sequence that cannot get even one page preempts the most recently admitted
        running sequence (itself, if it is the newest), so the oldest always progresses.

        While requests wait, running prefills get at most half the step budget, so a long
        prompt's chunks cannot keep new (short) requests out until it is done; what the
        admissions leave over goes back to them (:meth:`_top_up`). Returns the batch rows of
        prefills held back that way."""
        used = 0.0  # budget units
        tokens = 0
        held_back: list[int] = []
        share = self.step_budget / 2 if self.waiting else self.step_budget
        ps = self.page_size
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            remaining = len(seq.token_ids) + seq.num_pending - seq.num_computed
            decode = remaining == 1
            if decode and len(seq.page_table) * ps > seq.num_computed:
                # the common decode: its token's slot is in a page it holds (nothing to reserve)
                batch.add(seq, 1)
                batch.num_decode += 1
                i += 1
                continue
            n = (
                1
                if decode
                else self._chunk(remaining, share - used, seq.num_computed, first=used == 0)
            )
            if n <= 0:
                i += 1
                continue
            n = min(n, self._fit(seq, n))
            if n <= 0:
                self._check_hold(batch)
                victim = self.running[-1]  # most recently admitted, not yet in this batch
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
                continue  # retry seq with the freed pages
            self.kv.reserve(seq, n)  # fits: _fit checked the pool
            batch.add(seq, n)
            if decode:
                batch.num_decode += 1
            else:
                used += chunk_cost(n, seq.num_computed, self._ratio)
                tokens += n
                if share < self.step_budget:
                    held_back.append(len(batch) - 1)
            i += 1
        batch.num_prefill_tokens += tokens
        batch.prefill_cost += used
        return held_back

    def _unpark(self, batch: ScheduledBatch) -> None:
        """Nothing could run: if running sequences are parked (a beam waiting for its request's
        other beams, beam_runner.py) while a queued one lacks the pages to start, preempt them
        (they keep their tokens) and admit again."""
        parked = [s for s in self.running if s.parked]
        if not parked:
            return
        self._check_hold(batch)
        for seq in parked:
            self.preempt(seq)
            batch.preempted.append(seq)
        self._admit(batch, self.step_budget)

    def _top_up(self, batch: ScheduledBatch, rows: list[int]) -> None:
        """Give the budget the admissions left over back to running prefills held back to half
        (chunk costs add up: a chunk of a + b tokens costs chunk(a) + chunk(b after a))."""
        for r in rows:
            left = self.step_budget - batch.prefill_cost
            if left <= 0:
                return
            seq, n = batch.seqs[r], batch.num_new[r]
            past = seq.num_computed
            have = chunk_cost(n, past, self._ratio)
            remaining = len(seq.token_ids) - past
            total = self._chunk(remaining, have + left, past, first=False)
            if total > n:
                total = self._fit(seq, total)  # <= total: what the pool can supply
            if total <= n:
                continue
            self.kv.reserve(seq, total)  # fits: _fit checked the pool
            batch.num_new[r] = total
            batch.num_prefill_tokens += total - n
            batch.prefill_cost += chunk_cost(total, past, self._ratio) - have

    def _admission_cap(self, waiting: int, cost: float, decode_rows: int) -> int | None:
        """Most admissions in a step whose first admission costs ``cost`` budget units, with
        ``waiting`` requests queued and ``decode_rows`` running sequences decoding in it (each a
        token of the step's overhead; module docstring); None: no cap."""
        if self.step_overhead_tokens is None:
            return None
        overhead = self.step_overhead_tokens + decode_rows
        return math.ceil(math.sqrt(waiting * overhead / max(cost, 1.0)))

    def _candidates(self) -> list[Sequence]:
        """The waiting sequences in the order to try them (schedule_policy.py): the policy's,
        interleaved by tenant under fair admission."""
        if not (self.fair and self._tenanted):
            return self._admission_order(self.waiting, self.kv)
        return fair_order(
            self.waiting,
            self.kv,
            self._admission_order,
            self.running_by_tenant(),
            self.tenant_max_running,
        )

    def running_by_tenant(self) -> dict[str | None, int]:
        """Running sequences per tenant (``SamplingParams.tenant``)."""
        out: dict[str | None, int] = {}
        for s in self.running:
            out[s.tenant] = out.get(s.tenant, 0) + 1
        return out

    def _admit(self, batch: ScheduledBatch, budget: float) -> bool:
        """Admit waiting sequences in policy order while the budget, ``max_running_requests``,
        the pool and the burst cap allow. Returns True when the cap stopped it."""
        if not self.waiting:
            return False
        order = self._candidates()
        used = 0.0  # budget units
        tokens = 0
        admitted: list[Sequence] = []
        cap: int | None = None
        capped = False
        slots = self._slots_taken()
        for seq in order:
            need = self._slots_needed(seq)
            if slots + need > self.max_running or budget - used <= 0:
                break
            if cap is not None and len(admitted) >= cap:
                capped = True
                break
            if self.kv.prefetch_pending(seq):  # its prefix is on its way from storage
                continue
            if seq.parked:  # a beam whose logits are in: nothing to compute until its step
                continue
            hit = self.kv.acquire(seq)
            if self._inflight.computed_elsewhere(seq):
                self.kv.release(seq, insert=False)
                continue
            remaining = len(seq.token_ids) - seq.num_computed
            first = used == 0 and budget == self.step_budget
            n = self._chunk(remaining, budget - used, seq.num_computed, first=first)
            most = self.kv.max_chunk(seq)  # window slots: a chunk must fit in them
            if most is not None:
                n = min(n, most)
            if n <= 0 or not self._has_room(seq, n):
                self.kv.release(seq, insert=False)
                break
            self.kv.reserve(seq, n)
            if seq.num_cached_tokens < 0:  # first admission: count its prefix-cache lookup
                seq.num_cached_tokens = hit
                batch.num_queries += 1
                batch.num_query_tokens += seq.num_prompt_tokens
                batch.num_hit_tokens += hit
                batch.num_host_hit_tokens += self.kv.last_loaded_tokens
                batch.num_storage_hit_tokens += self.kv.last_storage_tokens
                batch.first_admissions.append(seq)
            metrics = seq.group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = time.monotonic()
            seq.status = SeqStatus.RUNNING
            self._start_running(seq)
            slots += need
            self._inflight.announce(seq)
            batch.add(seq, n)
            cost = chunk_cost(n, seq.num_computed, self._ratio)
            if not admitted:
                cap = self._admission_cap(len(self.waiting), cost, batch.num_decode)
            admitted.append(seq)
            used += cost
            tokens += n
        if admitted:
            gone = set(map(id, admitted))
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        batch.num_prefill_tokens += tokens
        batch.prefill_cost += used
        return capped

    def unschedule_failed_loads(self, batch: ScheduledBatch, failed: list[Sequence]) -> None:
        """Take sequences whose host-tier load failed (``SeqKV.finish_loads``) out of the batch
        before its forward: release their pages and locks and put them back at the head of the
        queue; the batch's lookup counters forget them, so their next admission (a device-only
        hit) is the one counted."""
        gone = {id(s) for s in failed}
        keep = [(s, n) for s, n in zip(batch.seqs, batch.num_new) if id(s) not in gone]
        for seq, n in zip(batch.seqs, batch.num_new):
            if id(seq) not in gone:
                continue
            batch.num_prefill_tokens -= n
            batch.prefill_cost -= chunk_cost(n, seq.num_computed, self._ratio)
            if any(s is seq for s in batch.first_admissions):  # counted this step: uncount
                batch.num_queries -= 1
                batch.num_query_tokens -= seq.num_prompt_tokens
                batch.num_hit_tokens -= seq.num_cached_tokens
                if seq.load is not None:
                    loaded = seq.load.num_loaded_tokens
                    batch.num_host_hit_tokens -= loaded
                    batch.num_storage_hit_tokens -= self.kv.storage_hit_tokens(
                        seq, seq.num_cached_tokens, loaded
                    )
                seq.num_cached_tokens = -1
            self.running.remove(seq)
            self._inflight.drop(seq)
            self.kv.release(seq, insert=False)
            seq.status = SeqStatus.WAITING
        batch.seqs = [s for s, _ in keep]
        batch.num_new = [n for _, n in keep]
        self.waiting.extendleft(reversed(failed))

    def _chunk(self, remaining: int, budget: float, past: int, *, first: bool) -> int:
        """Tokens to compute this step for a sequence with ``remaining`` uncomputed tokens after
        ``past`` computed ones, within ``budget`` (budget units). The step's first prefill
        always progresses: with the attention budget, by at least a page."""
        if self.chunk_size is None:
            # no chunking: all or nothing (a lone prompt may exceed the budget)
            fits = chunk_cost(remaining, past, self._ratio) <= budget
            return remaining if (fits or first) else 0
        n = min(remaining, self.chunk_size, max_chunk(budget, past, self._ratio))
        if first and self._ratio is not None:
            # a very long context may price even a page above the budget: take a page anyway
            n = max(n, min(remaining, self.chunk_size, self.page_size))
        return n

    def _fit(self, seq: Sequence, n: int) -> int:
        """Largest token count <= n whose pages the pool can supply now."""
        if self.kv.pages_needed(seq, n) <= self.kv.available_pages():
            return n
        slots = (len(seq.page_table) + self.kv.available_pages()) * self.page_size
        return max(0, slots - seq.num_computed)

    def _has_room(self, seq: Sequence, n: int) -> bool:
        # keep a page of headroom per running sequence so admissions do not immediately force
        # preemptions of the decodes already running
        need = self.kv.pages_needed(seq, n)
        return need + len(self.running) <= self.kv.available_pages() or (
            not self.running and need <= self.kv.available_pages()
        )

    # ------------------------------------------------------------------ after the forward
    def after_forward(self, batch: ScheduledBatch) -> list[int]:
        """Record the computed tokens, publish full pages; returns the batch rows whose last
        computed token is the sequence's last token (they sample a new token)."""
        kv = self.kv
        commit = kv.commit
        retire = self._inflight.retire
        # SeqKV.commit's own test, hoisted: a decode row mostly completes no page, and a call
        # per row that does nothing costs more than the test (with window KV it always runs)
        ps = kv.page_size
        publish = kv.enabled
        always = kv.window is not None
        rows = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            c = seq.num_computed = seq.num_computed + n
            if always or (publish and c // ps > seq.num_shared_pages):
                commit(seq)
            if seq.inflight_keys:
                retire(seq)
            if seq.num_computed == len(seq.token_ids):
                rows.append(i)
        return rows

    def advance(self, batch: ScheduledBatch) -> list[int]:
        """A launched step's counters (engine/overlap.py), before its forward has run: record
        its tokens as computed; the rows that sample a token are returned. Publishing waits for
        the step's result (:meth:`publish`): the last token may not be known yet."""
        rows = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids) + seq.num_pending:
                rows.append(i)
        return rows

    def publish(self, seq: Sequence) -> None:
        """:meth:`after_forward`'s publishing for one sequence of a step whose forward is done
        (``seq.num_computed`` its tokens computed then): full pages into the trie, and the
        pages it announced computing retired."""
        self.kv.commit(seq)
        if seq.inflight_keys:
            self._inflight.retire(seq)

    def fail_batch(self, batch: ScheduledBatch) -> None:
        """A forward failed: give back the slots allocated for it (KV of those is garbage)."""
        for seq in batch.seqs:
            self.kv.rollback_uncomputed(seq)

    def check_invariants(self) -> None:
        """Queues and announcements are consistent (cheap; called by Engine.check_invariants;
        the pages themselves are checked by ``SeqKV.check_invariants``)."""
        for s in self.running:
            assert s.status is SeqStatus.RUNNING, s
            assert 0 <= s.num_computed <= len(s.token_ids) + s.num_pending, s
            need = pages_for(s.num_computed, self.page_size)
            assert len(s.page_table) == need, (s, need)
            assert s.num_shared_pages <= len(s.page_table), s
        prios = [s.params.priority for s in self.running]  # preemption takes the end's
        assert prios == sorted(prios), "running list out of priority order"
        for s in self.waiting:
            assert s.status is SeqStatus.WAITING, s
            assert not s.page_table and s.locked_node is None and not s.inflight_keys, s
            assert not s.num_pending, s  # (overlap.py preempts nothing while a step is in flight)
        self._inflight.check(self.running)
