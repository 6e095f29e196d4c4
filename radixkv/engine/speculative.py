"""Speculative decoding by prompt lookup (n-gram drafts).

A decoding sequence whose last few tokens occurred earlier in its prompt or output (code being
edited, a document quoted, a list continued) probably goes on as it did then. Each step,
:meth:`Speculator.propose` takes the tokens that followed the latest earlier occurrence of the
sequence's last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) as up
to ``num_speculative_tokens`` drafts, appends them and widens the sequence's row of the batch to
``1 + k`` tokens: one forward computes the real last token and the drafts together. After it,
:meth:`Speculator.verify` compares each draft with the model's greedy choice at the position
before it and keeps the longest agreeing run; the model's choice after that run is the step's
sampled token. So a step yields 1 to ``k + 1`` tokens, exactly the ones plain greedy decoding
would have (the same logits, up to the batch shape's float rounding), in one forward. Sampled
requests verify by speculative sampling (:func:`accept_sampled`): their outputs follow the same
distribution as without drafts (not the same draws: the generator is used differently).

Contracts. Drafts live within one step: appended after scheduling (their slots reserved then, or
no drafts when the pool cannot supply them), cut back to the accepted run before the scheduler
records the step (so only real tokens are computed, committed and published), and their
slots past the accepted run freed after. A draft that is a stop token (EOS unless
``ignore_eos``, ``stop_token_ids``) is never accepted: the model's own choice there ends the
output through the normal path. Stop strings are matched as the engine appends the kept drafts
one by one, as it appends decoded tokens: one completed inside the run ends the output there,
and the rest of the run is dropped (its KV stays only where a page was already published).
Penalties, bias and ``min_tokens`` depend on the tokens before each position: a drafted row's
logits are adjusted position by position, each with its own history (the drafts before it
included), so the drafts are judged by what sampling would see at each position. Guided
requests take part the same way: drafts are cut at the first one their language refuses before
the forward (:meth:`TokenGuide.judge_drafts`), and each position's logits are masked by the
language after the drafts before it (where jump-forward would append a forced token, that
token alone), the walk rolled back after (the accepted drafts and the step's token are walked
as the engine appends them); the step's token is verification's, drawn
from the masked row after the run. Beam search does not take part. Requests with logprobs do: each kept draft's entry comes from the row's logits at the position before it (raw,
as any step's), and the step's own token's from the position after the run. A
sequence whose drafts keep being refused backs off (exponentially, up to ``MAX_BACKOFF`` steps
between lookups), so text that does not repeat costs few wide forwards.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from radixkv.cache import OutOfPages
from radixkv.engine.logit_adjust import adjust_logits
from radixkv.engine.request import Sequence
from radixkv.engine.sampler import sampling_probs

if TYPE_CHECKING:
    from radixkv.engine.kv_manager import SeqKV
    from radixkv.engine.scheduler import ScheduledBatch

_TOKEN = 8  # bytes of a token in array('q')
# Tokens searched back for an earlier occurrence: bounds a lookup's cost (a copy and a scan of
# 64 KB, some 10 us) however long the sequence grows
LOOKUP_WINDOW = 8192
# most steps a sequence skips drafting after its drafts kept being refused
MAX_BACKOFF = 16


def propose_ngram(
    tokens: array, k: int, n_min: int, n_max: int, window: int = LOOKUP_WINDOW
) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of the last ``n`` tokens of
    ``tokens`` (the longest ``n`` in ``[n_min, n_max]`` that occurs within the last ``window``
    tokens), or [] when none does. One ``bytes.rfind`` per ``n`` (C speed) over the int64
    encoding; a match must be aligned to a token."""
    total = len(tokens)
    base = max(0, total - window)
    data = memoryview(tokens)[base:].tobytes()  # one copy of the window
    limit = len(data) - _TOKEN  # an occurrence must end before the last token (not be it)
    for n in range(min(n_max, total - base - 1), n_min - 1, -1):
        pattern = data[-n * _TOKEN :]
        end = limit
        while (pos := data.rfind(pattern, 0, end)) >= 0:
            if pos % _TOKEN == 0:
                # what followed the match; where it runs into the end, the text since the
                # match repeats (a loop, a list continued): draft j copies position start + j
                # of tokens + drafts
                start = base + pos // _TOKEN + n
                out = tokens[start : start + k].tolist()
                while len(out) < k:
                    out.append(out[start + len(out) - total])
                return out
            end = pos + len(pattern) - 1  # misaligned: look further back
    return []


