"""Beam search, with beams that fork by sharing pages instead of copying their KV.

The search (``BeamSearch``, one per request) follows Hugging Face's ``generate(num_beams=W,
do_sample=False)`` step for step, so both return the same hypotheses from the same logits:

- every step, each live beam's continuations are scored by total log probability (beam score +
  ``log_softmax`` of its logits) and the best ``K = max(2, 1 + number of stop tokens) * W`` over
  all beams are kept, best first;
- a candidate that ends (a stop token, or ``max_tokens`` reached) becomes a finished hypothesis
  if it ranks among the first W, scored ``total / output_length ** length_penalty``; the W best
  hypotheses are kept;
- the first W candidates that do not end are the next step's beams (the first step branches the
  one prompt beam into W);
- the search ends when no beam can beat the worst of W finished hypotheses (at its current
  length, or at ``max_tokens`` with ``early_stopping="never"`` and a positive length penalty),
  when W are finished and ``early_stopping`` is True, or when every candidate ended.

The engine side (``BeamRunner``) maps that onto sequences. A beam is a ``Sequence`` of the
request; after each forward the scheduler has published every full page of it to the radix
cache (``SeqKV.commit``), so its KV is its locked node's path plus at most one private tail
page. A beam's logits row is kept until every live beam of its request has one (a preempted
beam first recomputes its tail), then the request's step is taken:

- a beam with one continuation appends its token and goes on;
- a beam with c > 1 continuations forks c - 1 children (``SeqKV.fork``: one more lock on its
  node and a copy of its tail page; no prefix is copied or recomputed), each on a sequence of a
  beam that got none (its full pages stay cached for whoever matches them) or a new one;
- a child whose tail page the pool cannot supply is queued with its tokens instead, and later
  hits the shared pages and recomputes only its tail, like a preempted sequence.

A beam search request's ``n`` outputs are its best hypotheses, best first; it reports only when
finished (no streaming: beams are reordered and pruned as they go). Forked beams join the
running list directly, so a request holds up to W running slots even where that exceeds
``max_running_requests``.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.outputs import CompletionOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import RequestGroup, SeqStatus, Sequence
from radixkv.engine.scheduler import Scheduler
from radixkv.model.tokenizer import Tokenizer


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token kept, as in ``token_ids``)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None


@dataclass(slots=True)
class Continuation:
    """One of a step's next beams: ``token`` after the step's beam number ``parent``."""

    parent: int
    token: int
    cumulative_logprob: float


class BeamSearch:
    """One request's search state; knows nothing of sequences or pages (pure selection)."""

    def __init__(self, params: SamplingParams, stop_ids: Iterable[int]) -> None:
        """``stop_ids``: the tokens that end a beam (the model's EOS unless ``ignore_eos``,
        and ``params.stop_token_ids``)."""
        self.params = params
        self.width: int = params.beam_width
        self.stop_ids = frozenset(stop_ids)
        self._stop_index = sorted(self.stop_ids)
        # candidates kept per step: enough that W survive even if every beam's best ends
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.outputs: list[CompletionOutput] | None = None  # the request's, once it ended
        self.done = False
        self._improvable = True

    def step(
        self,
        cumulative: list[float],
        logprobs: torch.Tensor,
        num_generated: int,
        output_of: Callable[[int], list[int]],
    ) -> list[Continuation]:
        """One step over the live beams (best first): ``cumulative[i]`` is beam i's score,
        ``logprobs`` ``[P, V]`` fp32 its next-token ``log_softmax``, every beam has
        ``num_generated`` output tokens and ``output_of(i)`` lists them. Updates ``finished``
        and ``done``; returns the next beams, best first (empty when done)."""
        p = self.params
        if num_generated < p.min_tokens and self._stop_index:  # the stops are held back
            logprobs = logprobs.clone()
            logprobs[:, self._stop_index] = -math.inf
        scores = logprobs + torch.tensor(cumulative, dtype=torch.float32)[:, None]  # [P, V]
        vocab = scores.shape[1]
        k = min(self.num_candidates, scores.numel())
        vals, idx = scores.view(-1).topk(k)  # best first
        gen = num_generated + 1  # each candidate's output length
        norm = (vals / (gen**p.length_penalty)).tolist()
        parents = (idx // vocab).tolist()
        tokens = (idx % vocab).tolist()
        totals = vals.tolist()
        at_max = gen >= p.max_tokens
        ends = [at_max or t in self.stop_ids for t in tokens]
        full = len(self.finished) == self.width
        if self._improvable and not (p.early_stopping is True and full):
            for j in range(min(self.width, k)):  # only the first W may finish
                if ends[j]:
                    t = tokens[j]
                    stop = t in self.stop_ids
                    self.finished.append(
                        Hypothesis(
                            [*output_of(parents[j]), t],
                            totals[j],
                            norm[j],
                            "stop" if stop else "length",
                            t if stop else None,
                        )
                    )
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones first on ties
            del self.finished[self.width :]
        nxt = [Continuation(parents[j], tokens[j], totals[j]) for j in range(k) if not ends[j]]
        del nxt[self.width :]
        if not nxt:
            self.done = True
            return nxt
        longest = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else gen
        best = (vals[ends.index(False)] / (longest**p.length_penalty)).item()
        full = len(self.finished) == self.width
        worst = self.finished[-1].score if full else -math.inf
        self._improvable = best > worst
        self.done = not self._improvable or (p.early_stopping is True and full)
        return [] if self.done else nxt

    def results(self, live: list[tuple[list[int], float]], reason: str | None) -> list[Hypothesis]:
        """The request's ``n`` best hypotheses. ``reason`` None: the search ended. Else it was
        cut short ("abort", "error"): the live beams (output tokens, score) compete too, ended
        with that reason."""
        hyps = list(self.finished)
        if reason is not None:
            lp = self.params.length_penalty
            for ids, cum in live:
                score = cum / max(len(ids), 1) ** lp
                hyps.append(Hypothesis(ids, cum, score, reason))
            hyps.sort(key=lambda h: -h.score)
        return hyps[: self.params.n]


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
    ) -> None:
        """``copy_pages(src, dst)`` copies KV pages (all layers) in the device pool."""
        self.scheduler = scheduler
        self.kv = kv
        self.copy_pages = copy_pages
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._rows: dict[RequestGroup, dict[Sequence, torch.Tensor]] = {}

    def start(self, group: RequestGroup) -> None:
        """Give a beam search request (``params.beam_width`` > 0) its search state."""
        p = group.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        group.beam = BeamSearch(p, stops)
        group.stream = False  # reported once finished
        for seq in group.seqs:
            seq.live_detok = False

    def observe(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Keep each beam's next-token log probabilities (``logits`` ``[B, V]``, its rows)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for seq, row in zip(seqs, logprobs):
            self._rows.setdefault(seq.group, {})[seq] = row
            seq.parked = True

    def forget(self, group: RequestGroup) -> None:
        self._rows.pop(group, None)

    def advance(self) -> tuple[list[RequestGroup], int]:
        """Take the step of every request whose live beams all have a row. Returns the
        requests whose search ended (their sequences are still live: the engine ends them,
        ``finish``) and the number of tokens appended."""
        ended: list[RequestGroup] = []
        appended = 0
        for group in list(self._rows):
            rows = self._rows[group]
            beams = [s for s in group.seqs if not s.finished]
            if any(s not in rows for s in beams):
                continue  # a beam is still recomputing its tail
            del self._rows[group]
            search = group.beam
            assert search is not None
            num_generated = beams[0].num_output_tokens
            nxt = search.step(
                [s.cumulative_logprob for s in beams],
                torch.stack([rows[s] for s in beams]).cpu(),
                num_generated,
                lambda i, b=beams: b[i].output_ids,
            )
            if search.done:
                ended.append(group)
            else:
                self._branch(group, beams, nxt)
                appended += len(nxt)
        return ended, appended

    def finish(self, group: RequestGroup, reason: str | None) -> list[CompletionOutput]:
        """End a search (``reason`` None: it ended; "abort"/"error": cut short): release every
        live beam (its computed full pages are published, so the cache keeps what the search
        computed) and return the request's outputs, best first."""
        self.forget(group)
        search = group.beam
        assert search is not None
        live = [s for s in group.seqs if not s.finished]
        hyps = search.results([(s.output_ids, s.cumulative_logprob) for s in live], reason)
        for s in live:
            self.scheduler.finish(s, reason or "stop")
        skip = group.params.skip_special_tokens
        outs = []
        for i, h in enumerate(hyps):
            ids = h.token_ids[:-1] if h.stop_reason is not None else h.token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=skip)
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=h.token_ids,
                    finish_reason=h.finish_reason,
                    delta_text=text,  # reported once, whole
                    delta_token_ids=h.token_ids,
                    stop_reason=h.stop_reason,
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
            seq.parked = False
        for s in spare:  # fewer continuations than beams: these are no longer needed
            s.status = SeqStatus.FINISHED
            s.finish_reason = "pruned"
        for i, s in enumerate(order):
            s.index = i
        group.seqs = order
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = time.monotonic()
            m.ttft = m.first_token_time - m.arrival_time

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (holding nothing) becomes a copy of ``parent``: its tokens and score, and
        its KV through ``SeqKV.fork`` (running) or, when the pool is short or the parent is
        queued, nothing (queued, to recompute its tail)."""
        child.token_ids = array("q", parent.token_ids)
        child.page_keys = list(parent.page_keys)  # the in-batch sharing memo of its pages
        child.cumulative_logprob = parent.cumulative_logprob
        child.num_cached_tokens = parent.num_cached_tokens
        child.finish_reason = child.stop_reason = None
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
