"""The cascade planner on real RadixCache trees: requests lock matched nodes, the trie splits
under them as other branches are inserted, and the plan stays exact."""

from __future__ import annotations

import random

import pytest
import torch
from cascade_helpers import check_shared_pages, random_kv, reference_decode

from radixkv.attention.cascade import cascade_attention
from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache
from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry


class Running:
    """A decoding request as the engine holds it: a locked node plus private pages."""

    def __init__(self, cache: RadixCache, tokens: list[int], extra: int) -> None:
        m = cache.match_prefix(tokens)
        cache.lock(m.node)
        self.node = m.node
        self.shared = list(m.pages)
        ps = cache.page_size
        self.seq_len = m.num_tokens + extra
        n_private = -(-self.seq_len // ps) - len(self.shared)
        self.private = cache.alloc(n_private)

    def entry(self, cache: RadixCache) -> DecodeEntry:
        shared = cache.path_pages(self.node)
        assert shared == self.shared  # splits never change a locked path's pages
        return DecodeEntry(self.node, shared + self.private, self.seq_len, len(shared))


def _insert(cache: RadixCache, tokens: list[int]) -> None:
    ps = cache.page_size
    n = len(tokens) // ps
    m = cache.match_prefix(tokens)
    fresh = cache.alloc(n - len(m.pages))
    r = cache.insert(tokens[: n * ps], list(m.pages) + fresh)
    del r


def _exact(cache: RadixCache, running: list[Running], planner: CascadePlanner):
    entries = [r.entry(cache) for r in running]
    dec = check_shared_pages(planner.plan(entries), entries)
    ps = cache.page_size
    k, v = random_kv(cache.pool.num_pages, ps, 2, 16, seed=len(entries))
    q = torch.randn(len(entries), 4, 16, generator=torch.Generator().manual_seed(0))
    tables = [entries[i].page_table for i in dec.order]
    lens = [entries[i].seq_len for i in dec.order]
    out = cascade_attention(q, k, v, dec.plan)
    ref = reference_decode(q, k, v, tables, lens)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    return dec


@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_of_thought_branches_share_the_prompt(page_size: int) -> None:
    cache = RadixCache(PagePool(2000), page_size=page_size)
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(8 * 16)]
    _insert(cache, prompt)
    running = [Running(cache, [*prompt, 5000 + b], 3 + b) for b in range(5)]
    dec = _exact(cache, running, CascadePlanner(page_size, mode="on"))
    assert dec.use_cascade and dec.num_levels == 2
    assert dec.kv_tokens_cascade == 128 + sum(3 + b for b in range(5))
    cache.check_invariants()


def test_nested_branches_after_splits_under_locked_nodes() -> None:
    ps = 4
    cache = RadixCache(PagePool(2000), page_size=ps)
    rng = random.Random(1)
    trunk = [rng.randrange(1000) for _ in range(32)]
    a = [*trunk, *[rng.randrange(1000) for _ in range(16)]]
    _insert(cache, a)
    r_a = [Running(cache, [*a, 1], 2), Running(cache, [*a, 2], 5)]
    # a second branch diverging mid-way through the locked node splits it under r_a
    b = [*trunk, *[rng.randrange(1000) for _ in range(12)]]
    _insert(cache, b)
    r_b = [Running(cache, [*b, 3], 1), Running(cache, [*b, 4], 4), Running(cache, [*b, 5], 7)]
    # deeper sharing under a: a1 extends a
    a1 = [*a, *[rng.randrange(1000) for _ in range(8)]]
    _insert(cache, a1)
    r_a1 = [Running(cache, [*a1, 6], 3), Running(cache, [*a1, 7], 2)]
    lone = Running(cache, [rng.randrange(1000) for _ in range(9)], 9)  # nothing cached
    running = [r_b[0], r_a1[0], lone, r_a[0], r_b[1], r_a1[1], r_a[1], r_b[2]]
    dec = _exact(cache, running, CascadePlanner(ps, mode="on"))
    # trunk (shared by 7) / a (4), b (3) / a1 (2) / own
    assert dec.num_levels == 4
    assert dec.num_shared_segments == 4
    shared = 32 + 16 + 12 + 8
    assert dec.kv_tokens_cascade == shared + sum(r.seq_len - len(r.shared) * ps for r in running)
    for r in running:
        cache.unlock(r.node)
    cache.check_invariants()