def accept_sampled(
    q: torch.Tensor, drafts: list[int], banned: Collection[int], generator: torch.Generator
) -> tuple[int, int]:
    """Speculative sampling with drafts that came with certainty (a lookup, not a model): draft
    ``j`` is kept with probability ``q[j, d_j]``; at the first one refused, the step's token is
    drawn from ``q[j]`` without ``d_j`` (renormalised); with all kept, from ``q[k]``. Each
    output token is then distributed exactly as sampling from ``q`` one step at a time would
    give. Drafts in ``banned`` (stop tokens) are not offered: at one, the token is drawn from
    ``q[j]`` whole. ``q``: ``[1 + k, V]`` normalised probabilities. Returns (kept drafts,
    token)."""
    q = q.cpu()
    for j, d in enumerate(drafts):
        if d in banned:
            return j, int(torch.multinomial(q[j], 1, generator=generator))
        if torch.rand(1, generator=generator).item() < q[j, d].item():
            continue
        rest = q[j].clone()
        rest[d] = 0.0
        if rest.sum().item() <= 0.0:  # q[j] is all d (a refusal only by float round-off)
            continue
        return j, int(torch.multinomial(rest, 1, generator=generator))
    k = len(drafts)
    return k, int(torch.multinomial(q[k], 1, generator=generator))


