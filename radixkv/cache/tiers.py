"""The host-memory tier of the radix cache: the copier protocol, write policies, load-back results.

A TieredRadixCache (tiered_cache.py; a ``host_pool``, a second PagePool, whose page ids name
pages of host memory) keeps a node's pages in the device pool, in the host pool, or in both;
the rules are in TieredRadixCache's docstring and docs/cache_design.md ("Tiers"). The cache decides which pages to
copy; a *copier* moves the data. This module defines what a copier is, so that the cache stays
torch-free and an embedder can plug in its own buffers: radixkv.kv.copier.KVCopier is the
implementation over radixkv's KVPool and HostKVPool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from radixkv.cache.page_pool import PagePool

if TYPE_CHECKING:
    from radixkv.cache.eviction import EvictionIndex
    from radixkv.cache.node import TreeNode

__all__ = [
    "HOST_HIT",
    "HOST_LEAVING",
    "HOST_MEDIUM",
    "HOST_STORED",
    "WRITE_BACK",
    "WRITE_POLICIES",
    "WRITE_THROUGH",
    "WRITE_THROUGH_SELECTIVE",
    "CompletedCopy",
    "Copier",
    "CopyHandle",
    "HostObserver",
    "HostRun",
    "LayeredCopyHandle",
    "LoadBack",
    "TierState",
    "check_tier_args",
]

WRITE_THROUGH = "write_through"  # back a node up when it is inserted
WRITE_THROUGH_SELECTIVE = "write_through_selective"  # ... once matches went through it N times
WRITE_BACK = "write_back"  # ... when it is evicted from the device
WRITE_POLICIES = (WRITE_THROUGH, WRITE_THROUGH_SELECTIVE, WRITE_BACK)

HOST_MEDIUM = "CPU"
"""``medium`` of the KV events about the host tier (vLLM names its CPU offload tier "CPU").
Events about the device pool keep ``medium=None``, as they always had."""


HOST_STORED = "stored"  # a node's pages became valid in the host tier (a backup completed)
HOST_LEAVING = "leaving"  # a node's host pages are about to be freed (host eviction, a drop)
HOST_HIT = "hit"  # matches through a host-resident node reached write_through_threshold


class HostRun(NamedTuple):
    """What a host observer (``TieredRadixCache.set_host_observer``) is told about one node.

    ``host_pages`` hold the last ``len(host_pages)`` pages of ``prefix``, the node's tokens
    with everything above it (the cache's key encoding: native int64 bytes, from the first
    token of the sequence), under ``namespace``. Their data is valid during the call only:
    after a HOST_LEAVING call the pages are freed and soon overwritten, so an observer that
    keeps the data copies it before returning. It must not call the cache.
    """

    event: str  # HOST_STORED, HOST_LEAVING or HOST_HIT
    namespace: Any
    prefix: bytes
    host_pages: list[int]
    hit_count: int  # matches through the node so far (for selective write policies)


HostObserver = Callable[[HostRun], None]
"""Called by the cache, in the thread that calls it, for each node whose host copy became valid
(HOST_STORED: a backup retired, a write_back) or is about to go (HOST_LEAVING: host eviction,
a node dropped with its subtree), and once for a node with a valid host copy when a match
through it brings its hit count to ``write_through_threshold`` (HOST_HIT). Not called by
``reset`` (a reset drops), nor for pages put in the host tier by ``insert_host`` (they came
from the observer's side). The storage tier
(radixkv/engine/storage_tier.py) is one: it writes host pages to storage."""


@runtime_checkable
class CopyHandle(Protocol):
    """One copy issued by a Copier, possibly still running.

    ``done()`` must not block: True once the copy has finished, successfully or not (and once
    true, stays true). ``wait()`` blocks until it has finished, returns if the data arrived and
    raises (the copy's exception, on every call) if it did not. Neither is called concurrently
    by the cache, which calls them from the thread that calls the cache.
    """

    def done(self) -> bool: ...

    def wait(self) -> None: ...


@runtime_checkable
class LayeredCopyHandle(CopyHandle, Protocol):
    """A load (``Copier.to_device``) that lands layer by layer, layer 0 first.

    ``wait_layer(layer)`` returns once every page of the copy holds its data in layer
    ``layer`` (K and V), or once the copy has failed: it never raises, so a reader that went
    on reads garbage in the failed copy's pages only, and learns of the failure from
    ``wait()`` (which raises, as for any CopyHandle). On a GPU it may instead order the
    calling thread's current stream after that layer's transfer (no host wait). Like
    ``wait()`` it is called from the thread that runs the forward.

    The cache treats such a load like any other (``wait_load`` waits for all of it); the
    engine lets its forward start before the load has landed, each layer waiting for its own
    pages (radixkv.kv.layer_loads.LayerLoads), then calls ``wait_load`` before it uses the
    forward's results, and redoes the step without the sequences whose load failed.
    """

    def wait_layer(self, layer: int) -> None: ...


@runtime_checkable
class Copier(Protocol):
    """Moves whole pages between the device pool and the host pool.

    ``pairs`` lists ``(source page, destination page)``: device to host page ids for
    ``to_host``, host to device page ids for ``to_device``; every destination is distinct, and no
    page of a call is in another copy still in flight. A call may return before the data has
    moved (a background thread, a CUDA side stream); it returns a CopyHandle and must not keep
    ``pairs``' pages to itself beyond the handle's completion. A copy that must read data the
    caller is still writing (the KV of pages a forward pass is producing) is ordered after those
    writes by the copier (for CUDA: the side stream waits on the current stream at issue).

    An exception raised by the call itself, or by the handle's ``wait()``, means the copy failed:
    the cache then treats the destination pages as garbage (a failed load back becomes a miss, a
    failed backup leaves the node on the device only), so partial writes are harmless.

    What the cache guarantees in return: while a copy is in flight its pages stay where they
    are (the nodes are locked: neither evicted nor freed, in either pool), and nothing reads a
    destination page before the handle reported success (TieredRadixCache.wait_load, or matching
    through the node, waits first).
    """

    def to_host(self, pairs: list[tuple[int, int]]) -> CopyHandle: ...

    def to_device(self, pairs: list[tuple[int, int]]) -> CopyHandle: ...


class CompletedCopy:
    """A CopyHandle for a copy that has already finished (``error`` None) or failed."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        return f"CompletedCopy(error={self.error!r})"


class LoadBack:
    """What ``load_back`` (TieredRadixCache's; RadixCache's loads nothing) returns: the device-resident prefix after the load.

    Attributes:
        node: the deepest device-resident node of the prefix (the global root when nothing is
            cached on the device): lock it before the next call that may evict, unlock it when
            done, as with ``MatchResult.node``.
        pages: device pages of the whole prefix, root first (a fresh list). The last
            ``num_loaded_tokens // page_size`` of them are being filled by ``handle``.
        num_tokens: tokens of the prefix, a multiple of page_size.
        num_loaded_tokens: tokens this call loads back from the host tier (0: nothing to load,
            or no room, or a failed copy; then the host continuation is a miss).
        copies: the ``(host page, device page)`` pairs handed to ``copier.to_device``.
        handle: the copy's CopyHandle (None when nothing is copied).
        error: the exception of a copy that failed when issued (its tokens are then not part of
            ``num_tokens``), else None.

    Before a forward pass reads ``pages``, call ``wait_load(lb)``: it waits for the
    copy and returns False if it failed (the loaded nodes are then back in the host tier only,
    their device pages free again: treat the request as a miss and match again). A copy that
    failed when issued leaves ``error`` set and ``pages`` covering the device prefix only, which
    can be read (``wait_load`` returns True). A ``layered`` load may instead be read layer by
    layer as it lands (LayeredCopyHandle.wait_layer before each layer), but ``wait_load`` must
    still be called before anything computed from those reads is used.
    """

    __slots__ = (
        "_copy",
        "copies",
        "error",
        "handle",
        "node",
        "num_loaded_tokens",
        "num_tokens",
        "pages",
    )

    def __init__(
        self,
        node: TreeNode,
        pages: list[int],
        num_tokens: int,
        num_loaded_tokens: int = 0,
        copies: list[tuple[int, int]] | None = None,
        handle: CopyHandle | None = None,
        error: BaseException | None = None,
        copy: Any = None,  # the cache's record of the copy (copies.InFlight); opaque here
    ) -> None:
        self.node = node
        self.pages = pages
        self.num_tokens = num_tokens
        self.num_loaded_tokens = num_loaded_tokens
        self.copies = copies if copies is not None else []
        self.handle = handle
        self.error = error
        self._copy = copy

    @property
    def layered(self) -> bool:
        """Whether the copy lands layer by layer (its handle is a LayeredCopyHandle): a forward
        may then start before it has landed, each layer waiting for its own pages."""
        return self.handle is not None and hasattr(self.handle, "wait_layer")

    def __repr__(self) -> str:
        return (
            f"LoadBack(node={self.node.node_id}, num_tokens={self.num_tokens}, "
            f"num_loaded_tokens={self.num_loaded_tokens}, pages={len(self.pages)}, "
            f"error={self.error!r})"
        )


class TierState:
    """The host tier's state and counters, one attribute of TieredRadixCache (``_tier``)."""

    __slots__ = (
        "backup_failures",
        "backup_pages",
        "backup_skipped",
        "copier",
        "demoted_pages",
        "hindex",
        "host_cached",
        "host_evictable",
        "host_evicted_pages",
        "host_hit_tokens",
        "host_inserted_pages",
        "load_failures",
        "loaded_pages",
        "observer",
        "threshold",
        "write_back_pages",
        "write_policy",
    )

    def __init__(
        self, copier: Any, write_policy: str, threshold: int, hindex: EvictionIndex
    ) -> None:
        self.copier = copier
        self.write_policy = write_policy
        self.threshold = threshold
        self.hindex = hindex  # the host tier's eviction index
        self.host_cached = 0  # host pages owned by nodes
        self.host_evictable = 0  # host pages of unlocked nodes
        # cumulative (CacheStats)
        self.host_hit_tokens = self.loaded_pages = self.load_failures = 0
        self.backup_pages = self.write_back_pages = self.backup_failures = 0
        self.backup_skipped = self.demoted_pages = self.host_evicted_pages = 0
        self.host_inserted_pages = 0  # host pages given by insert_host (e.g. from storage)
        self.observer: HostObserver | None = None


def check_tier_args(
    pool: PagePool,
    host_pool: PagePool | None,
    copier: Any,
    write_policy: Any,
    threshold: Any,
) -> None:
    """The host-tier arguments of build_cache / TieredRadixCache, checked before anything is
    built."""
    if write_policy not in WRITE_POLICIES:
        raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {write_policy!r}")
    if type(threshold) is not int or threshold < 1:
        raise ValueError(f"write_through_threshold must be an int >= 1, got {threshold!r}")
    if host_pool is None:
        if copier is not None:
            raise ValueError("a copier was given without a host_pool: no host tier to copy to")
        return
    if not isinstance(host_pool, PagePool):
        raise TypeError(f"host_pool must be a PagePool, got {type(host_pool).__name__}")
    if host_pool is pool:
        raise ValueError("host_pool must be a PagePool of its own, not the device pool")
    if host_pool.num_pages < 1:
        raise ValueError(
            "host_pool has no pages: a host tier needs at least one page (pass host_pool=None "
            "for no host tier)"
        )
    if host_pool.num_free != host_pool.num_pages:
        raise ValueError("host_pool must be unused: some of its pages are already allocated")
    if copier is None:
        raise ValueError("a host tier needs a copier (radixkv.cache.tiers.Copier) to move pages")
    for name in ("to_host", "to_device"):
        if not callable(getattr(copier, name, None)):
            raise TypeError(f"copier must have a callable {name}(pairs) method, got {copier!r}")
