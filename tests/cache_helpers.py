"""Shared helpers for the cache tests (not a test module)."""

from __future__ import annotations

from typing import Any

from radixkv.cache import PagePool, RadixCache, TieredRadixCache
from radixkv.cache.hashing import default_hash_fn


def constant_hash(page: bytes) -> int:
    """Every page collides: the trie must still be exact (tokens are compared)."""
    return 7


# The default (children keyed by their first page's bytes), a real hash (XXH3-64: the
# user-hash path without collisions) and a constant one (every child in one bucket).
HASH_FNS = {"page-bytes": None, "xxh3": default_hash_fn, "constant": constant_hash}


def make_cache(
    num_pages: int = 64, page_size: int = 4, policy: str = "lru", hash_fn: Any = None
) -> RadixCache:
    return RadixCache(PagePool(num_pages), page_size=page_size, policy=policy, hash_fn=hash_fn)


def snapshot(cache: RadixCache) -> tuple:
    """Everything observable about a cache and its pool (for 'unchanged on error' checks)."""
    pool = cache.pool
    return (
        cache.pretty(max_tokens_shown=10_000),
        bytes(pool._state),
        list(pool._free),
        cache.stats,
        [n.node_id for n in cache.eviction_order()],
        cache._clock,
    )


def fill(cache: RadixCache, tokens: list[int], namespace: Any = None) -> Any:
    """Insert ``tokens`` (whole pages) the way the engine does: match, alloc the rest, insert."""
    m = cache.match_prefix(tokens, namespace)
    cache.lock(m.node)
    n_new = len(tokens) // cache.page_size - len(m.pages)
    new = cache.alloc(n_new)
    r = cache.insert(tokens, m.pages + new, namespace)
    cache.unlock(m.node)
    return r


class CopyFailed(RuntimeError):
    """What FakeCopier's failing copies raise."""


class FakeHandle:
    """A FakeCopier copy: runs when completed by the test, or when waited for."""

    def __init__(self, copier: FakeCopier, pairs: list[tuple[int, int]], to_host: bool) -> None:
        self.copier = copier
        self.pairs = pairs
        self.to_host = to_host
        self.fail = False
        self.finished = False

    def run(self) -> None:
        c = self.copier
        src, dst = (c.dev, c.host) if self.to_host else (c.host, c.dev)
        for s, d in self.pairs:
            dst[d] = "garbage" if self.fail else src.get(s, "never written")
        self.finished = True
        c.pending.remove(self)

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        if not self.finished:  # one ordered worker: everything issued before runs first
            while not self.finished:
                self.copier.pending[0].run()
        if self.fail:
            raise CopyFailed("injected copy failure")


class FakeCopier:
    """A Copier over Python dicts: ``dev[page]`` / ``host[page]`` hold what a page contains.

    Synchronous (every copy runs when issued) or asynchronous (copies wait in ``pending``,
    in order, until ``complete(k)`` or a ``wait()``). ``fail_issue`` (a set of directions,
    "to_host" / "to_device") makes the next call in that direction raise; ``fail_copy`` makes
    the next copy in that direction fail (its destinations then hold "garbage"). Every issue
    asserts the Copier contract the cache promises: distinct destinations, and no page of the
    call in a copy still pending.
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self.dev: dict[int, Any] = {}
        self.host: dict[int, Any] = {}
        self.pending: list[FakeHandle] = []
        self.fail_issue: set[str] = set()
        self.fail_copy: set[str] = set()
        self.issued = 0

    def busy_pages(self) -> tuple[set[int], set[int]]:
        """(device pages, host pages) in copies still pending."""
        dev: set[int] = set()
        host: set[int] = set()
        for h in self.pending:
            for s, d in h.pairs:
                (dev.add(s), host.add(d)) if h.to_host else (host.add(s), dev.add(d))
        return dev, host

    def _issue(self, pairs: list[tuple[int, int]], to_host: bool) -> FakeHandle:
        direction = "to_host" if to_host else "to_device"
        if direction in self.fail_issue:
            self.fail_issue.discard(direction)
            raise CopyFailed("injected issue failure")
        pairs = [(int(s), int(d)) for s, d in pairs]
        assert pairs and len({d for _, d in pairs}) == len(pairs)
        busy_dev, busy_host = self.busy_pages()
        for s, d in pairs:
            dp, hp = (s, d) if to_host else (d, s)
            assert dp not in busy_dev and hp not in busy_host, "page copied twice at once"
        h = FakeHandle(self, pairs, to_host)
        h.fail = direction in self.fail_copy
        self.fail_copy.discard(direction)
        self.pending.append(h)
        self.issued += 1
        if not self.asynchronous:
            h.run()
        return h

    def to_host(self, pairs: list[tuple[int, int]]) -> FakeHandle:
        return self._issue(pairs, True)

    def to_device(self, pairs: list[tuple[int, int]]) -> FakeHandle:
        return self._issue(pairs, False)

    def complete(self, k: int = 1 << 30) -> None:
        """Run the first ``k`` pending copies."""
        for _ in range(min(k, len(self.pending))):
            self.pending[0].run()


def make_tiered(
    num_pages: int = 16,
    host_pages: int = 32,
    page_size: int = 2,
    write_policy: str = "write_through",
    asynchronous: bool = False,
    hash_fn: Any = None,
    **kw: Any,
) -> tuple[TieredRadixCache, FakeCopier]:
    copier = FakeCopier(asynchronous)
    cache = TieredRadixCache(
        PagePool(num_pages),
        page_size=page_size,
        hash_fn=hash_fn,
        host_pool=PagePool(host_pages),
        copier=copier,
        write_policy=write_policy,
        **kw,
    )
    return cache, copier


def node_tokens(node: Any) -> list[int]:
    """Tokens from the root down to the end of ``node``."""
    parts = []
    while node is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def serve(cache: RadixCache, copier: FakeCopier, tokens: list[int], namespace: Any = None) -> Any:
    """The engine's flow with a host tier: match, load back, lock, wait, alloc the rest, write
    the new pages' content (as a forward would), insert, unlock. Returns the InsertResult."""
    ps = cache.page_size
    m = cache.match_prefix(tokens, namespace)
    lb = cache.load_back(m)
    cache.lock(lb.node)
    if not cache.wait_load(lb):
        cache.unlock(lb.node)
        m = cache.match_prefix(tokens, namespace)
        lb = cache.load_back(m._replace(host_node=m.node))  # no second try: a miss
        cache.lock(lb.node)
    for i, p in enumerate(lb.pages):
        assert copier.dev[p] == (namespace, tuple(tokens[: (i + 1) * ps])), (i, p)
    k = len(lb.pages)
    new = cache.alloc(len(tokens) // ps - k)
    assert not set(new) & copier.busy_pages()[0], "a page still being copied was handed out"
    for i, p in enumerate(new, start=k):
        copier.dev[p] = (namespace, tuple(tokens[: (i + 1) * ps]))
    r = cache.insert(tokens[: len(tokens) // ps * ps], lb.pages + new, namespace)
    cache.unlock(lb.node)
    return r