class Speculator:
    """Drafts, verification and their bookkeeping for one engine (see the module docstring)."""

    def __init__(
        self,
        kv: SeqKV,
        *,
        num_tokens: int,
        lookup_min: int,
        lookup_max: int,
        max_context: int,
        eos_token_ids: Collection[int],
        jump_forward: bool,
    ) -> None:
        self.kv = kv
        self.num_tokens = num_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max
        self.max_context = max_context
        self.eos_token_ids = frozenset(eos_token_ids)
        self.jump_forward = jump_forward  # EngineConfig.guided_jump_forward

    def forces(self, seq: Sequence) -> bool:
        """Whether jump-forward appends the tokens ``seq``'s language forces (the engine's
        rule: on, and no logprobs wanted): its drafts are then judged by those tokens."""
        return self.jump_forward and seq.logprobs is None

    def eligible(self, seq: Sequence) -> bool:
        p = seq.params
        return not p.beam_width and seq.num_computed == len(seq.token_ids) - 1

    def propose(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        """Drafts for the batch's eligible decode rows, appended to their sequences (slots
        reserved, ``num_new`` widened); {row: drafts}."""
        out: dict[int, list[int]] = {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            if n != 1 or not self.eligible(seq):
                continue
            if seq.spec_wait:  # backing off after drafts that were all refused
                seq.spec_wait -= 1
                continue
            p = seq.params
            room = min(
                self.num_tokens,
                p.max_tokens - seq.num_output_tokens - 1,  # the step's own token comes too
                self.max_context - len(seq.token_ids),
            )
            if room <= 0:
                continue
            drafts = propose_ngram(seq.token_ids, room, self.lookup_min, self.lookup_max)
            if drafts and seq.guide is not None:  # what its language refuses is never kept
                del drafts[seq.guide.judge_drafts(drafts, force=self.forces(seq)) :]
            if not drafts:
                continue
            try:
                self.kv.reserve(seq, 1 + len(drafts))
            except OutOfPages:
                continue  # the pool is short: this row decodes one token, as it would have
            seq.token_ids.extend(drafts)
            batch.num_new[i] = 1 + len(drafts)
            out[i] = drafts
        return out

    def discard(self, batch: ScheduledBatch, drafts: dict[int, list[int]]) -> None:
        """Take the drafts back out (the forward failed)."""
        for i, d in drafts.items():
            del batch.seqs[i].token_ids[-len(d) :]
            batch.num_new[i] = 1

    def verify(
        self,
        batch: ScheduledBatch,
        drafts: dict[int, list[int]],
        hidden: list[torch.Tensor],
        logits: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[
        dict[Sequence, list[int]],
        dict[int, int],
        dict[Sequence, torch.Tensor],
        list[tuple[Sequence, Exception]],
    ]:
        """Keep each row's drafts as far as the model agrees (greedy: its argmax; sampled:
        :func:`accept_sampled`); cut the rest from the sequence and the row. A greedy row's
        logits after its run go into ``logits`` (the row's sampling logits: its argmax is the
        step's token), and a sampled row's too when it wants logprobs; a sampled or guided row's
        token is drawn here (a guided row's by its language after the kept drafts). ``hidden``: the rows' trunk states ``[1 + k, hidden]``, in ``drafts``
        order; ``head``: hidden -> logits (``ModelRunner.logits``). Returns ({sequence: kept
        drafts}, {row: its drawn token}, {sequence wanting logprobs: its kept drafts' raw
        logits ``[a, V]``}, [(sequence, error)]); the second replaces what sampling the row's
        logits gives.

        Contained per row: a row whose verification raises (its penalties, its language, its
        sampling...) keeps no draft (they are cut, as if all were refused) and is returned
        with its error in the fourth, for the engine to end alone with "error" once the
        scheduler has recorded the step; the other rows are verified as without it."""
        accepted: dict[Sequence, list[int]] = {}
        drawn: dict[int, int] = {}
        kept_logits: dict[Sequence, torch.Tensor] = {}
        failed: list[tuple[Sequence, Exception]] = []
        for (i, d), h in zip(drafts.items(), hidden):
            seq = batch.seqs[i]
            try:
                a, token, kept = self._verify_row(seq, i, d, h, logits, head)
            except Exception as e:
                failed.append((seq, e))
                a, token, kept = 0, None, None
            if token is not None:
                drawn[i] = token
            if kept is not None:
                kept_logits[seq] = kept
            if a < len(d):
                del seq.token_ids[a - len(d) :]
            batch.num_new[i] = 1 + a
            accepted[seq] = d[:a]
            # back off from text that does not repeat: after m verifications in a row that kept
            # nothing, skip the next 2**m - 1 lookups (at most MAX_BACKOFF); one kept resets it
            seq.spec_misses = 0 if a else seq.spec_misses + 1
            seq.spec_wait = min(MAX_BACKOFF, 2**seq.spec_misses - 1)
        return accepted, drawn, kept_logits, failed

    def _verify_row(
        self,
        seq: Sequence,
        i: int,
        d: list[int],
        h: torch.Tensor,
        logits: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[int, int | None, torch.Tensor | None]:
        """One drafted row (batch row ``i``, drafts ``d``, trunk states ``h``): (drafts kept,
        the step's token when verification draws it, the kept drafts' raw logits when the
        sequence wants logprobs). Changes nothing of the sequence; writes the row's logits
        after its run into ``logits[i]`` where :meth:`verify` says."""
        p = seq.params
        row_logits = head(h)  # [1 + k, V]: position j predicts the token after it
        judged = row_logits  # what the drafts are judged by: the logits sampling would see
        if p.adjusts_logits:  # penalties, bias, min_tokens: each position's own history
            base = len(seq.token_ids) - len(d)
            history = [seq.token_ids[: base + j] for j in range(len(d) + 1)]
            judged = adjust_logits(
                row_logits,
                [p] * len(history),
                history,
                [seq.num_prompt_tokens] * len(history),
                self.eos_token_ids,
            )
        guide = seq.guide
        if guide is not None:  # each position masked by the language after the drafts
            if judged is row_logits:
                judged = row_logits.clone()
            guide.judge_drafts(d, judged, force=self.forces(seq))
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned |= self.eos_token_ids
        token = None
        if p.temperature > 0.0:
            assert seq.generator is not None
            gen = seq.generator.generator()  # (the uniforms drawn ahead given back)
            a, token = accept_sampled(sampling_probs(judged, p), d, banned, gen)
        else:
            choice = judged.argmax(dim=-1).tolist()
            a = 0
            while a < len(d) and choice[a] == d[a] and d[a] not in banned:
                a += 1
            if guide is not None:  # the step's mask would be the one before the drafts
                token = choice[a]
        if p.temperature == 0.0 or seq.logprobs is not None:
            with torch.inference_mode():  # the runner's logits are inference tensors
                logits[i] = row_logits[a]  # raw: the step adjusts them as any row's
        return a, token, (row_logits[:a] if seq.logprobs is not None else None)

    def release_rejected(self, accepted: dict[Sequence, list[int]]) -> None:
        """After the scheduler recorded the step: free the slots reserved for rejected drafts."""
        for seq in accepted:
            self.kv.rollback_uncomputed(seq)
