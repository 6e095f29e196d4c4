"""Request state: a request group (what the user submitted) and its sequences (one per sample).

A ``Sequence`` moves WAITING -> RUNNING -> FINISHED; preemption sends it RUNNING -> WAITING
with its tokens kept (it resumes by re-matching its own cached pages). Its KV fields are owned
by the scheduler's ``SeqKV`` (see kv_manager.py); everything else here is plain data.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.lora import AdapterNamespace
from radixkv.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from radixkv.engine.params import SamplingParams

if TYPE_CHECKING:
    from radixkv.cache import LoadBack, TreeNode
    from radixkv.engine.beam_search import BeamSearch
    from radixkv.engine.guided import TokenGuide
    from radixkv.engine.lora import LoRAInfo
    from radixkv.engine.sampler import UniformStream
    from radixkv.engine.storage_tier import PrefetchJob

# What partitions the prefix cache (a tenant, a LoRA, a cache salt): any hashable value, None
# for the shared default namespace. Two requests share cached pages only within one namespace.
Namespace = Hashable


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One sample of a request: prompt + output token ids and its KV bookkeeping.

    KV fields (mutated only by ``SeqKV``):
        page_table: pages holding tokens ``[0, num_computed)`` (and, during a step, the slots of
            the tokens being computed); page i holds tokens ``[i*page_size, (i+1)*page_size)``.
        num_shared_pages: ``page_table[:num_shared_pages]`` belong to the trie and are protected
            by the lock on ``locked_node``; the rest are this sequence's private pages.
        num_computed: tokens whose K/V are in the pool (once ``load``, a host-tier copy in
            flight, has landed: ``SeqKV.finish_loads``), or that a launched step writes (overlap).
        window_lo: with hybrid window KV, ``page_table[window_lo:]`` are the pages whose
            window slots this sequence pins (its windowed layers read them next step).
    """

    __slots__ = (
        "cumulative_logprob",
        "detok",
        "finish_reason",
        "generator",
        "group",
        "guide",
        "index",
        "inflight_keys",
        "live_detok",
        "load",
        "locked_node",
        "logprobs",
        "num_cached_tokens",
        "num_computed",
        "num_pending",
        "num_prompt_tokens",
        "num_shared_pages",
        "out_list",
        "page_keys",
        "page_table",
        "parked",
        "seq_id",
        "skip_host",
        "spec_misses",
        "spec_wait",
        "status",
        "stop_reason",
        "token_ids",
        "window_lo",
    )

    def __init__(
        self,
        group: RequestGroup,
        index: int,
        prompt_ids: list[int],
        generator: UniformStream | None,
        detok: IncrementalDetokenizer,
    ) -> None:
        self.group = group
        self.index = index
        one = group.params.n == 1 and not group.params.beam_width
        self.seq_id = group.request_id if one else f"{group.request_id}#{index}"
        # array('q'): the cache's fast path for keys (slices are one memcpy)
        self.token_ids: array[int] = array("q", prompt_ids)
        # the output ids as a list, grown as outputs are made (copy_output_ids)
        self.out_list: list[int] = []
        self.num_prompt_tokens = len(prompt_ids)
        self.generator = generator
        self.detok = detok
        self.live_detok = True  # detokenize every step (else once, at finish)
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # one entry per output token when the params ask for logprobs (engine/logprobs.py)
        self.logprobs: list[dict[int, Logprob]] | None = (
            None if group.params.logprobs is None else []
        )
        self.cumulative_logprob = 0.0
        # SamplingParams.guided: where this sample's output stands in its language (guided.py)
        self.guide: TokenGuide | None = None
        self.page_table: list[int] = []
        self.num_shared_pages = 0
        self.locked_node: TreeNode | None = None
        self.window_lo = 0
        self.num_computed = 0
        # overlap (engine/overlap.py): tokens sampled by launched steps and not yet known here;
        # they follow ``token_ids`` (the next decode's input is the last of them, filled in on
        # the device), so the sequence has ``len(token_ids) + num_pending`` tokens
        self.num_pending = 0
        self.num_cached_tokens = -1  # set at first admission
        # host tier: the load back started at admission, waited for before the forward
        # (kv_manager.py); after one failed, this sequence stops trying the host tier
        self.load: LoadBack | None = None
        self.skip_host = False
        # in-batch sharing (inflight.py): chained hashes of the full pages (grown lazily), and
        # (page index, hash) of the pages this sequence announced it is computing, in page order
        self.page_keys: list[int] = []
        self.inflight_keys: deque[tuple[int, int]] = deque()
        # speculative decoding (speculative.py): verifications in a row that kept no draft, and
        # steps left before the next lookup
        self.spec_misses = 0
        self.spec_wait = 0
        # beam search (beam_runner.py): its logits are in, it waits for its request's other
        # beams; the scheduler neither computes nor admits it meanwhile
        self.parked = False

    @property
    def params(self) -> SamplingParams:
        return self.group.params

    @property
    def tenant(self) -> str | None:
        """Whose request this is, for fair admission (``SamplingParams.tenant``)."""
        return self.group.params.tenant

    @property
    def namespace(self) -> Namespace:
        """The prefix-cache namespace of its pages (the request's, or its LoRA adapter's)."""
        return self.group.cache_namespace

    @property
    def lora_slot(self) -> int:
        """The model runner's slot of its LoRA adapter (0: the base model)."""
        lora = self.group.lora
        return 0 if lora is None else lora.slot

    @property
    def reuse_limit(self) -> int:
        """How many leading tokens may be served from the prefix cache: all but the last (its
        logits are needed), and while this sequence still owes its request prompt logprobs,
        only the positions that have them (the others' outputs must be computed)."""
        n = len(self.token_ids) - 1
        if self.owes_prompt_logprobs:
            return min(n, len(self.group.prompt_logprobs or ()) - 1)
        return n

    @property
    def owes_prompt_logprobs(self) -> bool:
        """This sample computes its request's prompt logprobs, and they are not all done."""
        owed = self.group.prompt_logprobs
        return owed is not None and self.index == 0 and len(owed) < self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :].tolist()

    def copy_output_ids(self) -> list[int]:
        """A new list of the output ids, the caller's to keep (each output's cumulative
        ``token_ids``): copied from ``out_list``, which grows by the tokens new since the last
        call, where converting the whole output every step would cost a Python int per token
        (at 2,000 output tokens, 256 streams: 5.8 ms a step against 1.6). Outputs only grow (a
        stream's deltas assume it too); if the tokens shrank or the last one kept changed, the
        list is built anew."""
        ids = self.token_ids
        mine = self.out_list
        m = len(mine)
        new = len(ids) - self.num_prompt_tokens - m  # tokens since the last call
        if new == 1 and (not m or mine[-1] == ids[-2]):  # the usual step: one token more
            mine.append(ids[-1])
        elif new or (m and mine[-1] != ids[-1]):
            n0 = self.num_prompt_tokens
            if new < 0 or (m and mine[-1] != ids[n0 + m - 1]):
                del mine[:]
                m = 0
            mine += ids[n0 + m :].tolist()
        return mine.copy()  # (``mine`` itself is never handed out)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, tokens={len(self.token_ids)}, "
            f"computed={self.num_computed}, pages={len(self.page_table)}, "
            f"shared={self.num_shared_pages})"
        )


