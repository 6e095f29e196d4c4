"""The sampler's shortcuts against the paths they replace: NumPy's argmax for torch's
(``argmax_rows``), randomized over shapes, ties, NaN and infinities."""

from __future__ import annotations

import torch

from radixkv.engine.sampler import argmax_rows


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
