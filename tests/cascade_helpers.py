"""Shared helpers for the cascade tests: an independent paged-decode reference, plan builders,
and a check that a planner's shared segments hold every member's own pages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixkv.attention.cascade import CascadeLevel


def reference_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Plain paged decode, one request at a time, in float64, straight from the KV tensors."""
    _, page_size, h_kv, d = k_cache.shape
    h_q = q.shape[1]
    grp = h_q // h_kv
    scale = d**-0.5 if sm_scale is None else sm_scale
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (pt, n) in enumerate(zip(page_tables, seq_lens)):
        slots = [pt[i // page_size] * page_size + i % page_size for i in range(n)]
        k = k_cache.reshape(-1, h_kv, d)[slots].double()  # [n, Hkv, D]
        v = v_cache.reshape(-1, h_kv, d)[slots].double()
        for h in range(h_q):
            s = (k[:, h // grp] @ q[r, h].double()) * scale  # [n]
            out[r, h] = torch.softmax(s, dim=0) @ v[:, h // grp]
    return out


def level(page_size: int, segments: Sequence[tuple[int, Sequence[int], int]]) -> CascadeLevel:
    """Build a level from ``(num_rows, pages, kv_len)`` segments laid out in row order."""
    for _, pages, kv_len in segments:
        assert len(pages) == -(-kv_len // page_size)
    return CascadeLevel.from_segments(page_size, segments)


def random_kv(
    num_pages: int, page_size: int, h_kv: int, d: int, seed: int = 0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_pages, page_size, h_kv, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page_size, h_kv, d, generator=g).to(dtype)
    return k, v


def check_shared_pages(decision: Any, entries: Sequence[Any]) -> Any:
    """Raise ValueError unless every row of every shared (multi-row) segment finds that
    segment's pages, in order, in its own page table: entries grouped by the trie nodes they
    lock must really hold those nodes' pages (the DecodeEntry contract). Returns ``decision``."""
    for lvl in decision.plan.levels:
        for i in range(lvl.num_segments):
            lo, hi = lvl.qo_indptr[i], lvl.qo_indptr[i + 1]
            pages = list(lvl.kv_indices[lvl.kv_indptr[i] : lvl.kv_indptr[i + 1]])
            if hi - lo < 2 or not pages:
                continue
            for r in range(lo, hi):
                table = list(entries[decision.order[r]].page_table)
                n = len(pages)
                if not any(table[j : j + n] == pages for j in range(len(table) - n + 1)):
                    raise ValueError(
                        f"entry {decision.order[r]}: pages {pages} differ from the other "
                        "sequences sharing the same trie nodes"
                    )
    return decision
