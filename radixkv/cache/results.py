"""MatchResult and InsertResult: what ``RadixCache.match_prefix`` and ``insert`` return.

RadixCache's docstring says who owns the pages they name and for how long they are valid.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from radixkv.cache.node import TreeNode, path_pages

__all__ = ["InsertResult", "MatchResult"]


class MatchResult:
    """What ``RadixCache.match_prefix`` returns (see RadixCache for who owns the pages).

    The first three fields are the device-resident prefix. The last three describe the
    continuation found in the host tier right after it (always empty without a host tier):
    ``load_back(match)`` turns it into device pages.

    ``pages`` is built when first read, from ``node``'s path (then kept): a match that is
    only probed (how much is cached? which node to lock?) builds no page list, as SGLang's
    cores hand out the matched slots only on a second call. The list is the same either way,
    as long as the result is read while it is valid: before the next call that may evict, or
    while ``node`` is locked (the rule for every result; splits and inserts below ``node``
    never change the pages of its path). Read-only by convention (slots, not a tuple);
    iterates, unpacks, indexes and compares in field order, like the named tuple it replaces.
    """

    __slots__ = ("_pages", "host_node", "host_pages", "node", "num_host_tokens", "num_tokens")
    _fields = ("node", "pages", "num_tokens", "host_node", "host_pages", "num_host_tokens")

    node: TreeNode  # deepest matched device-resident node (the root when none); lock this
    num_tokens: int  # matched device-resident tokens, a multiple of page_size
    host_node: TreeNode | None  # deepest node of the host continuation (node when none)
    host_pages: Sequence[int]  # host pages of the continuation, in order
    num_host_tokens: int  # tokens of the continuation, a multiple of page_size

    def __init__(
        self,
        node: TreeNode,
        pages: list[int] | None,
        num_tokens: int,
        host_node: TreeNode | None = None,
        host_pages: Sequence[int] = (),
        num_host_tokens: int = 0,
    ) -> None:
        # RadixCache's hot path fills the slots itself (object.__new__), skipping this call.
        self.node = node
        self._pages = pages  # None: not built yet (read ``pages``)
        self.num_tokens = num_tokens
        self.host_node = host_node
        self.host_pages = host_pages
        self.num_host_tokens = num_host_tokens

    @property
    def pages(self) -> list[int]:
        """Device pages of the matched prefix, in order (one list, built on first read)."""
        p = self._pages
        if p is None:
            p = self._pages = path_pages(self.node) if self.num_tokens else []
        return p

    def __iter__(self) -> Iterator[Any]:
        return iter((self.node, self.pages, self.num_tokens, self.host_node, self.host_pages,
                     self.num_host_tokens))  # fmt: skip

    def __getitem__(self, i: int | slice) -> Any:
        return tuple(self)[i]

    def __len__(self) -> int:
        return 6

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MatchResult | tuple):  # a tuple of the fields, as before
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # pages is a list, as in the named tuple

    def _replace(self, **fields: Any) -> MatchResult:
        """A copy with some fields replaced (named-tuple style)."""
        unknown = set(fields) - set(self._fields)
        if unknown:
            raise TypeError(f"MatchResult has no field(s) {sorted(unknown)}")
        values = dict(zip(self._fields, self))
        values.update(fields)
        return MatchResult(**values)

    def __repr__(self) -> str:
        body = ", ".join(f"{f}={v!r}" for f, v in zip(self._fields, self))
        return f"MatchResult({body})"


class InsertResult(NamedTuple):
    """What ``RadixCache.insert`` returns (see RadixCache for who owns the pages)."""

    node: TreeNode  # node ending at the last inserted page (the root for an empty insert)
    pages: list[int]  # canonical pages of the whole inserted prefix (a fresh list)
    num_cached_before: int  # leading tokens that were cached (on the device) before this insert
