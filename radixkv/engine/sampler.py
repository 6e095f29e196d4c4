"""Batched next-token sampling: greedy, temperature, min-p, top-k and top-p, with per-sequence
seeds.

The whole batch is filtered and normalised in a few tensor ops; only the uniform draw is per
sequence (one ``torch.rand`` from each sequence's own ``torch.Generator``), so a seeded request
samples the same tokens whatever else is in its batch (up to float ties at a CDF boundary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from radixkv.engine.params import SamplingParams


def _filtered(
    logits: torch.Tensor, sp: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, min-p, top-k and top-p over ``logits [S, V]`` (all rows sampled, none
    greedy): probabilities ``[S, V]``, unnormalised once top-p has masked some, in vocabulary
    order, or with ``order [S, V]`` (the token at each column) when they had to be sorted."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)
    x = logits.float() / temps[:, None]  # [S, V]
    vocab = x.shape[1]
    if any(p.min_p > 0.0 for p in sp):
        # p >= min_p * p_max  <=>  logit >= max logit + log(min_p) (softmax shares one normaliser)
        floor = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in sp],
            dtype=torch.float32,
            device=dev,
        )
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor[:, None], float("-inf"))
    need_sort = any(p.top_p < 1.0 or 0 < p.top_k < vocab for p in sp)
    order: torch.Tensor | None = None
    if need_sort:
        x, order = x.sort(dim=-1, descending=True)  # [S, V] each
        ks = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in sp], device=dev
        )  # [S]
        ranks = torch.arange(vocab, device=dev)[None, :]  # [1, V]
        x = x.masked_fill(ranks >= ks[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [S, V]
    if need_sort:
        top_ps = torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=dev)
        # drop a token when the mass strictly before it already reaches top_p (rank 0 always kept)
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_ps[:, None], 0.0)
    return probs, order


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution ``sample`` draws from for ``params`` (temperature > 0), for each row of
    ``logits [R, V]``: normalised probabilities ``[R, V]`` in vocabulary order (speculative
    decoding verifies drafts against it)."""
    probs, order = _filtered(logits, [params] * logits.shape[0])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    if order is None:
        return probs
    return torch.zeros_like(probs).scatter_(1, order, probs)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one sequence (uniforms are drawn on the CPU, then moved)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [B, V] float logits of each sequence's last position (not modified).
        params: B sampling params; rows with ``temperature == 0`` take the argmax.
        generators: B generators; a sampled row's generator must not be None (greedy rows may).

    Returns:
        B token ids.
    """
    b = logits.shape[0]
    if b != len(params) or b != len(generators):
        raise ValueError(f"sample: {b} logit rows but {len(params)} params, {len(generators)} gens")
    if b == 0:
        return []
    out = logits.argmax(dim=-1)  # [B]
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return out.tolist()
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    sp = [params[i] for i in rows]
    probs, order = _filtered(logits.index_select(0, idx), sp)  # [S, V] each
    vocab = probs.shape[1]
    cdf = probs.cumsum(dim=-1)  # [S, V], unnormalised after top-p masking
    gens = [generators[i] for i in rows]
    if any(g is None for g in gens):
        raise ValueError("sample: a sampled (temperature > 0) row has no generator")
    u = torch.cat([torch.rand(1, generator=g) for g in gens]).to(dev)  # [S] in [0, 1)
    u = u * cdf[:, -1]
    pos = (cdf <= u[:, None]).sum(dim=-1).clamp_(max=vocab - 1)  # [S]
    # a zero-probability slot can only be picked through float round-off: step back to the last
    # kept one so masked tokens are never returned
    picked_p = probs.gather(1, pos[:, None]).squeeze(1)
    if bool((picked_p <= 0).any()):
        last_kept = (probs > 0).long().cumsum(-1).argmax(-1)  # index of last non-zero
        pos = torch.where(picked_p > 0, pos, torch.minimum(pos, last_kept))
    tok = order.gather(1, pos[:, None]).squeeze(1) if order is not None else pos
    out[idx] = tok
    return out.tolist()
