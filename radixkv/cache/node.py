"""TreeNode: one edge-compressed run of whole pages in the radix trie.

A node owns ``key`` (its own tokens, native int64 bytes, a whole number of pages) and the
KV pages holding them (``pages[i]`` holds tokens ``[i * page_size, (i + 1) * page_size)`` of
the key). Users and other layers read these attributes; only RadixCache writes them:

* ``parent`` (None for the root), ``children`` (iterable of child nodes),
* ``num_tokens`` (own key length), ``tokens`` (own key as list[int]), ``pages`` (list copy),
* ``lock_ref`` (requests using this node or a descendant), ``last_access`` (logical clock),
  ``hit_count`` (matches that went through the node), ``namespace``,
* ``depth_tokens`` (tokens from the root to the end of this node),
* ``node_id`` (unique within its cache, increasing with creation; policies break ties on it).

The root and the per-namespace roots have no tokens and no pages. What a node's pages and
lock count mean for their owner is the ownership contract in RadixCache's docstring.

With a host tier (TieredRadixCache) a node's pages live in the device pool, the host
pool or both: ``pages`` are its device pages (empty while the node is in host memory only),
``host_pages`` its host pages (empty when it has no host copy); ``on_device``, ``on_host`` and
``residency`` ("device", "host" or "device+host"; "" for the roots) say the same in words, and
``copies_in_flight`` counts the copies between the tiers still running on its pages.

The underscored slots are the trie's own storage, read and written only inside
radixkv/cache: the trie (trie.py), the device cache (radix_cache.py) and the tiered cache
(tiered_cache.py) keep them; the recounts (invariants.py) read them. They are slots on the
node, not fields of side tables, because the hot paths read them once per visited node (the
eviction indexes, which a node may be in two of, keep their keys in their own tables).
``_pages`` is the node's own list, never shared or handed out (``pages``, ``path_pages`` and
the results copy it), so splits and truncation cut it in place. The host tier's per-node state
has slots only in TieredTreeNode, the node type of TieredRadixCache; a RadixCache's TreeNode
reads the class-level values (no host copy, nothing in flight) and cannot write them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixkv.cache.tokens import TOKEN_BYTES, key_to_list


class TreeNode:
    __slots__ = (
        "_cache",
        "_children",
        "_hashes",
        "_hkey",
        "_pages",
        "depth_tokens",
        "hit_count",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "node_id",
        "parent",
    )

    # The host tier's per-node state, as a node of a cache without one reads it (slots in
    # TieredTreeNode): host page ids (None: no host copy), device-/host-resident children,
    # copies in flight (loads among them) on its pages.
    _host_pages: list[int] | None = None
    _ndev = 0
    _nhost = 0
    _inflight = 0
    _loading = 0

    def __init__(
        self,
        cache: Any,
        node_id: int,
        parent: TreeNode | None,
        key: bytes,
        pages: list[int],
        namespace: Any,
        depth_tokens: int,
        clock: int,
    ) -> None:
        self._cache = cache  # owner, for foreign-node checks
        self.node_id = node_id  # unique within the cache; tie-breaker in the eviction order
        self.parent = parent
        # child-lookup hash of the first page -> child, or a list of children on collision
        self._children: dict[Any, Any] = {}
        self.key = key
        self._pages = pages
        self.namespace = namespace
        self.depth_tokens = depth_tokens
        self.lock_ref = 0
        self.last_access = clock
        self.hit_count = 0
        self._hkey: Any = None  # key of this node in parent._children
        self._hashes: list[int] | None = None  # event hashes of own pages, computed lazily

    @property
    def num_tokens(self) -> int:
        return len(self.key) // TOKEN_BYTES

    @property
    def tokens(self) -> list[int]:
        return key_to_list(self.key)

    @property
    def pages(self) -> list[int]:
        return list(self._pages)

    @property
    def num_pages(self) -> int:
        """Device pages (0 for a node held in host memory only)."""
        return len(self._pages)

    @property
    def host_pages(self) -> list[int]:
        """Host page ids of the node's host copy, as a list copy ([] when it has none)."""
        hp = self._host_pages
        return [] if hp is None else list(hp)

    @property
    def on_device(self) -> bool:
        return bool(self._pages)

    @property
    def on_host(self) -> bool:
        return self._host_pages is not None

    @property
    def residency(self) -> str:
        """ "device", "host" or "device+host" ("" for the root and the namespace roots)."""
        if not self.key:
            return ""
        if self._host_pages is None:
            return "device"
        return "device+host" if self._pages else "host"

    @property
    def copies_in_flight(self) -> int:
        """Copies between the tiers still running on this node's pages."""
        return self._inflight

    @property
    def children(self) -> list[TreeNode]:
        return list(self.iter_children())

    def iter_children(self) -> Iterator[TreeNode]:
        for c in self._children.values():
            if type(c) is list:
                yield from c
            else:
                yield c

    @property
    def is_leaf(self) -> bool:
        return not self._children

    @property
    def is_branch(self) -> bool:
        """Whether two or more children continue this node (cached sequences diverge here)."""
        kids = self._children
        return len(kids) > 1 or (len(kids) == 1 and type(next(iter(kids.values()))) is list)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, tokens={self.num_tokens}, pages={len(self._pages)}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access}, "
            f"namespace={self.namespace!r})"
        )


class TieredTreeNode(TreeNode):
    """A node of a cache with a host tier: a TreeNode with slots for the tier's state."""

    __slots__ = ("_host_pages", "_inflight", "_loading", "_ndev", "_nhost")

    def __init__(self, *args: Any) -> None:  # TreeNode's arguments
        super().__init__(*args)
        self._host_pages = None
        self._ndev = 0
        self._nhost = 0
        self._inflight = 0
        self._loading = 0


def path_pages(node: TreeNode) -> list[int]:
    """A fresh list of all device pages from the root down to and including ``node``."""
    own = node._pages
    parent = node.parent
    if own and (parent is None or not parent._pages):
        # Device-resident nodes form a top-closed subtree (every node of a cache without a
        # host tier is device-resident): a parent without device pages is a root, and so
        # are all nodes above it. The common case of a match one node deep.
        return own[:]
    parts: list[list[int]] = []
    while node is not None:
        if node._pages:
            parts.append(node._pages)
        node = node.parent
    out: list[int] = []
    for p in reversed(parts):
        out += p
    return out
