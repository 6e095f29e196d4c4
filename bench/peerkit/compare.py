"""Comparing greedy outputs between systems, token by token."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def same_count(got: Sequence[Any], ref: Sequence[Any]) -> int:
    """How many of ``got``'s outputs equal ``ref``'s, position by position."""
    return sum(a == b for a, b in zip(got, ref))


def identical(got: Sequence[Any], ref: Sequence[Any]) -> str:
    """``"k/n"``: ``k`` of ``ref``'s ``n`` outputs equal in ``got``."""
    return f"{same_count(got, ref)}/{len(ref)}"


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """Requests whose greedy outputs are identical, and leading tokens that agree (mean)."""
    lead = []
    for a, b in zip(got, ref, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        lead.append(k)
    same = sum(a == b for a, b in zip(got, ref, strict=True))
    return {"identical": f"{same}/{len(ref)}", "identical_frac": same / len(ref),
            "mean_agreeing_prefix": statistics.fmean(lead)}  # fmt: skip