def test_decode_steps_reuse_the_shared_levels_and_stay_exact() -> None:
    """One planner over consecutive decode steps: while the same nodes stay locked only the
    private level is rebuilt (the shared level is the same object), also after another branch
    splits the locked node under the running requests; a request locking a new node rebuilds."""
    ps = 4
    cache = RadixCache(PagePool(2000), page_size=ps)
    rng = random.Random(2)
    prompt = [rng.randrange(1000) for _ in range(40)]
    _insert(cache, prompt)
    running = [Running(cache, [*prompt, 100 + b], 2 + b) for b in range(4)]
    planner = CascadePlanner(ps, mode="on")
    first = _exact(cache, running, planner)
    shared_level = first.plan.levels[0]
    for step in range(6):  # each request decodes a token: private pages grow now and then
        for r in running:
            r.seq_len += 1
            if -(-r.seq_len // ps) > len(r.shared) + len(r.private):
                r.private += cache.alloc(1)
        if step == 2:  # a branch diverging inside the locked prompt node splits it
            _insert(cache, [*prompt[:20], *[rng.randrange(1000) for _ in range(8)]])
        dec = _exact(cache, running, planner)
        assert dec.plan.levels[0] is shared_level
        assert dec.kv_tokens_cascade == 40 + sum(r.seq_len - 40 for r in running)
    newcomer = Running(cache, [*prompt[:20], 7], 3)  # locks the upper node of the split
    dec = _exact(cache, [*running, newcomer], planner)
    assert dec.plan.levels[0] is not shared_level
    for r in [*running, newcomer]:
        cache.unlock(r.node)
    cache.check_invariants()


def test_private_level_reused_over_tables_grown_in_place() -> None:
    """As the engine holds them, each request's page table is one list grown in place as it
    decodes, and a finished request's row is taken by a newcomer on the same node: the planner
    kept over the steps plans exactly what a fresh planner plans from the same entries."""
    ps = 4
    cache = RadixCache(PagePool(2000), page_size=ps)
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(24)]
    _insert(cache, prompt)
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    shared = list(m.pages)
    lens = [25 + b for b in range(5)]
    tables = [shared + cache.alloc(-(-n // ps) - len(shared)) for n in lens]
    kept = CascadePlanner(ps, mode="on")
    for step in range(12):
        entries = [DecodeEntry(m.node, t, n, len(shared)) for t, n in zip(tables, lens)]
        got = kept.plan(entries).plan
        want = CascadePlanner(ps, mode="on").plan(entries).plan
        assert got.levels == want.levels, step
        for b, t in enumerate(tables):  # each request decodes a token
            lens[b] += 1
            if -(-lens[b] // ps) > len(t):
                t.extend(cache.alloc(1))  # in place, as SeqKV.reserve does
        if step == 6:  # request 2 finishes; a newcomer on the same node takes its row
            cache.pool.free(tables[2][len(shared) :])
            lens[2] = 26
            tables[2] = shared + cache.alloc(-(-lens[2] // ps) - len(shared))
    cache.unlock(m.node)


def test_publishing_under_own_branch_reuses_the_shared_part_exactly() -> None:
    """Each step some requests complete a page and publish it under their own branch (their
    lock moves one node down): the planner kept over the steps reuses its shared part (the
    same levels object) and plans exactly what a fresh planner plans."""
    ps = 4
    cache = RadixCache(PagePool(4000), page_size=ps)
    rng = random.Random(9)
    prompt = [rng.randrange(1000) for _ in range(40)]
    _insert(cache, prompt)
    # each request has a branch of its own already (one published page below the prompt)
    tokens = [[*prompt, *[rng.randrange(1000) for _ in range(ps + 1 + b)]] for b in range(6)]
    nodes = []
    for t in tokens:
        _insert(cache, t)
        m = cache.match_prefix(t)
        cache.lock(m.node)
        nodes.append(m.node)
    kept = CascadePlanner(ps, mode="on", check_entries=False)
    checked = CascadePlanner(ps, mode="on", check_entries=True)  # asserts reuse == build

    def entries() -> list[DecodeEntry]:
        out = []
        for node, t in zip(nodes, tokens):
            shared = cache.path_pages(node)
            private = list(range(3000 + 10 * len(out), 3000 + 10 * len(out) + 3))
            n = len(t) + 1
            need = -(-n // ps) - len(shared)
            out.append(DecodeEntry(node, shared + private[:need], n, len(shared)))
        return out

    first = kept.plan(entries())
    levels = first.plan.levels[0]
    for step in range(8):
        for b in (step % 6, (step + 3) % 6):  # two requests publish a page of their own
            tokens[b] += [rng.randrange(1000) for _ in range(ps)]
            _insert(cache, tokens[b])
            m = cache.match_prefix(tokens[b])
            cache.lock(m.node)
            cache.unlock(nodes[b])
            nodes[b] = m.node
        es = entries()
        got = kept.plan(es)
        want = CascadePlanner(ps, mode="on").plan(es)
        assert got.order == want.order and got.plan.levels == want.plan.levels, step
        assert got.plan.levels[0] is levels  # reused, not rebuilt
        checked.plan(es)
    for node in nodes:
        cache.unlock(node)
    cache.check_invariants()
