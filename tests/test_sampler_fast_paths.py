"""The sampler's shortcuts against the paths they replace: NumPy's argmax for torch's
(``argmax_rows``), randomized over shapes, ties, NaN and infinities; uniforms drawn ahead in
blocks (``UniformStream``) for one ``torch.rand`` per row and step; rows whose top-k values tie
sorted alone instead of the whole batch."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import radixkv.engine.sampler as sampler
from radixkv.engine.params import SamplingParams
from radixkv.engine.sampler import UniformStream, argmax_rows, make_generator, sample


def test_argmax_rows_is_torchs_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        b = int(torch.randint(1, 20, (1,), generator=g))
        v = int(torch.randint(1, 200, (1,), generator=g))
        x = torch.randint(-3, 4, (b, v), generator=g).float()  # many ties
        r = torch.rand(b, v, generator=g)
        x[r < 0.05] = float("nan")
        x[(r > 0.05) & (r < 0.1)] = float("inf")
        x[(r > 0.1) & (r < 0.2)] = float("-inf")
        if trial % 3 == 0:
            x = torch.randn(b, v, generator=g)
        if trial % 7 == 0:
            x[:] = float("-inf")
        if trial % 5 == 0:
            x = x.double()
        if trial % 11 == 0 and v > 1:
            x = x[:, ::2]  # a strided view
        assert argmax_rows(x) == x.argmax(dim=-1).tolist(), trial
    half = torch.randn(3, 9).half()  # not NumPy's: torch's own argmax
    assert argmax_rows(half) == half.argmax(dim=-1).tolist()


# ---------------------------------------------------------------- uniforms drawn ahead
def test_uniform_stream_draws_as_single_draws() -> None:
    """``torch.rand(n)`` on a CPU generator is n single draws in a row, so a stream's uniforms
    are the single draws', block after block."""
    for seed in range(40):
        ref = make_generator(seed * 7919 + 3)
        stream = UniformStream(make_generator(seed * 7919 + 3))
        want = [torch.rand(1, generator=ref).item() for _ in range(3 * UniformStream.BLOCK + 5)]
        assert [stream.next() for _ in want] == want


def test_uniform_stream_gives_back_its_draws_ahead() -> None:
    """A direct use of the generator (speculative verification's multinomial and rand) sees
    it where single draws would have left it, and the stream goes on from there."""
    rng = random.Random(0)
    for seed in range(30):
        ref = make_generator(seed)
        stream = UniformStream(make_generator(seed))
        for _ in range(12):
            for _ in range(rng.randrange(0, 2 * UniformStream.BLOCK)):
                assert stream.next() == torch.rand(1, generator=ref).item()
            q = torch.rand(7, generator=torch.Generator().manual_seed(seed)) + 0.1
            g = stream.generator()
            assert int(torch.multinomial(q, 1, generator=g)) == int(
                torch.multinomial(q, 1, generator=ref)
            )
            assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref))


def test_sample_with_streams_draws_as_with_generators() -> None:
    """Seeded rows, many steps, every kind of params, greedy rows among them: the streams'
    tokens are the plain generators' (the draw per row per step as before)."""
    rows, vocab, steps = 48, 300, 40
    params = [
        SamplingParams(
            temperature=(0.0, 0.7, 1.0, 1.3)[i % 4], top_k=(0, 5, 40)[i % 3],
            top_p=(1.0, 0.9, 0.5)[i % 5 % 3], min_p=(0.0, 0.05)[i % 2], seed=i,
        )
        for i in range(rows)
    ]  # fmt: skip
    gens = [make_generator(i) if p.temperature > 0 else None for i, p in enumerate(params)]
    streams = [
        UniformStream(make_generator(i)) if p.temperature > 0 else None
        for i, p in enumerate(params)
    ]
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        logits = torch.randn(rows, vocab, generator=g) * 3
        part = list(range(step % 3, rows))  # rows come and go
        got = sample(logits[part], [params[i] for i in part], [streams[i] for i in part])
        want = sample(logits[part], [params[i] for i in part], [gens[i] for i in part])
        assert got == want, step


