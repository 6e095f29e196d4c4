"""Sampling rows that all have a top-k skips the full sort of the vocabulary (sampler.py:
``_top_sorted``): the same tokens, probabilities and draws as the sort gives, ties included."""

from __future__ import annotations

import pytest
import torch

import radixkv.engine.sampler as sampler
from radixkv.engine.params import SamplingParams
from radixkv.engine.sampler import make_generator, sample, sampling_probs


def _logits(kind: str, rows: int, vocab: int) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3
    if kind == "ties":  # equal logits inside the kept tokens: the sort must decide
        x[:, 3 : vocab // 2 : 7] = 9.5  # above the rest: ties among the top tokens
    if kind == "min_p":  # -inf ties after the min-p cut
        x[:, 10:] -= 40.0
    return x


@pytest.mark.parametrize("kind", ["plain", "ties", "min_p"])
@pytest.mark.parametrize("vocab", [50, 3000])
def test_top_k_rows_sample_as_with_the_full_sort(
    kind: str, vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = 24
    x = _logits(kind, rows, vocab)
    params = [
        SamplingParams(
            temperature=0.7, top_k=(5, 20, 1)[i % 3], top_p=(1.0, 0.8)[i % 2],
            min_p=0.05 if kind == "min_p" else 0.0, seed=i,
        )
        for i in range(rows)
    ]  # fmt: skip
    params[3] = SamplingParams(temperature=0.0)  # a greedy row among them
    for _ in range(3):  # several draws of each seeded row
        gens = [make_generator(1000 * _ + i) for i in range(rows)]
        fast = sample(x, params, gens)
        with monkeypatch.context() as m:
            m.setattr(sampler, "_top_sorted", lambda *a: None)  # always sort
            gens = [make_generator(1000 * _ + i) for i in range(rows)]
            assert sample(x, params, gens) == fast
    sampled = [p for p in params if p.temperature > 0]
    ref, ref_order = sampler._filtered(x[: len(sampled)], sampled)
    got, order = sampler._filtered(x[: len(sampled)], sampled, full_order=False)
    k = got.shape[1]  # the head the top-k path keeps (the whole vocabulary when it sorted)
    assert torch.equal(ref[:, :k], got) and not bool(ref[:, k:].any())
    if kind == "plain":  # no ties: the top-k path ran, and kept only the largest top-k's
        assert k == 20 and order is not None and ref_order is not None
        assert torch.equal(order, ref_order[:, :k])


def test_sampling_probs_keeps_the_full_order() -> None:
    """Speculative decoding scatters by the order: it stays a permutation of the vocabulary."""
    x = _logits("plain", 4, 300)
    p = SamplingParams(temperature=1.0, top_k=10)
    probs = sampling_probs(x, p)
    assert torch.allclose(probs.sum(-1), torch.ones(4))
    assert int((probs > 0).sum(-1).max()) == 10
    assert torch.equal(probs.argmax(-1), x.argmax(-1))


@pytest.mark.parametrize("u", [0.0, 0.5, 1 - 2**-24])
def test_top_k_head_draw_at_the_cdf_ends(u: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A uniform at either end (round-off can put ``u * total`` on the total): the head-only
    draw picks what the full sort picks, and never a token top-k or top-p dropped."""
    x = _logits("plain", 12, 400)
    params = [
        SamplingParams(temperature=0.8, top_k=(1, 5, 40)[i % 3], top_p=(1.0, 0.5)[i % 2], seed=i)
        for i in range(12)
    ]
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **k: torch.full((1,), u))
    gens = [make_generator(i) for i in range(12)]
    fast = sample(x, params, gens)
    with monkeypatch.context() as m:
        m.setattr(sampler, "_top_sorted", lambda *a: None)  # always sort
        assert sample(x, params, gens) == fast
    for row, (p, tok) in enumerate(zip(params, fast)):
        probs = sampling_probs(x[row : row + 1], p)[0]
        assert float(probs[tok]) > 0.0
