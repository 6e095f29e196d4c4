"""Engine-wide invariants: the cache's, the scheduler's, and who holds which page."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.engine import Engine


def check_engine_invariants(engine: Engine) -> None:
    """Raise AssertionError unless: the cache's and the scheduler's invariants hold;
    free + cached + private == total pages; each running sequence's shared pages are exactly
    its locked node's path; no page is held twice. When nothing is queued or running and no
    session pins anything: every lock count is zero and no private page remains."""
    engine.cache.check_invariants()
    engine.scheduler.check_invariants()
    pool, cache, kv = engine.pool, engine.cache, engine._seqkv
    total = pool.num_free + cache.num_cached_pages + kv.num_private_pages
    assert total == pool.num_pages, (
        f"pages: free {pool.num_free} + cached {cache.num_cached_pages} + private "
        f"{kv.num_private_pages} != {pool.num_pages}"
    )
    seen: set[int] = set()
    for node in cache.iter_nodes():
        seen.update(node.pages)
    for s in engine.scheduler.running:
        if s.locked_node is not None:
            # the root's own count is not kept (locking it is a no-op)
            assert s.locked_node is cache.root or s.locked_node.lock_ref > 0, (
                f"{s}: locked node has lock_ref 0"
            )
            path = cache.path_pages(s.locked_node)
            assert path == s.page_table[: s.num_shared_pages], f"{s}: shared pages != path"
        private = s.page_table[s.num_shared_pages :]
        assert seen.isdisjoint(private), f"{s}: a private page is also elsewhere"
        seen.update(private)
    assert len(seen) + pool.num_free == pool.num_pages, "a page is held twice"
    if not engine._groups and not engine._num_pins:
        assert kv.num_private_pages == 0, "private pages remain after drain"
        for node in cache.iter_nodes():
            if node.parent is not None:
                assert node.lock_ref == 0, f"lock_ref {node.lock_ref} after drain"
