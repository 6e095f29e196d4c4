"""MatchResult and InsertResult: what ``RadixCache.match_prefix`` and ``insert`` return.

RadixCache's docstring says who owns the pages they name and for how long they are valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from radixkv.cache.node import TreeNode

__all__ = ["InsertResult", "MatchResult"]


class MatchResult(NamedTuple):
    """What ``RadixCache.match_prefix`` returns (see RadixCache for who owns the pages).

    The first three fields are the device-resident prefix. The last three describe the
    continuation found in the host tier right after it (always empty without a host tier):
    ``load_back(match)`` turns it into device pages.
    """

    node: TreeNode  # deepest matched device-resident node (the root when none); lock this
    pages: list[int]  # device pages of the matched prefix, in order (a fresh list)
    num_tokens: int  # matched device-resident tokens, a multiple of page_size
    host_node: TreeNode | None = None  # deepest node of the host continuation (node when none)
    host_pages: Sequence[int] = ()  # host pages of the continuation, in order (a fresh list)
    num_host_tokens: int = 0  # tokens of the continuation, a multiple of page_size


class InsertResult(NamedTuple):
    """What ``RadixCache.insert`` returns (see RadixCache for who owns the pages)."""

    node: TreeNode  # node ending at the last inserted page (the root for an empty insert)
    pages: list[int]  # canonical pages of the whole inserted prefix (a fresh list)
    num_cached_before: int  # leading tokens that were cached (on the device) before this insert
