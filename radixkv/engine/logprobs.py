"""Log probabilities of sampled tokens (``SamplingParams.logprobs``), computed from one step's
logits, and of prompt tokens (``SamplingParams.prompt_logprobs``), computed from the hidden states
of a prefill chunk a block of rows at a time.

Only the rows of sequences that asked for them are touched, so a batch without such a sequence
pays nothing (the engine does not call in). The values are ``log_softmax`` of the raw logits:
the model's distribution, before temperature and filtering (vLLM's default, ``raw_logprobs``).
Token strings are decoded one id at a time and memoised, since the same ids recur.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    extra: Sequence[Sequence[int]] = (),
) -> list[dict[int, Logprob]]:
    """Per row: {sampled token: Logprob, then the ``num_top[i]`` most likely tokens, then the
    ids of ``extra[i]`` not already there}.

    Args:
        logits: [S, V] logits of the rows that asked for logprobs (any float dtype).
        tokens: S sampled token ids.
        num_top: S counts of alternatives (0: the sampled token only).
        token_text: decodes one token id.
        extra: S tuples of requested ids (``SamplingParams.logprob_token_ids``), or empty
            when no row asks for any.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    return logprob_entries(lp, tokens, num_top, token_text, extra)


def logprob_entries(
    lp: torch.Tensor,
    tokens: Sequence[int],
    num_top: Sequence[int],
    token_text: Callable[[int], str],
    extra: Sequence[Sequence[int]] = (),
) -> list[dict[int, Logprob]]:
    """``step_logprobs`` from rows that are log probabilities already (``lp`` ``[S, V]`` fp32,
    ``log_softmax`` of each row's logits): beam search has them, and a second ``log_softmax``
    would move the values by rounding."""
    chosen_ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, chosen_ids[:, None]).squeeze(1)  # [S]
    ranks = (lp > chosen[:, None]).sum(dim=-1) + 1  # [S]
    asked = _asked(lp, extra)
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
        if asked:
            for t, (v, r) in zip(extra[row], asked[row]):
                if t not in entry:
                    entry[t] = Logprob(v, r, token_text(t))
        out.append(entry)
    return out


def _asked(lp: torch.Tensor, extra: Sequence[Sequence[int]]) -> list[list[tuple[float, int]]]:
    """Per row, (logprob, rank) of each id ``extra[row]`` asks for; [] when none asks."""
    n = max((len(e) for e in extra), default=0)
    if not n:
        return []
    # [S, n] ids, rows with fewer padded with their first (or 0) and cut off again below
    ids = torch.tensor(
        [list(e) + [e[0] if e else 0] * (n - len(e)) for e in extra],
        dtype=torch.long,
        device=lp.device,
    )
    vals = lp.gather(1, ids)  # [S, n]
    ranks = (lp[:, None, :] > vals[:, :, None]).sum(dim=-1) + 1  # [S, n]
    return [
        list(zip(v[: len(e)], r[: len(e)])) for e, v, r in zip(extra, vals.tolist(), ranks.tolist())
    ]


# Rows of [rows, vocab] fp32 logits a block of prompt logprobs holds at once (with its log_softmax
# as much again): 2**24 values are 64 MB, so a 2,048-token chunk on a 152k vocabulary never
# materialises its 1.2 GB of logits.
PROMPT_BLOCK_VALUES = 2**24


def prompt_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: Sequence[int],
    num_top: int,
    token_text: TokenTexts,
    vocab_size: int,
    extra: Sequence[int] = (),
) -> list[dict[int, Logprob]]:
    """Per row of ``hidden``: {the next prompt token: Logprob, then the ``num_top`` most likely,
    then the ids of ``extra`` not already there}.

    Args:
        hidden: [R, hidden] trunk states of R consecutive prompt positions.
        head: hidden states -> fp32 logits [rows, vocab] (``ModelRunner.logits``).
        targets: R token ids, the prompt token after each position.
        num_top: alternatives per position (0: the prompt token only).
        token_text: decodes one token id.
        vocab_size: V, which sizes the blocks.
    """
    block = max(1, PROMPT_BLOCK_VALUES // vocab_size)
    out: list[dict[int, Logprob]] = []
    for a in range(0, len(targets), block):
        rows = targets[a : a + block]
        asked = [extra] * len(rows) if extra else ()
        out += step_logprobs(
            head(hidden[a : a + block]), rows, [num_top] * len(rows), token_text, asked
        )
    return out
