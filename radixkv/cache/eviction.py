"""Eviction policies and the ordered index of evictable leaves.

The index holds exactly the unlocked leaves that own pages, ordered by the policy's key
(smallest is evicted first). It is kept incrementally by RadixCache (a leaf enters when it is
created, unlocked, or its last child goes; it leaves when it is locked, gains a child, or is
evicted; its key is refreshed on access), so eviction never rescans the tree: taking the
next victim is O(log n), and keeping the index up to date on the hot paths is O(1) dict work
plus one C ``heappush`` (stale keys are dropped lazily; see EvictionIndex).

A cache with a host tier keeps a second index, HostEvictionIndex, of the nodes whose host copy
can go (same policy, own key slot); RadixCache's docstring says which nodes each one holds.

Keys are single ints (the cheapest comparisons in the heap): the node id is packed into the
low 40 bits, which makes every key unique and breaks ties by creation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heapify, heappop, heappush
from typing import Protocol

from radixkv.cache.node import TreeNode

_ID_BITS = 40
_CLOCK_BITS = 64


class EvictionPolicy(Protocol):
    """Maps a node to an int; smaller keys are evicted first. Must be a pure function of the
    node's ``last_access``, ``hit_count`` and ``node_id`` (the index re-keys a node only when
    those change), and distinct for distinct nodes (include ``node_id``)."""

    name: str

    def key(self, node: TreeNode) -> int: ...


class LRUPolicy:
    """Least recently used first (ties: oldest node first)."""

    name = "lru"

    @staticmethod
    def key(node: TreeNode) -> int:
        return (node.last_access << _ID_BITS) | node.node_id


class LFUPolicy:
    """Fewest hits first, then least recently used, then oldest."""

    name = "lfu"

    @staticmethod
    def key(node: TreeNode) -> int:
        return (
            (node.hit_count << (_CLOCK_BITS + _ID_BITS))
            | (node.last_access << _ID_BITS)
            | node.node_id
        )


POLICIES: dict[str, EvictionPolicy] = {"lru": LRUPolicy(), "lfu": LFUPolicy()}


def get_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    if isinstance(policy, str):
        try:
            return POLICIES[policy]
        except KeyError:
            raise ValueError(
                f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}"
            ) from None
    if not callable(getattr(policy, "key", None)):
        raise TypeError(f"policy must be a name or have a key(node) method, got {policy!r}")
    return policy


class EvictionIndex:
    """Evictable leaves ordered by policy key: a dict of the live keys and a binary heap.

    ``add``, ``discard`` and ``refresh`` are O(1) dict operations plus at most one C
    ``heappush``: a discarded or re-keyed node's old key simply stays in the heap, stale, and
    ``first`` pops stale keys off the top until it finds a live one. The heap is rebuilt from
    the live keys when stale ones outnumber them (amortised O(1) per operation). Keys are
    unique per node (the node id is packed in), so a key in the dict always names its node.
    """

    __slots__ = ("_heap", "_key", "_lru", "_nodes")

    _slot = "_ekey"  # the node slot holding this index's key

    def __init__(self, policy: EvictionPolicy) -> None:
        self._key = policy.key
        # LRU's key computed in place on the hot paths (a Python call less per insert)
        self._lru = type(policy) is LRUPolicy
        self._heap: list[int] = []
        self._nodes: dict[int, TreeNode] = {}  # live key -> node

    def add(self, node: TreeNode) -> None:
        k = (node.last_access << _ID_BITS) | node.node_id if self._lru else self._key(node)
        node._ekey = k
        self._nodes[k] = node
        heappush(self._heap, k)

    def discard(self, node: TreeNode) -> None:
        k = node._ekey
        if k is not None:
            del self._nodes[k]
            node._ekey = None
            if len(self._heap) > 2 * len(self._nodes) + 64:
                self._compact()

    def refresh(self, node: TreeNode) -> None:
        """Re-key a node already in the index after its access fields changed."""
        k = (node.last_access << _ID_BITS) | node.node_id if self._lru else self._key(node)
        old = node._ekey
        if k != old:
            nodes = self._nodes
            del nodes[old]
            node._ekey = k
            nodes[k] = node
            heap = self._heap
            heappush(heap, k)
            if len(heap) > 2 * len(nodes) + 64:
                self._compact()

    def first(self) -> TreeNode:
        """The next victim (the index must not be empty)."""
        heap = self._heap
        nodes = self._nodes
        while heap[0] not in nodes:
            heappop(heap)
        return nodes[heap[0]]

    def _compact(self) -> None:
        self._heap = list(self._nodes)
        heapify(self._heap)

    def clear(self) -> None:
        slot = self._slot
        for node in self._nodes.values():
            setattr(node, slot, None)
        self._heap.clear()
        self._nodes.clear()

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        """Nodes in eviction order (first victim first)."""
        nodes = self._nodes
        return (nodes[k] for k in sorted(nodes))

    def stored_keys(self) -> dict[int, int]:
        """node id -> stored key (for invariant checks)."""
        return {n.node_id: k for k, n in self._nodes.items()}

    def check(self) -> str | None:
        """What is wrong with the index's own structure (None: nothing): every live key must be
        in the heap, which must be a heap, and every node must hold its own key."""
        heap = self._heap
        if any(heap[i] < heap[(i - 1) >> 1] for i in range(1, len(heap))):
            return "eviction heap order broken"
        missing = self._nodes.keys() - set(heap)
        if missing:
            return f"eviction keys {sorted(missing)} are not in the heap"
        slot = self._slot
        for k, n in self._nodes.items():
            if getattr(n, slot) != k:
                return f"{n!r} holds key {getattr(n, slot)}, indexed under {k}"
        return None


class HostEvictionIndex(EvictionIndex):
    """The host tier's index: the same ordering, kept in the node's ``_hekey`` slot so that a
    node can be in both indexes at once (the device one uses ``_ekey``)."""

    __slots__ = ()

    _slot = "_hekey"

    def add(self, node: TreeNode) -> None:
        k = self._key(node)
        node._hekey = k
        self._nodes[k] = node
        heappush(self._heap, k)

    def discard(self, node: TreeNode) -> None:
        k = node._hekey
        if k is not None:
            del self._nodes[k]
            node._hekey = None
            if len(self._heap) > 2 * len(self._nodes) + 64:
                self._compact()

    def refresh(self, node: TreeNode) -> None:
        k = self._key(node)
        old = node._hekey
        if k != old:
            nodes = self._nodes
            del nodes[old]
            node._hekey = k
            nodes[k] = node
            heap = self._heap
            heappush(heap, k)
            if len(heap) > 2 * len(nodes) + 64:
                self._compact()
