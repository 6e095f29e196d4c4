"""Eviction policies and the ordered index of evictable leaves.

An index holds exactly the eviction candidates of one tier, ordered by the policy's key
(smallest is evicted first). RadixCache keeps one for its device pages: the unlocked leaves
that own pages (a leaf enters when it is created, unlocked, or its last child goes; it leaves
when it is locked, gains a child, or is evicted; its key is refreshed on access, or for LRU
and LFU marked as lagging and re-keyed only if it reaches the top), so eviction
never rescans the tree: taking the next victim is O(log n), and keeping the index up to date
on the hot paths is O(1) dict work plus one C ``heappush`` (stale keys are dropped lazily; see
EvictionIndex). TieredRadixCache keeps a second instance of the same class for its host pages
(tiered_cache.py says which nodes each one holds); a node can be in both at once, since each
index keeps its own node -> key map instead of a slot on the node.

Keys are single ints (the cheapest comparisons in the heap): the node id is packed into the
low 40 bits, which makes every key unique and breaks ties by creation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from heapq import heapify, heappop, heappush, heapreplace
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
    """Eviction candidates ordered by policy key: a node -> key dict, a key -> node dict and a
    binary heap of keys.

    ``add``, ``discard`` and ``refresh`` are O(1) dict operations plus at most one C
    ``heappush``: a discarded or re-keyed node's old key simply stays in the heap, stale, and
    ``first`` pops stale keys off the top until it finds a live one. The heap is rebuilt from
    the live keys when stale ones outnumber them (amortised O(1) per operation). Keys are
    unique per node (the node id is packed in), so a key in the dict always names its node.

    ``keys`` (node -> its key) is the membership table the cache's hot paths test directly
    (``node in index.keys``): one dict lookup, no method call. Read it, never write it.

    ``lazy`` (the built-in LRU and LFU policies, whose keys only grow as a node is accessed):
    instead of ``refresh``, a caller may put an indexed node in ``lagging`` after accessing it
    (``RadixCache.match_prefix`` does: the leaf it matched is usually locked right after, which
    takes it out again, so re-keying it would be wasted). A lagging node's stored key is a
    lower bound of its key, and ``first`` re-keys it if it reaches the top of the heap, so the
    order stays exact. Any other policy's keys are kept current (``refresh`` on every access).
    """

    __slots__ = ("_heap", "_key", "_lru", "_nodes", "keys", "lagging", "lazy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._key = policy.key
        # LRU's key computed in place on the hot paths (a Python call less per insert)
        self._lru = type(policy) is LRUPolicy
        self.lazy = type(policy) in (LRUPolicy, LFUPolicy)
        self.lagging: set[TreeNode] = set()  # indexed nodes whose keys may lag (lazy only)
        self._heap: list[int] = []
        self._nodes: dict[int, TreeNode] = {}  # live key -> node
        self.keys: dict[TreeNode, int] = {}  # node -> live key

    def add(self, node: TreeNode) -> None:
        """Index a node that is not in the index."""
        k = (node.last_access << _ID_BITS) | node.node_id if self._lru else self._key(node)
        self.keys[node] = k
        self._nodes[k] = node
        heappush(self._heap, k)

    def discard(self, node: TreeNode) -> None:
        """Take ``node`` out of the index (nothing if it is not in it)."""
        k = self.keys.pop(node, None)
        if k is not None:
            del self._nodes[k]
            if self.lagging:
                self.lagging.discard(node)
            if len(self._heap) > 2 * len(self._nodes) + 64:
                self._compact()

    def refresh(self, node: TreeNode) -> None:
        """Re-key a node already in the index after its access fields changed."""
        k = (node.last_access << _ID_BITS) | node.node_id if self._lru else self._key(node)
        keys = self.keys
        old = keys[node]
        if self.lagging:
            self.lagging.discard(node)
        if k != old:
            nodes = self._nodes
            del nodes[old]
            keys[node] = k
            nodes[k] = node
            heap = self._heap
            heappush(heap, k)
            if len(heap) > 2 * len(nodes) + 64:
                self._compact()

    def put(self, node: TreeNode, member: bool) -> None:
        """Make ``node`` a member under its current key (``member``) or not (for callers that
        recompute membership rather than track it)."""
        if member:
            if node in self.keys:
                self.refresh(node)
            else:
                self.add(node)
        else:
            self.discard(node)

    def first(self) -> TreeNode:
        """The next victim (the index must not be empty)."""
        heap = self._heap
        nodes = self._nodes
        while heap[0] not in nodes:  # stale: a discarded or re-keyed node's old key
            heappop(heap)
        node = nodes[heap[0]]
        lagging = self.lagging
        if lagging and node in lagging:
            return self._catch_up()
        return node

    def _catch_up(self) -> TreeNode:
        """``first`` when a lagging node is on top: re-key lagging nodes until the top one's
        key is its own (class docstring)."""
        heap = self._heap
        nodes = self._nodes
        lagging = self.lagging
        while True:
            k = heap[0]
            node = nodes.get(k)
            if node is None:
                heappop(heap)
                continue
            if node not in lagging:
                return node
            lagging.discard(node)
            cur = (node.last_access << _ID_BITS) | node.node_id if self._lru else self._key(node)
            if cur != k:
                del nodes[k]
                nodes[cur] = node
                self.keys[node] = cur
                heapreplace(heap, cur)

    def _compact(self) -> None:
        self._heap = list(self._nodes)
        heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()
        self._nodes.clear()
        self.keys.clear()
        self.lagging.clear()

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[TreeNode]:
        """Nodes in eviction order (first victim first), by their current keys."""
        return iter(sorted(self._nodes.values(), key=self._key))

    def stored_keys(self) -> dict[int, int]:
        """node id -> the key the index orders it by (for invariant checks): its current key
        (a lazy index's stored keys may lag behind: ``check`` checks them)."""
        key = self._key
        return {n.node_id: key(n) for n in self._nodes.values()}

    def check(self) -> str | None:
        """What is wrong with the index's own structure (None: nothing): every live key must be
        in the heap, which must be a heap, the two maps must mirror each other, and each stored
        key must be the node's current key (a lagging node's: at most it)."""
        key = self._key
        lagging = self.lagging
        if lagging and (not self.lazy or not lagging <= self.keys.keys()):
            return "a lagging node is not in a lazy index"
        for k, n in self._nodes.items():
            cur = key(n)
            if k > cur if n in lagging else k != cur:
                return f"{n!r} is stored under key {k}, its key is {cur}"
        heap = self._heap
        if any(heap[i] < heap[(i - 1) >> 1] for i in range(1, len(heap))):
            return "eviction heap order broken"
        missing = self._nodes.keys() - set(heap)
        if missing:
            return f"eviction keys {sorted(missing)} are not in the heap"
        if len(self.keys) != len(self._nodes):
            return f"{len(self.keys)} indexed nodes for {len(self._nodes)} keys"
        for k, n in self._nodes.items():
            if self.keys.get(n) != k:
                return f"{n!r} holds key {self.keys.get(n)}, indexed under {k}"
        return None
