"""After the forward: sampled tokens appended, stops detected, sequences finished, outputs built.

Contract: ``OutputProcessor`` is the only place a sequence is finished (normally, by abort or
on error). Finishing goes through ``Scheduler.finish`` (which releases the sequence's KV and,
unless ``insert=False``, publishes its pages to the cache), hands the text over from the
detokenizer, and removes a fully finished request from the engine's live-request table (the
dict object the engine passes in and shares; the processor only ever pops from it). The
processor owns the set of requests with news since the last ``drain()``, and updates the
engine's ``EngineStats`` counters it is given (generated tokens, finish reasons, finished
requests) and each request's ``RequestMetrics`` (first token, finish, latency).
"""

from __future__ import annotations

import time
from typing import Any

from radixkv.engine.outputs import EngineStats, RequestOutput
from radixkv.engine.request import RequestGroup
from radixkv.engine.request import Sequence as Seq
from radixkv.engine.scheduler import ScheduledBatch, Scheduler


class OutputProcessor:
    """Turns a step's sampled tokens into finished sequences and ``RequestOutput`` objects."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        stats: EngineStats,
        groups: dict[str, RequestGroup],
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.stats = stats
        self.groups = groups  # the engine's live requests (shared, not copied)
        self.touched: dict[str, RequestGroup] = {}  # requests with news since the last drain

    def append_tokens(self, seqs: list[Seq], tokens: list[int]) -> None:
        """Append one sampled token to each sequence; finish those that hit a stop token, a
        stop string or ``max_tokens``."""
        now = time.monotonic()
        for seq, tok in zip(seqs, tokens):
            seq.token_ids.append(tok)
            group = seq.group
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
                group.metrics.ttft = now - group.metrics.arrival_time
            self.touched[group.request_id] = group
            p = seq.params
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                reason, seq.stop_reason = "stop", tok
            elif seq.live_detok and seq.detok.add(tok):
                reason, seq.stop_reason = "stop", seq.detok.stop_matched
            if reason is None and seq.num_output_tokens >= p.max_tokens:
                reason = "length"
            if reason is not None:
                self.finish_seq(seq, reason)
        self.stats.generated_tokens += len(tokens)

    def finish_seq(self, seq: Seq, reason: str, *, insert: bool = True) -> None:
        """End ``seq`` with ``reason``; ``insert=False`` when its KV must not be published."""
        self.scheduler.finish(seq, reason, insert=insert)
        d = seq.detok
        if seq.live_detok:
            d.flush()
        else:  # decode once at the end instead of every step
            ids = seq.output_ids
            if isinstance(seq.stop_reason, int):
                ids = ids[:-1]
            d.text = self.tokenizer.decode(ids)
        fr = self.stats.finish_reasons
        fr[reason] = fr.get(reason, 0) + 1
        group = seq.group
        if group.finished:
            now = time.monotonic()
            group.metrics.finish_time = now
            group.metrics.latency = now - group.metrics.arrival_time
            self.groups.pop(group.request_id, None)
            self.stats.num_finished += 1
        self.touched[group.request_id] = group

    def drain(self) -> list[RequestOutput]:
        """Outputs of the requests with news (streamed ones, or finished), then forget them."""
        outs = [g.make_output() for g in self.touched.values() if g.stream or g.finished]
        self.touched.clear()
        return outs

    def fail_batch(self, batch: ScheduledBatch) -> None:
        """A forward raised: every sequence in the batch ends with "error" (its KV of this step
        is garbage, so nothing it computed is published); the rest keep running."""
        self.scheduler.fail_batch(batch)
        for seq in batch.seqs:
            if not seq.finished:
                self.finish_seq(seq, "error", insert=False)

    def fail_unschedulable(self) -> None:
        """Called when a step scheduled nothing."""
        # Nothing runs and nothing could be admitted: the head cannot fit (pages pinned by
        # sessions). Fail it rather than spin forever.
        if self.scheduler.waiting and not self.scheduler.running:
            self.finish_seq(self.scheduler.waiting[0], "error", insert=False)
