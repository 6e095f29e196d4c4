"""MatchResult and InsertResult: what ``RadixCache.match_prefix`` and ``insert`` return.

RadixCache's docstring says who owns the pages they name and for how long they are valid.

``MatchResult`` builds its page list when ``pages`` is first read, from the path that ends at
its node (the nodes hold the pages; a match itself only walks the trie and returns the node
and the length, as SGLang's caches do). Until the result's node is locked, as the engine does
right after matching, a call that may evict can cut that path; reading ``pages`` of such a
stale result raises ``StaleMatchError`` instead of returning pages that belong to someone else.
Apart from that it behaves as a NamedTuple of its six fields: attribute access, unpacking,
indexing, ``==`` with tuples, ``_replace``, ``_asdict``, ``_fields``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from radixkv.cache.errors import StaleMatchError
from radixkv.cache.node import TreeNode, path_pages

__all__ = ["InsertResult", "MatchResult"]


class MatchResult:
    """What ``RadixCache.match_prefix`` returns (see RadixCache for who owns the pages).

    The first three fields are the device-resident prefix. The last three describe the
    continuation found in the host tier right after it (always empty without a host tier):
    ``load_back(match)`` turns it into device pages.

    Fields:
        node: deepest matched device-resident node (the root when none); lock this.
        pages: device pages of the matched prefix, in order (a fresh list, built on first
            read from the path to ``node``; StaleMatchError if that path was evicted since).
        num_tokens: matched device-resident tokens, a multiple of page_size.
        host_node: deepest node of the host continuation (``node`` when none).
        host_pages: host pages of the continuation, in order (a fresh list).
        num_host_tokens: tokens of the continuation, a multiple of page_size.
    """

    __slots__ = ("_pages", "host_node", "host_pages", "node", "num_host_tokens", "num_tokens")

    _fields = ("node", "pages", "num_tokens", "host_node", "host_pages", "num_host_tokens")

    def __init__(
        self,
        node: TreeNode,
        pages: list[int] | None,
        num_tokens: int,
        host_node: TreeNode | None = None,
        host_pages: Sequence[int] = (),
        num_host_tokens: int = 0,
    ) -> None:
        self.node = node
        self._pages = pages  # None: not built yet (see ``pages``)
        self.num_tokens = num_tokens
        self.host_node = host_node
        self.host_pages = host_pages
        self.num_host_tokens = num_host_tokens

    @property
    def pages(self) -> list[int]:
        p = self._pages
        if p is None:
            node = self.node
            if node.depth_tokens != self.num_tokens or (node.parent is None and node.key):
                raise StaleMatchError(
                    "this MatchResult's node was evicted or cut since the match (lock the "
                    "node right after matching, before any call that may evict)"
                )
            p = self._pages = path_pages(node)
        return p

    # ---- the NamedTuple protocol
    def __iter__(self) -> Iterator[Any]:
        yield self.node
        yield self.pages
        yield self.num_tokens
        yield self.host_node
        yield self.host_pages
        yield self.num_host_tokens

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int | slice) -> Any:
        return tuple(self)[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MatchResult | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (holds lists, as the NamedTuple did)

    def _replace(self, **changes: Any) -> MatchResult:
        fields = self._asdict()
        unknown = changes.keys() - fields.keys()
        if unknown:
            raise ValueError(f"got unexpected field names: {sorted(unknown)!r}")
        fields.update(changes)
        return MatchResult(**fields)

    def _asdict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in zip(self._fields, self))
        return f"MatchResult({body})"


class InsertResult(NamedTuple):
    """What ``RadixCache.insert`` returns (see RadixCache for who owns the pages)."""

    node: TreeNode  # node ending at the last inserted page (the root for an empty insert)
    pages: list[int]  # canonical pages of the whole inserted prefix (a fresh list)
    num_cached_before: int  # leading tokens that were cached (on the device) before this insert
