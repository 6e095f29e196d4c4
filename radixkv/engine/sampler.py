"""Batched next-token sampling: greedy, temperature, min-p, top-k and top-p, with per-sequence
seeds.

The whole batch is filtered and normalised in a few tensor ops; only the uniform draw is per
sequence (one ``torch.rand`` from each sequence's own ``torch.Generator``), so a seeded request
samples the same tokens whatever else is in its batch (up to float ties at a CDF boundary).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from radixkv.engine.params import SamplingParams


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax of ``x [B, V]`` (the first of equal maxima; a NaN counts as the
    largest, the first NaN wins), as ``x.argmax(dim=-1).tolist()`` gives. On a CPU by NumPy's
    argmax, which is vectorised (about 10x faster than torch's there) and agrees with torch's on
    ties, NaN and infinities (tests/test_sampler.py compares them)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.detach().numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return x.argmax(dim=-1).tolist()  # type: ignore[no-any-return]


def _rows(values: list[float] | list[int], dtype: type, device: torch.device) -> torch.Tensor:
    """A tensor of one value per row, ``torch.tensor(values, dtype=...)``'s values (a double
    rounds to float32 the same way) by NumPy, which converts a list of Python numbers several
    times faster (for 256 rows: 5 us against 15, and 32 for integers)."""
    with np.errstate(over="ignore"):  # a double past float32's range is inf, as in torch
        t = torch.from_numpy(np.array(values, dtype=dtype))
    return t if device.type == "cpu" else t.to(device)


def _largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest values of each row of ``x [S, V]``, descending, and their columns
    (any order among equal values). On a CPU by NumPy's partition then a sort of the ``k``
    (``torch.topk`` costs about twice as much there)."""
    if x.device.type != "cpu":
        return x.topk(k, dim=-1)
    xn = x.numpy()
    s, v = xn.shape
    part = np.argpartition(xn, v - k, axis=-1)[:, -k:]  # the k largest, unordered
    # gathers by flat index (``take``): take_along_axis builds fancy indices, twice the cost
    rows = np.arange(s)[:, None]
    part_vals = xn.take(part + rows * v)
    rank = np.argsort(-part_vals, axis=-1, kind="stable")
    flat = rank + rows * k
    return torch.from_numpy(part_vals.take(flat)), torch.from_numpy(part.take(flat))


def _top_sorted(
    x: torch.Tensor, sp: Sequence[SamplingParams], vocab: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first ``k_max`` columns of ``x [S, V]`` sorted descending and their order, where
    every row has a top-k (``k_max`` its largest): the ``k_max + 1`` largest values
    (``topk``, far cheaper than sorting a large vocabulary) are all distinct, so their order is
    the sort's, and every later column is one top-k masks. A row whose values tie there (or
    are -inf, NaN) takes the first ``k_max`` columns of its own sort (a row's sort does not
    depend on the other rows: tests/test_sampler_fast_paths.py), so one such row does not
    cost the whole batch a sort. None when some row has no top-k (then sort)."""
    ks = [p.top_k for p in sp]
    k_max = max(ks)
    if min(ks) <= 0 or k_max + 1 >= vocab:
        return None
    vals, idx = _largest(x, k_max + 1)
    distinct = (vals[:, :-1] > vals[:, 1:]).all(dim=1)  # [S]
    if not bool(distinct.all()):  # a tie (or -inf, NaN): the sort decides those rows
        ties = (~distinct).nonzero().squeeze(1)
        tv, ti = x.index_select(0, ties).sort(dim=-1, descending=True)
        vals[ties, :k_max] = tv[:, :k_max]
        idx[ties, :k_max] = ti[:, :k_max]
    return vals[:, :k_max], idx[:, :k_max]


def _filtered(
    logits: torch.Tensor, sp: Sequence[SamplingParams], *, full_order: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, min-p, top-k and top-p over ``logits [S, V]`` (all rows sampled, none
    greedy): probabilities ``[S, V]``, unnormalised once top-p has masked some, in vocabulary
    order, or with ``order [S, V]`` (the token at each column) when they had to be sorted.
    ``full_order=False``: when every row has a top-k, only the first ``k_max`` sorted columns
    (the largest top-k; every later one has probability 0) of both are returned, which lets
    such rows skip the full sort (the same probabilities, to the bit: :func:`_top_sorted`;
    the softmax still spans the vocabulary, so its normaliser is the one the sort gives)."""
    dev = logits.device
    temps = _rows([p.temperature for p in sp], np.float32, dev)
    x = logits.float() / temps[:, None]  # [S, V]
    vocab = x.shape[1]
    if any(p.min_p > 0.0 for p in sp):
        # p >= min_p * p_max  <=>  logit >= max logit + log(min_p) (softmax shares one normaliser)
        floor = _rows(
            [math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in sp], np.float32, dev
        )
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + floor[:, None], float("-inf"))
    need_sort = any(p.top_p < 1.0 or 0 < p.top_k < vocab for p in sp)
    order: torch.Tensor | None = None
    if need_sort:
        top = None if full_order else _top_sorted(x, sp, vocab)
        ks = _rows([p.top_k if 0 < p.top_k < vocab else vocab for p in sp], np.int64, dev)
        if top is None:
            x, order = x.sort(dim=-1, descending=True)  # [S, V] each
            ranks = torch.arange(vocab, device=dev)[None, :]  # [1, V]
            x = x.masked_fill(ranks >= ks[:, None], float("-inf"))
            probs = torch.softmax(x, dim=-1)  # [S, V]
        else:
            head, order = top  # [S, k_max] each
            k_max = head.shape[1]
            ranks = torch.arange(k_max, device=dev)[None, :]
            full = torch.full_like(x, float("-inf"))
            full[:, :k_max] = head.masked_fill(ranks >= ks[:, None], float("-inf"))
            # the softmax over all V columns (the -inf ones add exact zeros): the normaliser
            # of the sorted path, bit for bit; only the head is read after it
            probs = torch.softmax(full, dim=-1)[:, :k_max]
        top_ps = _rows([p.top_p for p in sp], np.float32, dev)
        # drop a token when the mass strictly before it already reaches top_p (rank 0 always
        # kept); a prefix's cumulative sum does not depend on the columns after it
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_ps[:, None], 0.0)
    else:
        probs = torch.softmax(x, dim=-1)  # [S, V]
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