# ---------------------------------------------------------------- ties: only those rows sorted
def test_a_rows_sort_does_not_depend_on_the_other_rows() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        b = int(torch.randint(2, 30, (1,), generator=g))
        v = int(torch.randint(2, 300, (1,), generator=g))
        x = torch.randint(-4, 5, (b, v), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[torch.rand(b, v, generator=g) < 0.1] = float("-inf")
        if trial % 5 == 0:
            x[torch.rand(b, v, generator=g) < 0.05] = float("nan")
        rows = torch.randperm(b, generator=g)[: max(1, b // 3)].sort().values
        all_v, all_i = x.sort(dim=-1, descending=True)
        some_v, some_i = x.index_select(0, rows).sort(dim=-1, descending=True)
        assert torch.equal(all_i[rows], some_i), trial
        assert torch.equal(all_v[rows].nan_to_num(), some_v.nan_to_num()), trial


def test_rows_that_tie_sample_as_with_the_whole_batch_sorted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch where some rows tie among their top-k (or hold -inf, NaN-free) and the others
    do not: each row's token is the one the full sort of the whole batch gives."""
    g = torch.Generator().manual_seed(1)
    for trial in range(60):
        rows, vocab = 24, int(torch.randint(30, 400, (1,), generator=g))
        x = torch.randn(rows, vocab, generator=g) * 3
        tie = torch.rand(rows, generator=g) < 0.3
        x[tie, 2 : vocab // 2 : 5] = 9.0  # equal logits among the kept tokens of these rows
        if trial % 4 == 0:
            x[tie, 5:] = float("-inf")  # fewer finite logits than the top-k
        params = [
            SamplingParams(
                temperature=0.9, top_k=(3, 10, 25)[i % 3], top_p=(1.0, 0.8)[i % 2],
                min_p=0.02 if i % 5 == 0 else 0.0, seed=i,
            )
            for i in range(rows)
        ]  # fmt: skip
        for step in range(3):
            fast = sample(x, params, [make_generator(100 * step + i) for i in range(rows)])
            with monkeypatch.context() as m:
                m.setattr(sampler, "_top_sorted", lambda *a: None)  # always sort
                ref = sample(x, params, [make_generator(100 * step + i) for i in range(rows)])
            assert fast == ref, (trial, step)
        got, order = sampler._filtered(x, params, full_order=False)
        want, want_order = sampler._filtered(x, params)
        k = got.shape[1]
        assert k == 25 and order is not None and want_order is not None
        assert torch.equal(got, want[:, :k]) and not bool(want[:, k:].any())
        assert torch.equal(order, want_order[:, :k])


def test_largest_gives_each_rows_k_largest_in_order() -> None:
    """``_largest`` (a partition, then a sort of the k): topk's values, and columns holding
    them (any order among equal values), on strided input too."""
    g = torch.Generator().manual_seed(2)
    for trial in range(300):
        b = int(torch.randint(1, 20, (1,), generator=g))
        v = int(torch.randint(2, 300, (1,), generator=g))
        k = int(torch.randint(1, v + 1, (1,), generator=g))
        x = torch.randn(b, v, generator=g) * 3
        if trial % 2:
            x = torch.randint(-5, 6, (b, v), generator=g).float()  # ties
        if trial % 3 == 0:
            x[torch.rand(b, v, generator=g) < 0.1] = float("-inf")
        if trial % 7 == 0:
            x = torch.cat([x, x], dim=1)[:, ::2]  # a strided view
        vals, idx = sampler._largest(x, k)
        assert torch.equal(vals, x.topk(k, dim=-1).values), trial
        assert torch.equal(x.gather(1, idx), vals), trial
        assert all(len(set(r)) == k for r in idx.tolist()), trial


def test_row_tensors_by_numpy_are_torchs() -> None:
    """``_rows`` (NumPy's conversion of a list of Python numbers) gives torch.tensor's values,
    bit for bit, rounding to float32 included."""
    rng = random.Random(4)
    cpu = torch.device("cpu")
    for _ in range(300):
        vals = [
            rng.choice([rng.random(), rng.uniform(-1e3, 1e3), rng.random() * 1e-42,
                        rng.random() * 1e39, 0.0, -0.0, math.inf, -math.inf, math.nan])
            for _ in range(rng.randrange(1, 40))
        ]  # fmt: skip
        got = sampler._rows(vals, np.float32, cpu)
        want = torch.tensor(vals, dtype=torch.float32)
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.int32), want.view(torch.int32)
        )
        ints = [rng.randrange(-(2**40), 2**40) for _ in range(rng.randrange(1, 40))]
        assert torch.equal(sampler._rows(ints, np.int64, cpu), torch.tensor(ints))


def test_engine_draws_as_with_one_torch_rand_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seeded sampling workload through the engine (rows coming and going, top-k/top-p/
    min-p, several samples, stop strings): the same outputs with the uniform streams as with
    the plain generators (one ``torch.rand`` per row and step, as before them)."""
    import radixkv.engine.intake as intake
    from radixkv.engine.engine import Engine

    def run() -> list[tuple[str, list[int]]]:
        eng = Engine("radixkv-tiny-random", page_size=16, num_pages=2000, seed=3)
        rng = random.Random(0)
        for i in range(32):
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8, 1.2]), top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([0, 20]), min_p=rng.choice([0.0, 0.05]),
                seed=rng.choice([None, i]), n=rng.choice([1, 2]),
                max_tokens=rng.randrange(4, 20), stop=rng.choice([[], ["q"]]),
            )  # fmt: skip
            eng.add_request([rng.randrange(256) for _ in range(rng.randrange(2, 30))], params)
        got = []
        while eng.has_unfinished():
            got += [(o.request_id, c.token_ids) for o in eng.step() for c in o.outputs]
        eng.check_invariants()
        return got

    streams = run()
    with monkeypatch.context() as m:
        m.setattr(intake, "UniformStream", lambda g: g)  # the plain generator in each row
        plain = run()
    assert streams == plain
    assert sum(len(ids) for _, ids in plain) > 300
