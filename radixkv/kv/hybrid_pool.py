"""HybridKVPool: full-attention layers' K/V per page, sliding-window layers' K/V per window slot.

The KV layer of hybrid window KV (``EngineConfig.window_kv``; the idea and the page states are
in radixkv/cache/window_slots.py). Two plain :class:`KVPool` s hold the tensors: ``full`` has
the full-attention layers, indexed by page id like any pool (None when every layer has a
window), and ``window`` has the windowed layers, indexed by window slot. ``slots`` (a
:class:`WindowSlots`, owned by the cache layer) says which slot holds which page's windowed
K/V. The attention layer's ``HybridAttention`` routes each layer to its pool and translates
page tables into slot tables for the windowed ones.

The pool answers what the engine asks any pool (``num_layers``, ``num_pages``, dtypes, device,
``copy_pages``), so code above the attention layer does not change with it. Like KVPool it never
allocates: pages come from the cache's PagePool, slots from ``slots``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.cache.window_slots import NO_SLOT, WindowSlots
from radixkv.kv.kv_pool import KVPool, check_positive
from radixkv.kv.layer_loads import LayerLoads


def layer_counts(layer_windows: Sequence[int]) -> tuple[int, int]:
    """(full layers, windowed layers) of a model with these per-layer windows (0: full)."""
    num_window = sum(1 for w in layer_windows if w)
    return len(layer_windows) - num_window, num_window


class HybridKVPool:
    """``layer_windows[l] > 0``: layer ``l`` keeps its K/V in ``window`` (at its position among
    the windowed layers); 0: in ``full`` (at its position among the full layers)."""

    def __init__(
        self,
        layer_windows: Sequence[int],
        full: KVPool | None,
        window: KVPool,
        slots: WindowSlots,
    ) -> None:
        windows = tuple(layer_windows)
        num_full, num_window = layer_counts(windows)
        if not num_window:
            raise ValueError("HybridKVPool: no layer has a sliding window")
        if window.num_layers != num_window:
            raise ValueError(
                f"HybridKVPool: {num_window} windowed layers, window pool has {window.num_layers}"
            )
        if (full.num_layers if full is not None else 0) != num_full:
            raise ValueError(f"HybridKVPool: {num_full} full layers, full pool does not match")
        if window.num_pages != slots.num_slots:
            raise ValueError(
                f"HybridKVPool: window pool has {window.num_pages} pages for "
                f"{slots.num_slots} window slots"
            )
        if full is not None:
            same = ("page_size", "num_kv_heads", "head_dim", "dtype", "compute_dtype", "device")
            diff = [a for a in same if getattr(full, a) != getattr(window, a)]
            if diff:
                raise ValueError(f"HybridKVPool: full and window pools differ in {diff}")
            if full.num_pages != slots.num_pages:
                raise ValueError(
                    f"HybridKVPool: full pool has {full.num_pages} pages, slots cover "
                    f"{slots.num_pages}"
                )
        self.layer_windows = windows
        self.full = full
        self.window = window
        self.slots = slots
        self.window_tokens = max(windows)  # the largest window: what a sequence keeps slots for
        # layer -> (in the window pool?, index in its pool)
        route: list[tuple[bool, int]] = []
        counts = [0, 0]
        for w in windows:
            route.append((bool(w), counts[bool(w)]))
            counts[bool(w)] += 1
        self.route: tuple[tuple[bool, int], ...] = tuple(route)
        self.num_layers = len(windows)
        self.num_pages = slots.num_pages
        self.num_slots = slots.num_slots
        self.page_size = window.page_size
        self.num_kv_heads = window.num_kv_heads
        self.head_dim = window.head_dim
        self.dtype = window.dtype
        self.compute_dtype = window.compute_dtype
        self.device = window.device
        # what a forward waits on per layer (KVPool.loads); never fed: hybrid window KV has
        # no host tier
        self.loads = LayerLoads()

    @classmethod
    def build(
        cls,
        layer_windows: Sequence[int],
        num_pages: int,
        num_slots: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> HybridKVPool:
        """Zeroed pools of ``num_pages`` pages and ``num_slots`` window slots."""
        check_positive("HybridKVPool", "num_pages", num_pages)
        check_positive("HybridKVPool", "num_slots", num_slots)
        num_full, num_window = layer_counts(layer_windows)
        shape = (page_size, num_kv_heads, head_dim, dtype, device)
        full = (
            KVPool(num_full, num_pages, *shape, compute_dtype=compute_dtype) if num_full else None
        )
        window = KVPool(num_window, num_slots, *shape, compute_dtype=compute_dtype)
        return cls(layer_windows, full, window, WindowSlots(num_slots, num_pages))

    @staticmethod
    def pages_in_budget(
        layer_windows: Sequence[int],
        num_bytes: int,
        slots_per_page: float,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """Pages that fit ``num_bytes`` together with ``slots_per_page`` window slots each."""
        num_full, num_window = layer_counts(layer_windows)
        per_page = KVPool.page_bytes(num_full, page_size, num_kv_heads, head_dim, dtype)
        per_slot = KVPool.page_bytes(num_window, page_size, num_kv_heads, head_dim, dtype)
        return int(num_bytes // (per_page + slots_per_page * per_slot))

    # ---- what every pool answers -------------------------------------------------------------
    @property
    def converts(self) -> bool:
        return self.window.converts

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        return self.window.as_stored(x)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page's K/V with its window slot (all layers, K and V)."""
        full = self.full.bytes_per_page if self.full is not None else 0
        return full + self.window.bytes_per_page

    @property
    def total_bytes(self) -> int:
        full = self.full.total_bytes if self.full is not None else 0
        return full + self.window.total_bytes

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy pages ``src[i]`` to ``dst[i]`` in the full layers, and their window slots in
        the windowed ones where ``src[i]`` has one (``dst[i]`` must then have one too)."""
        if len(src) != len(dst):
            raise ValueError(
                f"HybridKVPool.copy_pages: {len(src)} source pages, {len(dst)} targets"
            )
        if self.full is not None:
            self.full.copy_pages(src, dst)
        slot_of = self.slots.slot_of
        pairs = [(slot_of[s], slot_of[d]) for s, d in zip(src, dst) if slot_of[s] != NO_SLOT]
        if any(d == NO_SLOT for _, d in pairs):
            raise ValueError("HybridKVPool.copy_pages: a target page has no window slot")
        if pairs:
            self.window.copy_pages([s for s, _ in pairs], [d for _, d in pairs])

    def __repr__(self) -> str:
        full = self.full.num_layers if self.full is not None else 0
        return (
            f"HybridKVPool({full} full layers x {self.num_pages} pages, "
            f"{self.window.num_layers} windowed layers x {self.num_slots} window slots, "
            f"page_size={self.page_size}, dtype={self.dtype}, device={self.device})"
        )


__all__ = ["HybridKVPool", "layer_counts"]