class UniformStream:
    """One sequence's sampling generator, its uniforms drawn ``BLOCK`` at a time.

    ``sample`` takes one uniform per step from each sampled row; a ``torch.rand`` call per
    row costs more than the rest of a batch's sampling. The CPU generator draws a block of
    float32 uniforms as that many single draws in a row (``torch.rand(n)`` is serial:
    tests/test_sampler_fast_paths.py compares them), so :meth:`next` returns exactly the
    value ``torch.rand(1, generator=g)`` would. Whoever uses the generator otherwise
    (speculative verification's multinomial) asks :meth:`generator`, which first gives back
    the uniforms drawn ahead: the generator is then where single draws would have left it.
    """

    BLOCK = 32

    __slots__ = ("_ahead", "_gen", "_mark")

    def __init__(self, generator: torch.Generator) -> None:
        self._gen = generator
        self._ahead: list[float] = []  # drawn, not yet used: next last
        self._mark: torch.Tensor | None = None  # the generator's state before them

    def next(self) -> float:
        """The next uniform in [0, 1) (a float32 value)."""
        ahead = self._ahead
        if not ahead:
            self._mark = self._gen.get_state()
            ahead += torch.rand(self.BLOCK, generator=self._gen).tolist()[::-1]
        return ahead.pop()

    def generator(self) -> torch.Generator:
        """The generator, positioned after the uniforms :meth:`next` returned so far."""
        if self._ahead:
            used = self.BLOCK - len(self._ahead)
            assert self._mark is not None
            self._gen.set_state(self._mark)
            if used:
                torch.rand(used, generator=self._gen)
            self._ahead.clear()
        return self._gen


def _draw(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator).item())


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | UniformStream | None],
) -> list[int]:
    """Pick one token per row.

    Args:
        logits: [B, V] float logits of each sequence's last position (not modified).
        params: B sampling params; rows with ``temperature == 0`` take the argmax.
        generators: B generators (or their :class:`UniformStream`, the same draws); a sampled
            row's must not be None (greedy rows may).

    Returns:
        B token ids.
    """
    b = logits.shape[0]
    if b != len(params) or b != len(generators):
        raise ValueError(f"sample: {b} logit rows but {len(params)} params, {len(generators)} gens")
    if b == 0:
        return []
    rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not rows:
        return argmax_rows(logits)
    dev = logits.device
    every = len(rows) == b  # no greedy row: no argmax, no row selection
    idx = None if every else torch.tensor(rows, device=dev)
    sp = params if every else [params[i] for i in rows]
    picked = logits if idx is None else logits.index_select(0, idx)
    probs, order = _filtered(picked, sp, full_order=False)  # [S, V] each
    vocab = probs.shape[1]  # (the head of the sorted vocabulary when top-k kept only that)
    cdf = probs.cumsum(dim=-1)  # [S, V], unnormalised after top-p masking
    gens = generators if every else [generators[i] for i in rows]
    if any(g is None for g in gens):
        raise ValueError("sample: a sampled (temperature > 0) row has no generator")
    # [S] in [0, 1), float32: one uniform per row from its own generator
    draws = [g.next() if type(g) is UniformStream else _draw(g) for g in gens]  # type: ignore[union-attr, arg-type]
    u = _rows(draws, np.float32, dev)
    u = u * cdf[:, -1]
    # how many cdf entries are <= u (the cdf does not decrease): a binary search per row
    pos = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)
    # a zero-probability slot can only be picked through float round-off: step back to the last
    # kept one so masked tokens are never returned
    picked_p = probs.gather(1, pos[:, None]).squeeze(1)
    if bool((picked_p <= 0).any()):
        last_kept = (probs > 0).long().cumsum(-1).argmax(-1)  # index of last non-zero
        pos = torch.where(picked_p > 0, pos, torch.minimum(pos, last_kept))
    tok = order.gather(1, pos[:, None]).squeeze(1) if order is not None else pos
    if idx is None:
        return tok.tolist()
    out = argmax_rows(logits)  # the greedy rows'
    for i, t in zip(rows, tok.tolist()):
        out[i] = t
    return out
