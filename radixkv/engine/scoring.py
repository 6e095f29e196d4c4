"""Scoring items against a query with a generative model (SGLang's ``/v1/score``, vLLM's
generative scoring): for each item, the probability of each label token as the next token after
``query + item``. "Is this review positive?" scored as P(" Yes") over many reviews, or a
question scored against candidate passages, classes or answers.

Each item is one prompt, prefilled and sampled for one token with
``SamplingParams.logprob_token_ids`` set to the labels: the labels' log probabilities at the
first output position are the next-token distribution after the prompt. With the query first
(the default), every item's prompt starts with it, so the prefix cache computes the query once
and each item costs only its own tokens.

Text and token ids are both accepted, as in SGLang: text is concatenated (``query + item``, no
separator added) and then tokenized once as a whole; token ids are concatenated as lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from radixkv.engine.outputs import Logprob
from radixkv.engine.params import SamplingParams, is_int

__all__ = ["label_scores", "score_params", "score_prompts"]


def _is_ids(x: object) -> bool:
    return isinstance(x, list | tuple) and all(is_int(t) for t in x)


def score_prompts(query: Any, items: Any, *, item_first: bool = False) -> list[Any]:
    """The prompt of each item: ``query + item`` (``item + query`` with ``item_first``), as
    text when both are text, as token ids when both are token-id lists.

    ``items`` is a list of items, or one text item. Raises ValueError naming the field for an
    empty query or item list, and for a mix of text and token ids.
    """
    if not isinstance(item_first, bool):
        raise ValueError(f"item_first must be a bool, got {item_first!r}")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list | tuple) or not items:
        raise ValueError("items must be a non-empty list of texts or of token-id lists")
    if isinstance(query, str):
        if not all(isinstance(it, str) for it in items):
            raise ValueError("items must be texts when the query is text")
        return [it + query if item_first else query + it for it in items]
    if not _is_ids(query):
        raise ValueError("query must be a text or a list of token ids")
    bad = next((i for i, it in enumerate(items) if not _is_ids(it)), None)
    if bad is not None:
        raise ValueError(f"items[{bad}] must be a list of token ids when the query is token ids")
    q = list(query)
    return [list(it) + q if item_first else q + list(it) for it in items]


def score_params(label_token_ids: Sequence[int]) -> SamplingParams:
    """One greedy token with the labels' log probabilities (validated by SamplingParams; the
    vocabulary bound is checked when a request is submitted)."""
    if not isinstance(label_token_ids, list | tuple) or not label_token_ids:
        raise ValueError("label_token_ids must be a non-empty list of token ids")
    if len(set(label_token_ids)) != len(label_token_ids):
        raise ValueError(f"label_token_ids has repeated ids: {list(label_token_ids)}")
    try:
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=0, logprob_token_ids=tuple(label_token_ids)
        )
    except ValueError as e:
        raise ValueError(str(e).replace("logprob_token_ids", "label_token_ids")) from None


def label_scores(
    entry: dict[int, Logprob], label_token_ids: Sequence[int], apply_softmax: bool
) -> list[float]:
    """The labels' scores from the first output position's logprobs entry: each label's
    probability under the whole vocabulary, or with ``apply_softmax`` renormalised over the
    labels alone (they then sum to 1)."""
    lps = [entry[t].logprob for t in label_token_ids]
    if not apply_softmax:
        return [math.exp(v) for v in lps]
    top = max(lps)
    if top == -math.inf:  # every label impossible: no distribution over them to give
        return [1.0 / len(lps)] * len(lps)
    w = [math.exp(v - top) for v in lps]
    total = sum(w)
    return [x / total for x in w]
