"""Beam search requests in the engine: beams are sequences that fork by sharing pages.

The search itself (which continuations go on) is beam_search.py's. A beam is a ``Sequence``
of the request; after each forward the scheduler has published every full page of it to the
radix cache (``SeqKV.commit``), so its KV is its locked node's path plus at most one private tail
page. A beam's logits row is kept until every live beam of its request has one (a preempted
beam first recomputes its tail), then the request's step is taken:

- a beam with one continuation appends its token and goes on;
- a beam with c > 1 continuations forks c - 1 children (``SeqKV.fork``: one more lock on its
  node and a copy of its tail page; no prefix is copied or recomputed), each on a sequence of a
  beam that got none (its full pages stay cached for whoever matches them) or a new one;
- a child whose tail page the pool cannot supply is queued with its tokens instead, and later
  hits the shared pages and recomputes only its tail, like a preempted sequence;
- with guided decoding each beam has its own walk of the language (``TokenGuide.fork`` at a
  fork): its mask steers the search, and it advances with the beam's token.

A beam search request's ``n`` outputs are its best hypotheses, best first; it reports only when
finished (no streaming: beams are reordered and pruned as they go). Forked beams join the
running list directly: the scheduler counts W running slots for a request from the admission
of its first beam on (``max_running_requests`` holds; a request with W above it is refused).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from radixkv.engine.beam_search import BeamSearch, Continuation, Hypothesis
from radixkv.engine.detokenizer import IncrementalDetokenizer, decode_output
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.logprobs import TokenTexts
from radixkv.engine.outputs import CompletionOutput
from radixkv.engine.request import RequestGroup, SeqStatus, Sequence
from radixkv.engine.scheduler import Scheduler
from radixkv.model.tokenizer import Tokenizer


class BeamRunner:
    """Runs the engine's beam search requests: keeps their beams' logits rows until a request's
    step can be taken, then forks, advances and prunes its sequences (module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv: SeqKV,
        copy_pages: Callable[[list[int], list[int]], None],
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        token_text: TokenTexts,
    ) -> None:
        """``copy_pages(src, dst)`` copies KV pages (all layers) in the device pool;
        ``token_text`` decodes the token ids of logprobs entries (the engine's memo)."""
        self.scheduler = scheduler
        self.kv = kv
        self.copy_pages = copy_pages
        self.tokenizer = tokenizer
        self.token_text = token_text
        self.eos_token_ids = eos_token_ids
        self._rows: dict[RequestGroup, dict[Sequence, torch.Tensor]] = {}

    def start(self, group: RequestGroup) -> None:
        """Give a beam search request (``params.beam_width`` > 0) its search state."""
        p = group.params
        # under ignore_eos a guided walk offers EOS only where its language must end: there it
        # ends the beam, as the language's end ends a sampled sequence
        eos = set() if p.ignore_eos and p.guided is None else set(self.eos_token_ids)
        stops = set(p.stop_token_ids) | eos
        group.beam = BeamSearch(p, stops)
        group.stream = False  # reported once finished
        for seq in group.seqs:
            seq.live_detok = False

    def observe(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> list[tuple[RequestGroup, Exception]]:
        """Keep each beam's next-token log probabilities (``logits`` ``[B, V]``, its rows).
        Contained per request: a request whose row raises is returned with its error (the
        engine ends it alone, with "error"), the others' rows are kept as without it."""
        failed: dict[RequestGroup, Exception] = {}
        try:
            rows: list[torch.Tensor | None] = list(torch.log_softmax(logits.float(), dim=-1))
        except Exception:  # one row at a time below: the failing one alone fails
            rows = [None] * len(seqs)
        for j, seq in enumerate(seqs):
            if seq.group in failed:
                continue
            try:
                row = rows[j]
                self.keep(seq, torch.log_softmax(logits[j].float(), dim=-1) if row is None else row)
            except Exception as e:
                failed[seq.group] = e
        for group in failed:
            self.forget(group)
        return list(failed.items())

    def keep(self, seq: Sequence, row: torch.Tensor) -> None:
        """Keep one beam's next-token log probabilities ``row`` ``[V]``; it waits (parked)
        for its request's other beams."""
        self._rows.setdefault(seq.group, {})[seq] = row
        seq.parked = True

    def forget(self, group: RequestGroup) -> None:
        self._rows.pop(group, None)

    def advance(
        self,
    ) -> tuple[list[RequestGroup], int, list[tuple[RequestGroup, Exception]]]:
        """Take the step of every request whose live beams all have a row. Returns the
        requests whose search ended (their sequences are still live: the engine ends them,
        ``finish``), the number of tokens appended, and the requests whose step raised (its
        selection, its language, its logprobs...) with their errors: contained per request,
        each left with its live beams consistent (:meth:`_salvage`) for the engine to end
        with "error" while the others go on."""
        ended: list[RequestGroup] = []
        failed: list[tuple[RequestGroup, Exception]] = []
        appended = 0
        for group in list(self._rows):
            rows = self._rows[group]
            beams = [s for s in group.seqs if not s.finished]
            if any(s not in rows for s in beams):
                continue  # a beam is still recomputing its tail
            del self._rows[group]
            try:
                n = self._step(group, beams, rows)
            except Exception as e:
                self._salvage(group)
                failed.append((group, e))
                continue
            if n is None:
                ended.append(group)
            else:
                appended += n
        return ended, appended, failed

    def _step(
        self, group: RequestGroup, beams: list[Sequence], rows: dict[Sequence, torch.Tensor]
    ) -> int | None:
        """One request's step: the tokens appended, or None when its search is over."""
        search = group.beam
        assert search is not None
        m = group.metrics
        if m.first_token_time is None:  # its first step: the first tokens are chosen
            m.first_token_time = time.monotonic()
            m.ttft = m.first_token_time - m.arrival_time
        num_generated = beams[0].num_output_tokens
        history = None
        if group.params.logprobs is not None:
            history = ([s.logprobs or [] for s in beams], self.token_text)
        allowed = None
        if group.params.guided is not None:  # each beam's own position in the language
            masks = []
            for s in beams:
                assert s.guide is not None  # every beam of a guided request has one
                masks.append(s.guide.allowed())
            allowed = torch.from_numpy(np.stack(masks))
        nxt = search.step(
            [s.cumulative_logprob for s in beams],
            torch.stack([rows[s] for s in beams]).cpu(),
            num_generated,
            lambda i, b=beams: b[i].output_ids,
            history,
            allowed,
        )
        if search.done:
            return None
        self._branch(group, beams, nxt)
        return len(nxt)

    def _salvage(self, group: RequestGroup) -> None:
        """After a request's step raised midway (a fork made, a spare beam detached...): its
        sequences become exactly those the scheduler holds (their pages and locks released
        when the engine ends it), in beam order; a detached spare holds nothing and is marked
        finished. At least one stays: a continuation's parent is never detached."""
        self.forget(group)
        held = {id(s) for s in self.scheduler.running} | {id(s) for s in self.scheduler.waiting}
        mine = {id(s) for s in group.seqs}
        forked = [
            s
            for s in (*self.scheduler.running, *self.scheduler.waiting)
            if s.group is group and id(s) not in mine
        ]
        live = []
        for s in (*group.seqs, *forked):
            if id(s) in held:
                s.parked = False
                live.append(s)
            elif not s.finished:
                s.status = SeqStatus.FINISHED
                s.finish_reason = "error"
        for i, s in enumerate(live):
            s.index = i
        group.seqs = live

    def finish(self, group: RequestGroup, reason: str | None) -> list[CompletionOutput]:
        """End a search (``reason`` None: it ended; "abort"/"error": cut short): release every
        live beam (its computed full pages are published, so the cache keeps what the search
        computed) and return the request's outputs, best first (after an "error", every one
        ends with "error", and there is one, empty, if no beam is left to show)."""
        self.forget(group)
        search = group.beam
        assert search is not None
        live = [s for s in group.seqs if not s.finished]
        hyps = search.results(
            [(s.output_ids, s.cumulative_logprob, s.logprobs) for s in live], reason
        )
        for s in live:
            self.scheduler.finish(s, reason or "stop")
        if reason == "error":  # the request failed: what it had found is shown as it stood
            hyps = [replace(h, finish_reason="error") for h in hyps] or [
                Hypothesis([], 0.0, 0.0, "error")  # its last beam was the one that failed
            ]
        outs = []
        for i, h in enumerate(hyps):
            text = decode_output(
                self.tokenizer,
                h.token_ids,
                ends_with_stop_token=h.stop_reason is not None,
                skip_special_tokens=group.params.skip_special_tokens,
            )
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=h.token_ids,
                    finish_reason=h.finish_reason,
                    delta_text=text,  # reported once, whole
                    delta_token_ids=h.token_ids,
                    stop_reason=h.stop_reason,
                    logprobs=h.logprobs,
                    cumulative_logprob=h.cumulative_logprob,
                    score=h.score,
                )
            )
        search.outputs = outs
        return outs

    # ------------------------------------------------------------------ inside advance
    def _branch(self, group: RequestGroup, beams: list[Sequence], nxt: list[Continuation]) -> None:
        """Make ``nxt`` the request's beams, in that order: each parent's first continuation
        goes on in the parent's sequence, the others fork it into sequences of beams that got
        no continuation (released first) or new ones; unused sequences are dropped."""
        firsts: dict[int, int] = {}  # parent -> its first continuation
        for j, c in enumerate(nxt):
            firsts.setdefault(c.parent, j)
        spare = [s for i, s in enumerate(beams) if i not in firsts]
        for s in spare:
            self.scheduler.detach(s)
        order: list[Sequence] = []
        for j, c in enumerate(nxt):
            parent = beams[c.parent]
            if firsts[c.parent] == j:
                seq = parent
            else:
                seq = spare.pop() if spare else self._new_sequence(group)
                self._fork(parent, seq)
            order.append(seq)
        for seq, c in zip(order, nxt):  # after every fork: a fork copies its parent's tokens
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.cumulative_logprob
            if seq.guide is not None:
                seq.guide.advance(c.token)
            if c.entry is not None:
                assert seq.logprobs is not None
                seq.logprobs.append(c.entry)
            seq.parked = False
        for s in spare:  # fewer continuations than beams: these are no longer needed
            s.status = SeqStatus.FINISHED
            s.finish_reason = "pruned"
        for i, s in enumerate(order):
            s.index = i
        group.seqs = order

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (holding nothing) becomes a copy of ``parent``: its tokens and score, and
        its KV through ``SeqKV.fork`` (running) or, when the pool is short or the parent is
        queued, nothing (queued, to recompute its tail)."""
        child.token_ids = array("q", parent.token_ids)
        child.page_keys = list(parent.page_keys)  # the in-batch sharing memo of its pages
        child.cumulative_logprob = parent.cumulative_logprob
        if parent.logprobs is not None:
            child.logprobs = list(parent.logprobs)
        child.num_cached_tokens = parent.num_cached_tokens
        child.guide = None if parent.guide is None else parent.guide.fork()
        if parent.status is SeqStatus.RUNNING and self.kv.fork(parent, child, self.copy_pages):
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child, front=True)

    def _new_sequence(self, group: RequestGroup) -> Sequence:
        p = group.params
        detok = IncrementalDetokenizer(
            self.tokenizer, group.prompt_token_ids, (), p.skip_special_tokens
        )
        seq = Sequence(group, len(group.seqs), group.prompt_token_ids, None, detok)
        seq.live_detok = False
        return seq
