"""Paged K/V storage for every layer of one model.

The pool owns the tensors only. Which page belongs to which prefix or request is decided by the
cache layer (``radixkv.cache``) and the engine; the pool never allocates or frees page ids. A page id
is simply an index into dimension 1 of :attr:`KVPool.k` / :attr:`KVPool.v`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.kv.layer_loads import LayerLoads
from radixkv.kv.names import KV_CACHE_DTYPE_ATTRS
from radixkv.pages import pages_for


def check_positive(owner: str, name: str, value: object) -> None:
    """ValueError naming ``owner`` unless ``value`` is a positive int (bools are not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


# 8-bit float storage formats for K/V (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``): half the
# bytes of bf16 per token, so twice the cached prefixes in the same memory. e4m3 keeps one more
# mantissa bit (finer values, range +-448, conversions saturate); e5m2 keeps range (+-57344).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in KV_CACHE_DTYPE_ATTRS.items()
}


def parse_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype pages store for ``kv_cache_dtype`` ``name`` under a model computing in
    ``model_dtype`` ("auto": ``model_dtype`` itself). ValueError naming the choices otherwise."""
    if name == "auto":
        return model_dtype
    try:
        return _KV_CACHE_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {tuple(_KV_CACHE_DTYPES)}, got {name!r}"
        ) from None


# Reading fp8 pages by bit moves: an fp8 number's exponent and mantissa bits, placed at the bottom
# of a wider float's exponent field and the top of its mantissa, read as that number times
# 2**-(bias difference); one exact multiply by a power of two restores it. Subnormal fp8 values
# would land on subnormal wide values, which a flush-to-zero CPU mode zeroes, so pages never
# hold them (store_as flushes them to zero). PyTorch's own fp8 conversions on a CPU are scalar
# loops: on a 2-core Zen 4, 4.2M e4m3 values took 8.9 ms to reach bf16 by .to(), 0.9 ms this
# way. (fp8 dtype, target) -> (integer view, shift, mask keeping sign + moved bits, scale)
_WIDEN: dict[tuple[torch.dtype, torch.dtype], tuple[torch.dtype, int, int, float]] = {
    (torch.float8_e4m3fn, torch.bfloat16): (torch.int16, 4, 0x87FF, 2.0**120),
    (torch.float8_e5m2, torch.bfloat16): (torch.int16, 5, 0x8FFF, 2.0**112),
    (torch.float8_e4m3fn, torch.float16): (torch.int16, 7, 0xBFFF, 2.0**8),
    (torch.float8_e5m2, torch.float16): (torch.int16, 8, 0xFFFF, 1.0),
    (torch.float8_e4m3fn, torch.float32): (torch.int32, 20, 0x87FFFFFF, 2.0**120),
    (torch.float8_e5m2, torch.float32): (torch.int32, 21, 0x8FFFFFFF, 2.0**112),
}
# the masks as the signed integers with those bits (what bitwise_and_ on int16/int32 takes)
_WIDEN = {
    key: (it, shift, mask - (1 << (it.itemsize * 8)) if mask >> (it.itemsize * 8 - 1) else mask, k)
    for key, (it, shift, mask, k) in _WIDEN.items()
}
# the exponent bits of each fp8 format (zero there: a zero or a subnormal) and its largest value
_FP8_EXPONENT = {torch.float8_e4m3fn: 0x78, torch.float8_e5m2: 0x7C}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def store_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` converted to the page dtype ``dtype``. Into fp8: values past the format's range
    saturate to its largest (never inf), and subnormal results (below 2**-6 in e4m3, 2**-14 in
    e5m2) are flushed to zero, far below the rounding error at K/V's usual magnitudes (see
    :func:`load_as` for why). NaN stays a NaN byte, which :func:`load_as` reads back finite
    (480 in e4m3): a model computing NaN K/V gives garbage either way."""
    if dtype not in _FP8_EXPONENT:
        return x.to(dtype)
    big = _FP8_MAX[dtype]
    q = x.clamp(-big, big).to(dtype)
    raw = q.view(torch.uint8)
    raw.masked_fill_(raw.bitwise_and(_FP8_EXPONENT[dtype]) == 0, 0)
    return q


