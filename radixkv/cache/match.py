"""Prefix lookup: the bodies of RadixCache.match_prefix and peek_prefix.

Both take the query already in the key encoding (``qb``: bytes, or a read-only byte
memoryview of the caller's array; see tokens.py) and follow it down the namespace's trie with
``TrieStore._walk``. Contract:

* only whole pages match; a query shorter than a page, or a namespace that holds nothing,
  matches nothing (``match_encoded`` then returns the global root);
* token ids are range-checked only past the matched part (that part equals stored keys, which
  were checked when inserted), and a bad id raises before anything changes;
* ``match_encoded`` then counts the query in the stats, splits the node the match ends inside
  (so the returned node ends exactly at the match), bumps the logical clock once, refreshes
  ``last_access`` and ``hit_count`` along the path and the eviction key of the last node;
* ``peek_encoded`` changes nothing: no split, no refresh, no stats.

They are functions over the cache, not methods, only to keep radix_cache.py short: the public
methods call them directly, one call per query, as they called private methods before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.cache.results import MatchResult, new_result
from radixkv.cache.tokens import TOKEN_SHIFT, check_range

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache


def match_encoded(cache: RadixCache, qb: bytes | memoryview, namespace: Any) -> MatchResult:
    """``cache.match_prefix`` on an encoded query (see the module docstring)."""
    start = cache.root if namespace is None else cache._ns_roots.get(namespace)
    limit = len(qb) - len(qb) % cache._pb
    if start is None or limit == 0:
        check_range(qb)
        path, off, partial = [], 0, None
    else:
        path, off, partial = cache._walk(start, qb, limit)
        # The matched part equals stored (validated) keys: only the rest needs checking.
        check_range(qb, off + (partial[1] * cache._pb if partial else 0))
    cache._match_queries += 1
    cache._query_tokens += len(qb) >> TOKEN_SHIFT
    if partial is not None:
        child, m = partial
        path.append(cache._split(child, m))
        off += m * cache._pb
    if not path:
        return MatchResult(cache.root, [], 0)
    cache._clock += 1
    clock = cache._clock
    pages: list[int] = []
    for n in path:
        n.last_access = clock
        n.hit_count += 1
        pages += n._pages
    last = path[-1]
    if last._ekey is not None:
        cache._index.refresh(last)
    ntok = off >> TOKEN_SHIFT
    cache._hit_tokens += ntok
    return new_result(MatchResult, (last, pages, ntok))


def peek_encoded(cache: RadixCache, qb: bytes | memoryview, namespace: Any) -> int:
    """``cache.peek_prefix`` on an encoded query: matched tokens, changing nothing."""
    start = cache.root if namespace is None else cache._ns_roots.get(namespace)
    limit = len(qb) - len(qb) % cache._pb
    if start is None or limit == 0:
        check_range(qb)
        return 0
    _, off, partial = cache._walk(start, qb, limit)
    if partial is not None:
        off += partial[1] * cache._pb
    check_range(qb, off)
    return off >> TOKEN_SHIFT