class RequestGroup:
    """What one ``add_request`` submitted: a prompt, its params and ``params.n`` sequences (with
    beam search, its live beams: ``beam`` holds the search, beam_search.py)."""

    __slots__ = (
        "_emitted_tokens",
        "beam",
        "cache_namespace",
        "error",
        "lora",
        "metrics",
        "namespace",
        "params",
        "prefetch",
        "prompt",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "seqs",
        "stream",
        "weight_version",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: Namespace,
        arrival_time: float,
        stream: bool,
        lora: LoRAInfo | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.namespace = namespace
        # the LoRA adapter it runs with (None: the base model); its KV is cached apart
        self.lora = lora
        self.cache_namespace: Namespace = (
            namespace if lora is None else AdapterNamespace(lora.digest, namespace)
        )
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.stream = stream  # emit an output every step (else only when finished)
        self.seqs: list[Sequence] = []
        self._emitted_tokens: list[int] = []
        # the storage tier's lookup of the prompt (kv_manager.py), or None
        self.prefetch: PrefetchJob | None = None
        self.beam: BeamSearch | None = None  # SamplingParams.beam_width > 0 (beam_search.py)
        # the engine's weight version, set at submission and by each weight update it lives
        # through (Engine.update_weights)
        self.weight_version = "default"
        # why a sample ended with "error" (the first such error's message), else None
        self.error: str | None = None
        # SamplingParams.prompt_logprobs: one entry per prompt token computed so far (the first
        # token has none), appended in order by the engine as sample 0's prefill goes
        # (None up to prompt_logprobs_start: those tokens get none)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None
            if params.prompt_logprobs is None
            else [None] * max(1, min(params.prompt_logprobs_start, len(prompt_token_ids)))
        )

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the usual n == 1: no generator expression
            return seqs[0].status is SeqStatus.FINISHED
        return all(s.status is SeqStatus.FINISHED for s in seqs)

    def make_output(self) -> RequestOutput:
        """Snapshot for the user; advances each sequence's emitted-delta cursor."""
        seqs = self.seqs
        emitted = self._emitted_tokens
        if len(emitted) != len(seqs):
            emitted = self._emitted_tokens = [0] * len(seqs)
        if len(seqs) == 1 and self.beam is None:  # the usual n == 1: no loop, no all()
            s = seqs[0]
            done = s.status is SeqStatus.FINISHED
            first = self._sample_output(s, emitted)
            outs = [first]
        else:
            done = all(s.status is SeqStatus.FINISHED for s in seqs)
            outs = self._sample_outputs() if self.beam is None else list(self.beam.outputs or ())
            first = outs[0] if outs else CompletionOutput(index=0, text="", token_ids=[])
        pl = self.prompt_logprobs
        cached = seqs[0].num_cached_tokens
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            num_cached_tokens=cached if cached > 0 else 0,
            metrics=self.metrics,
            outputs=outs,
            finished=done,
            namespace=self.namespace,
            lora=None if self.lora is None else self.lora.name,
            weight_version=self.weight_version,
            error=self.error,
            prompt_logprobs=(
                None if pl is None or len(pl) != len(self.prompt_token_ids) else list(pl)
            ),
        )

    def _sample_outputs(self) -> list[CompletionOutput]:
        emitted = self._emitted_tokens
        return [self._sample_output(s, emitted) for s in self.seqs]

    @staticmethod
    def _sample_output(s: Sequence, emitted: list[int]) -> CompletionOutput:
        """Sample ``s``'s output now; ``emitted[s.index]`` (its ids already reported, for the
        delta) moves up to them."""
        out_ids = s.copy_output_ids()
        delta, text = s.detok.take(s.status is SeqStatus.FINISHED)
        i = s.index
        prev = emitted[i]
        emitted[i] = len(out_ids)
        lps = s.logprobs
        return CompletionOutput(
            index=i,
            text=text,
            token_ids=out_ids,
            finish_reason=s.finish_reason,
            delta_text=delta,
            delta_token_ids=out_ids[prev:] if prev else out_ids.copy(),
            stop_reason=s.stop_reason,
            logprobs=None if lps is None else list(lps),
            cumulative_logprob=None if lps is None else s.cumulative_logprob,
        )