def load_as(
    stored: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``stored`` (page values, as :func:`store_as` wrote them) converted to ``dtype``, into
    ``out`` (same shape, contiguous) when given. Exact. fp8 on a CPU goes by bit moves
    (``_WIDEN``); anything else by ``Tensor.to``, so without ``out`` a tensor already in
    ``dtype`` is returned itself, not copied."""
    widen = _WIDEN.get((stored.dtype, dtype)) if stored.device.type == "cpu" else None
    if widen is None:
        return stored.to(dtype) if out is None else out.copy_(stored)
    int_dtype, shift, mask, scale = widen
    if out is None:
        out = torch.empty(stored.shape, dtype=dtype, device=stored.device)
    wide = out.view(int_dtype)
    wide.copy_(stored.view(torch.int8))  # sign-extends: the sign lands on the top bit below
    wide.bitwise_left_shift_(shift).bitwise_and_(mask)
    return out.mul_(scale) if scale != 1.0 else out


def movable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the copy ops (``index_copy_``, ``copy_``) can move it: an fp8 tensor as a uint8
    view of the same bytes (PyTorch's CPU ``index_copy_`` has no fp8 kernel), anything else as
    is. Moving bytes is exact, so pages keep their values bit for bit."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


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


def check_compute_dtype(
    owner: str, dtype: torch.dtype, compute_dtype: torch.dtype | None
) -> torch.dtype:
    """The compute dtype of a pool storing ``dtype``: ``compute_dtype``, by default ``dtype``.
    An fp8 pool needs one named (nothing computes in fp8); it must be a 16- or 32-bit float."""
    if compute_dtype is None:
        if dtype in FP8_DTYPES:
            raise ValueError(
                f"{owner}: a {dtype} pool needs compute_dtype (the model's dtype, e.g. "
                "torch.bfloat16): attention does not compute in fp8"
            )
        return dtype
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"{owner}: compute_dtype must be torch.float32, bfloat16 or float16, "
            f"got {compute_dtype!r}"
        )
    return compute_dtype


class KVPool:
    """K and V buffers of shape ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.

    ``kv.k[layer]`` / ``kv.v[layer]`` are ``[num_pages, page_size, num_kv_heads, head_dim]`` views
    (FlashInfer's NHD paged layout). Token ``i`` of a sequence with page table ``pt`` lives at page
    ``pt[i // page_size]``, offset ``i % page_size``; its flat slot is
    ``pt[i // page_size] * page_size + i % page_size``.

    ``dtype`` is what the pages store; ``compute_dtype`` is what attention computes in (the
    model's dtype; by default ``dtype``). When they differ (an fp8 pool under a bf16 model, or
    a bf16 pool under an fp32 one) :meth:`write` converts the new K/V to ``dtype``
    (:func:`store_as`: fp8 saturates instead of overflowing) and readers convert gathered pages
    back to ``compute_dtype`` (:func:`load_as`). Attention must then see a token's K/V as
    stored, also in the step that computed it (:meth:`as_stored`): so a prefix served from the
    cache and the same prefix recomputed give the same outputs.

    Buffers start zeroed, so a gather that pads with unused slots never reads NaN garbage.

    ``loads`` lists the host-tier loads still landing in the pool layer by layer
    (radixkv/kv/layer_loads.py): a forward waits on it for each layer before reading it.
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
        *,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        check_page_shape("KVPool", num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype)
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.compute_dtype = check_compute_dtype("KVPool", dtype, compute_dtype)
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.loads = LayerLoads()  # fed by a layer-wise KVCopier

    @property
    def converts(self) -> bool:
        """Whether pages are stored in another dtype than attention computes in."""
        return self.dtype != self.compute_dtype

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (fresh K or V in ``compute_dtype``) with the values the pool stores for it: a
        round trip through ``dtype`` when the pool converts, else ``x`` itself."""
        if self.dtype == self.compute_dtype:
            return x
        return load_as(store_as(x, self.dtype), x.dtype)

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
        compute_dtype: torch.dtype | None = None,
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
        return cls(
            num_layers,
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            compute_dtype=compute_dtype,
        )

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
        dt = self.dtype
        movable(self.k_flat(layer)).index_copy_(0, slots, movable(store_as(k, dt)))
        movable(self.v_flat(layer)).index_copy_(0, slots, movable(store_as(v, dt)))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy the K/V of pages ``src[i]`` to pages ``dst[i]`` in every layer (a forked beam's
        tail page). ``dst`` must be distinct from each other and from ``src``."""
        if len(src) != len(dst):
            raise ValueError(f"KVPool.copy_pages: {len(src)} source pages, {len(dst)} targets")
        if not src:
            return
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        for t in (movable(self.k), movable(self.v)):
            t.index_copy_(1, d, t.index_select(1, s))

    def __repr__(self) -> str:
        return (
            f"KVPool(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}"
            + (f", compute_dtype={self.compute_dtype})" if self.converts else ")")
        )
