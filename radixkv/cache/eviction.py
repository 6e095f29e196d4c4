"""Eviction policies and the ordered index of evictable leaves.

The index holds exactly the unlocked leaves that own pages, ordered by the policy's key
(smallest is evicted first). It is kept incrementally by RadixCache (a leaf enters when it is
created, unlocked, or its last child goes; it leaves when it is locked, gains a child, or is
evicted; its key is refreshed on access), so eviction never rescans the tree: taking the
next victim is O(log n).

A cache with a host tier keeps a second index, HostEvictionIndex, of the nodes whose host copy
can go (same policy, own key slot); RadixCache's docstring says which nodes each one holds.

Keys are single ints (cheap comparisons in the SortedList): the node id is packed into the
low 40 bits, which makes every key unique and breaks ties by creation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from sortedcontainers import SortedList

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
    """Evictable leaves ordered by policy key."""

    __slots__ = ("_key", "_keys", "_nodes")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._key = policy.key
        self._keys = SortedList()
        self._nodes: dict[int, TreeNode] = {}

    def add(self, node: TreeNode) -> None:
        k = self._key(node)
        node._ekey = k
        self._keys.add(k)
        self._nodes[k] = node

    def discard(self, node: TreeNode) -> None:
        k = node._ekey
        if k is not None:
            self._keys.remove(k)
            del self._nodes[k]
            node._ekey = None

    def refresh(self, node: TreeNode) -> None:
        """Re-key a node already in the index after its access fields changed."""
        k = self._key(node)
        old = node._ekey
        if k != old:
            self._keys.remove(old)
            del self._nodes[old]
            node._ekey = k
            self._keys.add(k)
            self._nodes[k] = node

    def first(self) -> TreeNode:
        return self._nodes[self._keys[0]]

    def clear(self) -> None:
        for node in self._nodes.values():
            node._ekey = None
        self._keys.clear()
        self._nodes.clear()

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[TreeNode]:
        """Nodes in eviction order (first victim first)."""
        nodes = self._nodes
        return (nodes[k] for k in self._keys)

    def stored_keys(self) -> dict[int, int]:
        """node id -> stored key (for invariant checks)."""
        return {n.node_id: k for k, n in self._nodes.items()}


class HostEvictionIndex(EvictionIndex):
    """The host tier's index: the same ordering, kept in the node's ``_hekey`` slot so that a
    node can be in both indexes at once (the device one uses ``_ekey``)."""

    __slots__ = ()

    def add(self, node: TreeNode) -> None:
        k = self._key(node)
        node._hekey = k
        self._keys.add(k)
        self._nodes[k] = node

    def discard(self, node: TreeNode) -> None:
        k = node._hekey
        if k is not None:
            self._keys.remove(k)
            del self._nodes[k]
            node._hekey = None

    def refresh(self, node: TreeNode) -> None:
        k = self._key(node)
        old = node._hekey
        if k != old:
            self._keys.remove(old)
            del self._nodes[old]
            node._hekey = k
            self._keys.add(k)
            self._nodes[k] = node

    def clear(self) -> None:
        for node in self._nodes.values():
            node._hekey = None
        self._keys.clear()
        self._nodes.clear()
