"""Page arithmetic shared by every layer: how many KV pages a run of tokens occupies."""

from __future__ import annotations


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens, a partial last page included: ``ceil(tokens /
    page_size)``. Token ``i`` lives on page ``i // page_size``, so ``tokens`` tokens reach page
    ``pages_for(tokens, page_size) - 1``. (Integer maths: no float rounding for huge counts.)"""
    return -(-tokens // page_size)
