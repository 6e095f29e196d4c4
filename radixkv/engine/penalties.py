"""Repetition, frequency and presence penalties on a batch of next-token logits.

The three knobs of vLLM and SGLang (and OpenAI's two), with vLLM's semantics:

* ``repetition_penalty`` r (the CTRL paper's, as Hugging Face's ``RepetitionPenaltyLogitsProcessor``
  applies it): every token that occurs in the prompt or the output so far has its logit divided
  by r where positive and multiplied by r where negative; r > 1 discourages repeats, 1 is off.
* ``frequency_penalty`` f: ``f * count`` is subtracted from each token's logit, ``count`` being
  how often it occurs in the output so far (not the prompt), as in OpenAI's API.
* ``presence_penalty`` p: ``p`` is subtracted from the logit of every token that occurs in the
  output so far at least once.

The repetition penalty is applied first, then the other two. They act on the raw logits, before
temperature and the top-k/top-p/min-p filters, so they change greedy decoding too; the log
probabilities a request asks for stay the model's own (before penalties, as vLLM's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.params import SamplingParams


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_ids: Sequence[Sequence[int]],
    num_prompt_tokens: Sequence[int],
) -> torch.Tensor:
    """``logits`` [B, V] with each row's penalties applied (a new fp32 tensor; rows without
    penalties are returned unchanged). ``token_ids[i]`` is row i's prompt followed by its
    output so far, of which the first ``num_prompt_tokens[i]`` are the prompt."""
    b, vocab = logits.shape
    if not (b == len(params) == len(token_ids) == len(num_prompt_tokens)):
        raise ValueError(
            f"apply_penalties: {b} logit rows but {len(params)} params, {len(token_ids)} "
            f"token lists, {len(num_prompt_tokens)} prompt lengths"
        )
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    out = logits.float().clone()
    if not rows:
        return out
    dev = logits.device
    # occurrences of each token per penalised row: [S, V], in the output only and anywhere
    out_rows: list[int] = []
    out_toks: list[int] = []
    all_rows: list[int] = []
    all_toks: list[int] = []
    for r, i in enumerate(rows):
        ids = token_ids[i]
        k = num_prompt_tokens[i]
        if params[i].repetition_penalty != 1.0:
            all_toks.extend(ids)
            all_rows.extend([r] * len(ids))
        out_toks.extend(ids[k:])
        out_rows.extend([r] * (len(ids) - k))
    x = out.index_select(0, torch.tensor(rows, device=dev))  # [S, V]
    sp = [params[i] for i in rows]
    if all_toks:
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
        seen[torch.tensor(all_rows, device=dev), torch.tensor(all_toks, device=dev)] = True
        rp = torch.tensor([p.repetition_penalty for p in sp], device=dev)[:, None]  # [S, 1]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if out_toks and any(p.frequency_penalty or p.presence_penalty for p in sp):
        counts = torch.zeros(len(rows), vocab, device=dev)
        counts.index_put_(
            (torch.tensor(out_rows, device=dev), torch.tensor(out_toks, device=dev)),
            torch.ones(len(out_toks), device=dev),
            accumulate=True,
        )
        freq = torch.tensor([p.frequency_penalty for p in sp], device=dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in sp], device=dev)[:, None]
        x = x - freq * counts - pres * (counts > 0)
    out[torch.tensor(rows, device=dev)] = x
    return out
