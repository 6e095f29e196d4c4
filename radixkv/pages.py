"""Page arithmetic shared by every layer: how many KV pages a run of tokens occupies, and
where a sliding window's keys start."""

from __future__ import annotations


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens, a partial last page included: ``ceil(tokens /
    page_size)``. Token ``i`` lives on page ``i // page_size``, so ``tokens`` tokens reach page
    ``pages_for(tokens, page_size) - 1``. (Integer maths: no float rounding for huge counts.)"""
    return -(-tokens // page_size)


def window_start_page(position: int, window: int, page_size: int) -> int:
    """The page holding the first key a query at ``position`` reads through a sliding window
    of ``window`` tokens (keys ``position - window + 1 .. position``, none before token 0)."""
    return max(0, position - window + 1) // page_size
