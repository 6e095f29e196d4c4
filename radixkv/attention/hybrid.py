"""HybridAttention: one backend per kind of layer over a :class:`HybridKVPool`.

Hybrid window KV (radixkv/cache/window_slots.py) keeps the full-attention layers' K/V per page
and the sliding-window layers' per window slot, in two pools. This backend holds a backend of
the chosen kind (torch or flashinfer) for each: the full layers' over the page pool, planned on
the step's layout as it comes; the windowed layers' over the slot pool, planned on the same
step with every sequence cut to the part its windows can read: from the page holding the first
key its first new query sees (``num_past - window + 1``) to its end, page ids turned into slot
ids, ``num_past`` shifted to match. Shifting is exact: queries and keys carry their rotary
positions already, and a window mask only looks at distances. ``forward(layer, ...)`` sends the
layer to its backend with its index there.

Cascade decode (shared prefixes read once per group) runs in the full layers only: the runner
wraps the full layers' backend (:meth:`with_full`); the windowed layers read their windows
alone, as layers whose window a sequence outgrew do without hybrid KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.pages import pages_for, window_start_page

# (pool, its layers' windows) -> a backend of the chosen kind over that pool
BackendFactory = Callable[[KVPool, tuple[int, ...]], AttentionBackend]


class HybridAttention(AttentionBackend):
    """See the module docstring. ``make`` builds each part's backend."""

    def __init__(
        self,
        kv_pool: HybridKVPool,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        *,
        make: BackendFactory,
        layer_windows: Sequence[int] = (),
        softcap: float | None = None,
    ) -> None:
        super().__init__(
            kv_pool, num_qo_heads, num_kv_heads, head_dim, scale,
            layer_windows=layer_windows, softcap=softcap,
        )  # fmt: skip
        if tuple(layer_windows) != kv_pool.layer_windows:
            raise ValueError("HybridAttention: layer_windows differ from the pool's")
        self.hybrid_pool = kv_pool
        windowed = tuple(w for w in kv_pool.layer_windows if w)
        self.window = make(kv_pool.window, windowed)
        self.full: AttentionBackend | None = (
            make(kv_pool.full, ()) if kv_pool.full is not None else None
        )
        self.name = self.window.name
        self._route = kv_pool.route

    @property
    def prefill_path(self) -> str | None:
        return getattr(self.window, "prefill_path", None)

    def with_full(self, full: AttentionBackend) -> HybridAttention:
        """This backend with ``full`` (a wrapper of :attr:`full`, e.g. the cascade backend)
        attending the full layers; the windowed layers' backend is shared."""
        other = object.__new__(HybridAttention)
        other.__dict__.update(self.__dict__)
        other.full = full
        return other

    # ---- plan ----------------------------------------------------------------------------------
    def plan(self, layout: BatchLayout) -> None:
        if self.full is not None:
            self.full.check_layouts = self.check_layouts
            self.full.plan(layout)
        self.window.check_layouts = self.check_layouts
        self.window.plan(self.window_layout(layout))

    def window_layout(self, layout: BatchLayout) -> BatchLayout:
        """``layout`` as the windowed layers see it: each sequence from the page holding its
        first new query's first window key, in slot ids, with ``num_past`` shifted to match."""
        pool = self.hybrid_pool
        ps, window = pool.page_size, pool.window_tokens
        slot_of = pool.slots.slot_of
        tables: list[tuple[int, ...]] = []
        pasts: list[int] = []
        for pt, past, new in zip(layout.page_tables, layout.num_past, layout.num_new, strict=True):
            first = window_start_page(past, window, ps)
            tables.append(tuple([slot_of[p] for p in pt[first : pages_for(past + new, ps)]]))
            pasts.append(past - first * ps)
        return BatchLayout(tuple(tables), tuple(pasts), layout.num_new)

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        windowed, index = self._route[layer]
        part = self.window if windowed else self.full
        assert part is not None  # the route sends a layer only to a pool that has it
        return part.forward(index, q, k, v)


__all__ = ["HybridAttention"]
