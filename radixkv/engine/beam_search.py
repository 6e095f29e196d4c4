"""Beam search's selection: which continuations of a request's beams go on each step.

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

With ``SamplingParams.logprobs`` each output token gets its entry as sampling gives it (the
token's log probability under its beam's distribution, its rank and the ``logprobs`` most likely
tokens there; logprobs.py), so a hypothesis's entries add up to its ``cumulative_logprob``
(up to float32 rounding).

The engine runs it over sequences that share pages: beam_runner.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from radixkv.engine.logprobs import logprob_entries
from radixkv.engine.outputs import CompletionOutput, SampleLogprobs
from radixkv.engine.params import SamplingParams

# what step() needs to give continuations their logprobs entries: each live beam's entries so
# far (by beam number) and the decoder of one token id (logprobs.TokenTexts)
LogprobHistory = tuple[list[SampleLogprobs], Callable[[int], str]]


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token kept, as in ``token_ids``)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None
    logprobs: SampleLogprobs | None = None  # one entry per token, with SamplingParams.logprobs


@dataclass(slots=True)
class Continuation:
    """One of a step's next beams: ``token`` after the step's beam number ``parent``."""

    parent: int
    token: int
    cumulative_logprob: float
    entry: dict | None = None  # the token's logprobs entry, with SamplingParams.logprobs


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
        history: LogprobHistory | None = None,
        allowed: torch.Tensor | None = None,
    ) -> list[Continuation]:
        """One step over the live beams (best first): ``cumulative[i]`` is beam i's score,
        ``logprobs`` ``[P, V]`` fp32 its next-token ``log_softmax``, every beam has
        ``num_generated`` output tokens and ``output_of(i)`` lists them; ``history`` (needed
        with ``params.logprobs``) their logprobs entries; ``allowed`` ``[P, V]`` bool (guided
        decoding) the tokens each beam's language lets it take. Updates ``finished`` and
        ``done``; returns the next beams, best first (empty when done)."""
        p = self.params
        raw = logprobs  # what entries report: the mask and the stops' hold only steer
        if allowed is not None:
            logprobs = logprobs.masked_fill(~allowed, -math.inf)
        if num_generated < p.min_tokens and self._stop_index:  # the stops are held back
            logprobs = logprobs.clone() if logprobs is raw else logprobs
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
        # candidates a language refuses (or a held stop) have no score: never a beam or an end
        while k and totals[k - 1] == -math.inf:
            k -= 1
        del tokens[k:], parents[k:], totals[k:], norm[k:]
        at_max = gen >= p.max_tokens
        ends = [at_max or t in self.stop_ids for t in tokens]
        entries: list[dict | None] = [None] * k
        if p.logprobs is not None:
            if history is None:
                raise ValueError("BeamSearch.step: params.logprobs needs the beams' history")
            entries = list(
                logprob_entries(
                    raw[parents], tokens, [p.logprobs] * k, history[1],
                    [p.logprob_token_ids] * k if p.logprob_token_ids else (),
                )
            )  # fmt: skip
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
                            None if history is None else [*history[0][parents[j]], entries[j]],
                        )
                    )
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones first on ties
            del self.finished[self.width :]
        nxt = [
            Continuation(parents[j], tokens[j], totals[j], entries[j])
            for j in range(k)
            if not ends[j]
        ]
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

    def results(
        self, live: list[tuple[list[int], float, SampleLogprobs | None]], reason: str | None
    ) -> list[Hypothesis]:
        """The request's ``n`` best hypotheses. ``reason`` None: the search ended. Else it was
        cut short ("abort", "error"): the live beams (output tokens, score, logprobs entries or
        None) compete too, ended with that reason."""
        hyps = list(self.finished)
        if reason is not None:
            lp = self.params.length_penalty
            for ids, cum, entries in live:
                score = cum / max(len(ids), 1) ** lp
                hyps.append(Hypothesis(ids, cum, score, reason, None, entries))
            hyps.sort(key=lambda h: -h.score)
        return hyps[: self.params.n]
