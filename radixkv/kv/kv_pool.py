"""Paged K/V storage for every layer of one model.

The pool owns the tensors only. Which page belongs to which prefix or request is decided by the
cache layer (``radixkv.cache``) and the engine; the pool never allocates or frees page ids. A page id
is simply an index into dimension 1 of :attr:`KVPool.k` / :attr:`KVPool.v`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.pages import pages_for


def check_positive(owner: str, name: str, value: object) -> None:
    """ValueError naming ``owner`` unless ``value`` is a positive int (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def check_page_shape(
    owner: str,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    """The checks every pool of K/V pages makes on its shape and dtype (errors name ``owner``)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_pages", num_pages),
        ("page_size", page_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        check_positive(owner, name, value)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}: dtype must be a floating torch.dtype, got {dtype!r}")


class KVPool:
    """K and V buffers of shape ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.

    ``kv.k[layer]`` / ``kv.v[layer]`` are ``[num_pages, page_size, num_kv_heads, head_dim]`` views
    (FlashInfer's NHD paged layout). Token ``i`` of a sequence with page table ``pt`` lives at page
    ``pt[i // page_size]``, offset ``i % page_size``; its flat slot is
    ``pt[i // page_size] * page_size + i % page_size``.

    Buffers start zeroed, so a gather that pads with unused slots never reads NaN garbage.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        check_page_shape("KVPool", num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def page_bytes(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs across all layers, K and V together."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    @classmethod
    def from_memory_budget(
        cls,
        num_bytes: int,
        *,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_pages: int | None = None,
    ) -> KVPool:
        """As many pages as fit in ``num_bytes`` (capped by ``max_pages``); at least one must fit."""
        per_page = cls.page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)
        num_pages = int(num_bytes) // per_page
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        if num_pages <= 0:
            raise ValueError(
                f"KVPool.from_memory_budget: {num_bytes} bytes hold no page "
                f"(one page needs {per_page} bytes)"
            )
        return cls(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)

    # ---- slots -------------------------------------------------------------------------------
    def slot_indices(self, page_table: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens ``start .. end-1`` of a sequence with this page table."""
        ps = self.page_size
        if start < 0 or end < start or pages_for(end, ps) > len(page_table):
            raise ValueError(
                f"KVPool.slot_indices: tokens [{start}, {end}) need {pages_for(end, ps)} pages, "
                f"page table has {len(page_table)}"
            )
        return [page_table[i // ps] * ps + i % ps for i in range(start, end)]

    def k_flat(self, layer: int) -> torch.Tensor:
        """``[num_pages * page_size, num_kv_heads, head_dim]`` view of layer ``layer``'s K."""
        return self.k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        return self.v[layer].view(-1, self.num_kv_heads, self.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``) at flat ``slots`` (``[T]`` int64).

        Mutates layer ``layer`` of the pool in place. Slots must be distinct (not checked: this
        runs once per layer per step).
        """
        self.k_flat(layer).index_copy_(0, slots, k.to(self.dtype))
        self.v_flat(layer).index_copy_(0, slots, v.to(self.dtype))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of pages ``src[i]`` to pages ``dst[i]`` in every layer (a forked beam's
        tail page). ``dst`` must be distinct from each other and from ``src``."""
        if len(src) != len(dst):
            raise ValueError(f"KVPool.copy_pages: {len(src)} source pages, {len(dst)} targets")
        if not src:
            return
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        self.k.index_copy_(1, d, self.k.index_select(1, s))
        self.v.index_copy_(1, d, self.v.index_select(1, s))

    def __repr__(self) -> str:
        return (
            f"KVPool(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device})"
        )
