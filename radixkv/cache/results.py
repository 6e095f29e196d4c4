"""MatchResult and InsertResult: what RadixCache.match_prefix and insert return.

Contract: ``node`` is the trie node to ``lock`` (the root when nothing matched or nothing was
inserted), ``pages`` is a fresh list the caller may keep, and token counts are multiples of
page_size. The pages stay owned by the trie: a result whose node is not locked is only valid
until the next call that may evict (see radix_cache.py).

The hot paths build results with ``new_result(Cls, (node, pages, n))``, i.e. ``tuple.__new__``,
which skips the NamedTuple's Python-level ``__new__``; the fields and the type are the same.
"""

from __future__ import annotations

from typing import NamedTuple

from radixkv.cache.node import TreeNode


class MatchResult(NamedTuple):
    node: TreeNode  # deepest matched node (the root when nothing matched); lock this
    pages: list[int]  # cached pages of the matched prefix, in order (a fresh list)
    num_tokens: int  # matched tokens, a multiple of page_size


class InsertResult(NamedTuple):
    node: TreeNode  # node ending at the last inserted page (the root for an empty insert)
    pages: list[int]  # canonical pages of the whole inserted prefix
    num_cached_before: int  # leading tokens that were cached before this insert


new_result = tuple.__new__  # builds the NamedTuples without their Python-level __new__
