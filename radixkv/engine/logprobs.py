"""Log probabilities of sampled tokens (``SamplingParams.logprobs``), computed from one step's
logits.

Only the rows of sequences that asked for them are touched, so a batch without such a sequence
pays nothing (the engine does not call in). The values are ``log_softmax`` of the raw logits:
the model's distribution, before temperature and filtering (vLLM's default, ``raw_logprobs``).
Token strings are decoded one id at a time and memoised, since the same ids recur.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.outputs import Logprob
from radixkv.model.tokenizer import Tokenizer


class TokenTexts:
    """``decode([id])`` per token id (special tokens kept), memoised."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text


def step_logprobs(
    logits: torch.Tensor,
    tokens: Sequence[int],
    num_top: Sequence[int],
    token_text: TokenTexts,
) -> list[dict[int, Logprob]]:
    """Per row: {sampled token: Logprob, then the ``num_top[i]`` most likely tokens}.

    Args:
        logits: [S, V] logits of the rows that asked for logprobs (any float dtype).
        tokens: S sampled token ids.
        num_top: S counts of alternatives (0: the sampled token only).
        token_text: decodes one token id.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [S, V]
    chosen_ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, chosen_ids[:, None]).squeeze(1)  # [S]
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # [S]
    k = min(max(num_top, default=0), lp.shape[1])
    top_v: list[list[float]] = [[] for _ in tokens]
    top_i: list[list[int]] = [[] for _ in tokens]
    if k > 0:
        v, i = lp.topk(k, dim=-1)  # [S, k] each, sorted descending
        top_v, top_i = v.tolist(), i.tolist()
    out: list[dict[int, Logprob]] = []
    for row, (tok, c, r) in enumerate(zip(tokens, chosen.tolist(), ranks.tolist())):
        entry = {tok: Logprob(c, r, token_text(tok))}
        for j in range(min(num_top[row], k)):
            alt = top_i[row][j]
            if alt not in entry:
                entry[alt] = Logprob(top_v[row][j], j + 1, token_text(alt))
        out.append(entry)
    return out
