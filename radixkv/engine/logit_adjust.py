"""What a request asks to change in its next-token logits before a token is chosen: logit
bias, a minimum output length, and the repetition, frequency and presence penalties.

The knobs of vLLM and SGLang (OpenAI's ``logit_bias`` and two penalties among them), applied as
vLLM applies them, in this order:

1. ``logit_bias``: a fixed number added to the logit of each listed token (OpenAI's range
   [-100, 100]: -100 practically bans a token, 100 practically forces it).
2. ``min_tokens``: until the output holds that many tokens, the tokens that would end it (the
   model's EOS tokens, unless ``ignore_eos``, and ``stop_token_ids``) get a logit of -inf.
   (A stop *string* may still match: it is text, found after the token is chosen.)
3. ``repetition_penalty`` r (the CTRL paper's, as Hugging Face's
   ``RepetitionPenaltyLogitsProcessor`` applies it): every token that occurs in the prompt or
   the output so far has its logit divided by r where positive and multiplied by r where
   negative; r > 1 discourages repeats, 1 is off.
4. ``frequency_penalty`` f and ``presence_penalty`` p: ``f * count + p * (count > 0)`` is
   subtracted from each token's logit, ``count`` being how often it occurs in the output so far
   (not the prompt), as in OpenAI's API.

All of it acts on the raw logits, before temperature and the top-k/top-p/min-p filters, so it
changes greedy decoding too; the log probabilities a request asks for stay the model's own
(before any of this, as vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from radixkv.engine.params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """``logits`` [B, V] with each row's adjustments applied (a new fp32 tensor; rows without
    any are returned unchanged). ``token_ids[i]`` is row i's prompt followed by its output so
    far, of which the first ``num_prompt_tokens[i]`` are the prompt. ``eos_token_ids``: the
    tokens ``min_tokens`` holds back (with each row's ``stop_token_ids``). Token ids outside
    the vocabulary in ``logit_bias`` or ``stop_token_ids`` are ignored (the server refuses them
    earlier)."""
    b = logits.shape[0]
    if not (b == len(params) == len(token_ids) == len(num_prompt_tokens)):
        raise ValueError(
            f"adjust_logits: {b} logit rows but {len(params)} params, {len(token_ids)} "
            f"token lists, {len(num_prompt_tokens)} prompt lengths"
        )
    out = logits.float().clone()
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return out
    dev = logits.device
    sel = torch.tensor(rows, device=dev)
    x = out.index_select(0, sel)  # [S, V]
    sp = [params[i] for i in rows]
    _bias_and_min_tokens(x, sp, rows, token_ids, num_prompt_tokens, eos_token_ids)
    x = _penalties(x, sp, rows, token_ids, num_prompt_tokens)
    out[sel] = x
    return out


def _bias_and_min_tokens(
    x: torch.Tensor,
    sp: list[SamplingParams],
    rows: list[int],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
    eos_token_ids: Collection[int],
) -> None:
    """Steps 1 and 2, in place on ``x`` [S, V]."""
    vocab = x.shape[1]
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    ban_r: list[int] = []
    ban_t: list[int] = []
    for r, (p, i) in enumerate(zip(sp, rows, strict=True)):
        for t, v in p.logit_bias:
            if t < vocab:
                bias_r.append(r)
                bias_t.append(t)
                bias_v.append(v)
        if p.min_tokens and len(token_ids[i]) - num_prompt_tokens[i] < p.min_tokens:
            enders = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ends = [t for t in enders if t < vocab]
            ban_r.extend([r] * len(ends))
            ban_t.extend(ends)
    dev = x.device
    if bias_r:
        idx = (torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev))
        x.index_put_(idx, torch.tensor(bias_v, device=dev), accumulate=True)
    if ban_r:
        x[torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev)] = float("-inf")


def _penalties(
    x: torch.Tensor,
    sp: list[SamplingParams],
    rows: list[int],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """Steps 3 and 4 on ``x`` [S, V] (a new tensor when any applies)."""
    if not any(p.has_penalties for p in sp):
        return x
    out_r: list[int] = []
    out_t: list[int] = []
    all_r: list[int] = []
    all_t: list[int] = []
    for r, (p, i) in enumerate(zip(sp, rows, strict=True)):
        ids = token_ids[i]
        k = num_prompt_tokens[i]
        if p.repetition_penalty != 1.0:
            all_t.extend(ids)
            all_r.extend([r] * len(ids))
        if p.frequency_penalty or p.presence_penalty:
            out_t.extend(ids[k:])
            out_r.extend([r] * (len(ids) - k))
    dev = x.device
    n, vocab = x.shape
    if all_t:
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(all_r, device=dev), torch.tensor(all_t, device=dev)] = True
        rp = torch.tensor([p.repetition_penalty for p in sp], device=dev)[:, None]  # [S, 1]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if out_t:
        counts = torch.zeros(n, vocab, device=dev)
        counts.index_put_(
            (torch.tensor(out_r, device=dev), torch.tensor(out_t, device=dev)),
            torch.ones(len(out_t), device=dev),
            accumulate=True,
        )
        freq = torch.tensor([p.frequency_penalty for p in sp], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in sp], device=dev)[:, None]
        x = x - freq * counts - pres * (counts > 0)
    return x
