"""Host-memory K/V pages: the data of the radix cache's host tier.

A HostKVPool holds pages shaped like a KVPool's, in CPU memory (pinned when the KVPool is on a
GPU, so that copies run asynchronously). Like KVPool it owns the tensors only: which host page
holds which prefix is decided by the cache (``build_cache(..., host_pool=PagePool(n))``, whose
page ids index dimension 0 here), and radixkv.kv.copier.KVCopier moves pages between the two.
"""

from __future__ import annotations

import torch

from radixkv.kv.kv_pool import KVPool, check_page_shape, check_positive, movable


class HostKVPool:
    """K and V pages in host memory, ``[num_pages, num_layers, page_size, num_kv_heads, head_dim]``.

    Page-major, unlike KVPool's ``[num_layers, num_pages, ...]``: one host page (all layers) is
    one contiguous block, so a page moves between device and host as a single transfer (a
    single DMA from pinned memory on CUDA), and a later storage tier can write it as one
    buffer. Buffers are not zeroed: the cache never lets a host page be read before a copy
    filled it.

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype: the page shape; all
            but ``num_pages`` must equal the KVPool's that it backs (``like`` copies them).
        pin_memory: allocate page-locked memory (needs CUDA; what asynchronous copies to and
            from a GPU need).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
    ) -> None:
        check_page_shape(
            "HostKVPool", num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype
        )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.pin_memory = bool(pin_memory)
        shape = (num_pages, num_layers, page_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        self.v = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)

    @classmethod
    def like(cls, kv: KVPool, num_pages: int, *, pin_memory: bool | None = None) -> HostKVPool:
        """``num_pages`` host pages shaped like ``kv``'s (pinned when ``kv`` is on CUDA, unless
        ``pin_memory`` says otherwise)."""
        if pin_memory is None:
            pin_memory = kv.device.type == "cuda"
        return cls(
            kv.num_layers,
            num_pages,
            kv.page_size,
            kv.num_kv_heads,
            kv.head_dim,
            kv.dtype,
            pin_memory,
        )

    @classmethod
    def from_memory_budget(
        cls,
        num_bytes: int,
        like: KVPool,
        *,
        max_pages: int | None = None,
        pin_memory: bool | None = None,
    ) -> HostKVPool:
        """As many pages shaped like ``like``'s as fit in ``num_bytes`` (capped by ``max_pages``).

        ValueError, before anything is allocated, when ``num_bytes`` is not a non-negative int
        or holds not even one page (the message gives the size of one).
        """
        if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
            raise ValueError(
                f"HostKVPool.from_memory_budget: the host memory budget must be a non-negative "
                f"int of bytes, got {num_bytes!r}"
            )
        if max_pages is not None:
            check_positive("HostKVPool", "max_pages", max_pages)
        per_page = like.bytes_per_page
        num_pages = num_bytes // per_page
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        if num_pages <= 0:
            raise ValueError(
                f"HostKVPool.from_memory_budget: {num_bytes} bytes of host memory hold no KV "
                f"page (one page needs {per_page} bytes: {like.num_layers} layers x 2 (K, V) x "
                f"{like.page_size} tokens x {like.num_kv_heads} heads x {like.head_dim} x "
                f"{like.dtype}); give at least {per_page} bytes, or no host tier"
            )
        return cls.like(like, num_pages, pin_memory=pin_memory)

    @property
    def bytes_per_page(self) -> int:
        return KVPool.page_bytes(
            self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def read_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of ``pages``' K/V as bytes, ``[len(pages), bytes_per_page]`` uint8: row ``i`` is
        page ``pages[i]``'s K (every layer) then its V, the payload the storage tier stores."""
        idx = torch.tensor(pages, dtype=torch.long)
        n = len(pages)
        k = self.k.index_select(0, idx).view(torch.uint8).reshape(n, -1)
        v = self.v.index_select(0, idx).view(torch.uint8).reshape(n, -1)
        return torch.cat((k, v), dim=1)

    def write_pages(self, pages: list[int], payloads: list[bytes] | list[memoryview]) -> None:
        """Fill ``pages`` from payloads shaped as ``read_pages`` rows (``bytes_per_page`` each;
        ValueError, nothing written, if one is not)."""
        per = self.bytes_per_page
        if len(payloads) != len(pages):
            raise ValueError(f"{len(pages)} pages but {len(payloads)} payloads")
        buf = bytearray(per * len(pages))  # writable: torch.frombuffer shares it without a warning
        for i, p in enumerate(payloads):
            if len(p) != per:
                raise ValueError(f"a page payload is {len(p)} bytes, a page here is {per}")
            buf[i * per : (i + 1) * per] = p
        if not pages:
            return
        rows = torch.frombuffer(buf, dtype=torch.uint8).view(len(pages), 2, per // 2)
        shape = (len(pages), *self.k.shape[1:])
        idx = torch.tensor(pages, dtype=torch.long)
        for t, half in ((self.k, rows[:, 0]), (self.v, rows[:, 1])):
            dst = movable(t)  # bytes move as they are: fp8 pages through a uint8 view
            dst.index_copy_(0, idx, half.contiguous().view(dst.dtype).view(shape))

    def matches(self, kv: KVPool) -> bool:
        """Whether a page of ``kv`` and a page here hold the same thing (shape and dtype)."""
        return (
            self.num_layers == kv.num_layers
            and self.page_size == kv.page_size
            and self.num_kv_heads == kv.num_kv_heads
            and self.head_dim == kv.head_dim
            and self.dtype == kv.dtype
        )

    def __repr__(self) -> str:
        return (
            f"HostKVPool(num_layers={self.num_layers}, num_pages={self.num_pages}, "
            f"page_size={self.page_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, pin_memory={self.pin_memory})"
        )
