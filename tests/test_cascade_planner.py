"""The cascade planner on hand-built and random trie shapes: grouping, levels, fallback, exactness."""

from __future__ import annotations

import random

import pytest
import torch
from cascade_helpers import check_shared_pages, random_kv, reference_decode

from radixkv.attention.cascade import cascade_attention
from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry


class FakeNode:
    """Just the attributes the planner reads (INTERFACES.md node contract)."""

    def __init__(self, parent: FakeNode | None, pages: list[int], page_size: int) -> None:
        self.parent = parent
        self.pages = pages
        self.num_tokens = len(pages) * page_size

    def path_pages(self) -> list[int]:
        out: list[int] = []
        n: FakeNode | None = self
        while n is not None:
            out = n.pages + out
            n = n.parent
        return out


class PageIds:
    def __init__(self, seed: int) -> None:
        self.free = list(range(4000))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


def _entry(node: FakeNode | None, ids: PageIds, own_tokens: int, ps: int) -> DecodeEntry:
    shared = node.path_pages() if node is not None else []
    private = ids.take(-(-own_tokens // ps))
    return DecodeEntry(node, shared + private, len(shared) * ps + own_tokens, len(shared))


def _check_exact(decision, entries, ps: int, h_q: int = 8, h_kv: int = 2, d: int = 16) -> None:
    k, v = random_kv(4000, ps, h_kv, d, seed=len(entries))
    q = torch.randn(len(entries), h_q, d, generator=torch.Generator().manual_seed(1))
    tables = [entries[i].page_table for i in decision.order]
    lens = [entries[i].seq_len for i in decision.order]
    ref = reference_decode(q, k, v, tables, lens)
    out = cascade_attention(q, k, v, decision.plan)
    assert (out.double() - ref).abs().max().item() <= 1e-5
    assert sorted(decision.order) == list(range(len(entries)))
    assert decision.kv_tokens_plain == sum(e.seq_len for e in entries)
    assert decision.kv_tokens_cascade == decision.plan.kv_tokens_read()


def _groups_contiguous(decision) -> None:
    for lvl in decision.plan.levels:
        assert lvl.qo_indptr[-1] <= decision.plan.num_queries
        assert list(lvl.qo_indptr) == sorted(lvl.qo_indptr)


@pytest.mark.parametrize("page_size", [1, 16])
def test_one_group_shares_trunk_once(page_size: int) -> None:
    ids = PageIds(0)
    trunk = FakeNode(None, ids.take(64 // page_size * 4), page_size)  # 256 tokens
    entries = [_entry(trunk, ids, 5 + 3 * r, page_size) for r in range(6)]
    dec = check_shared_pages(CascadePlanner(page_size, mode="on").plan(entries), entries)
    assert dec.use_cascade and dec.num_levels == 2 and dec.num_shared_segments == 1
    assert dec.kv_tokens_cascade == 256 + sum(5 + 3 * r for r in range(6))
    assert dec.plan.levels[0].qo_indptr == (0, 6)
    _check_exact(dec, entries, page_size)


def test_interleaved_groups_are_made_contiguous_and_nested_levels() -> None:
    ps = 4
    ids = PageIds(1)
    trunk = FakeNode(None, ids.take(8), ps)
    a = FakeNode(trunk, ids.take(3), ps)
    a1 = FakeNode(a, ids.take(2), ps)
    b = FakeNode(trunk, ids.take(5), ps)
    other = FakeNode(None, ids.take(6), ps)
    nodes = [a1, b, None, a1, trunk, b, other, a, other, a1]
    entries = [_entry(n, ids, 2 + r, ps) for r, n in enumerate(nodes)]
    dec = check_shared_pages(CascadePlanner(ps, mode="on").plan(entries), entries)
    assert dec.use_cascade
    # levels: trunk / {other} ; a / b ; a1 ; unique
    assert dec.num_levels == 4
    node_of_row = [nodes[i] for i in dec.order]
    # every group (same node) is one contiguous run of rows
    for n in set(map(id, nodes)):
        rows = [r for r, x in enumerate(node_of_row) if id(x) == n]
        assert rows == list(range(rows[0], rows[0] + len(rows)))
    shared_tokens = (8 + 3 + 2 + 5 + 6) * ps
    private_tokens = sum(2 + r for r in range(10))
    assert dec.kv_tokens_cascade == shared_tokens + private_tokens
    _groups_contiguous(dec)
    _check_exact(dec, entries, ps)


def test_auto_falls_back_to_plain_when_sharing_is_small() -> None:
    ps = 16
    ids = PageIds(2)
    small = FakeNode(None, ids.take(1), ps)  # 16 shared tokens
    entries = [_entry(small, ids, 300, ps) for _ in range(4)]
    auto = CascadePlanner(ps, mode="auto").plan(entries)
    assert not auto.use_cascade and auto.num_levels == 1
    assert auto.kv_tokens_cascade == auto.kv_tokens_plain
    assert auto.order == (0, 1, 2, 3)
    on = CascadePlanner(ps, mode="on").plan(entries)
    assert on.use_cascade and on.kv_tokens_cascade == 16 + 4 * 300
    off = CascadePlanner(ps, mode="off").plan(entries)
    assert not off.use_cascade
    for dec in (auto, on, off):
        _check_exact(dec, entries, ps)


def test_auto_needs_enough_saved_tokens_per_step() -> None:
    ps = 16
    ids = PageIds(6)
    trunk = FakeNode(None, ids.take(40), ps)  # 640 tokens shared by 3: saves 1280 a step
    entries = [_entry(trunk, ids, 10, ps) for _ in range(3)]
    assert not CascadePlanner(ps, mode="auto").plan(entries).use_cascade
    low = CascadePlanner(ps, mode="auto", min_step_saved_tokens=1024).plan(entries)
    assert low.use_cascade and low.kv_tokens_cascade == 640 + 30
    with pytest.raises(ValueError, match="min_step_saved_tokens"):
        CascadePlanner(ps, min_step_saved_tokens=-1)


@pytest.mark.parametrize(("dtype", "tokens"), [("float32", 5120), ("bfloat16", 4096)])
def test_engine_threshold_by_kv_dtype(dtype: str, tokens: int) -> None:
    """The engine's "auto" threshold for radixkv-tiny is 5,120 saved tokens in fp32 and 4,096
    in bf16: the CPU kernels' plain decode costs more per token in bf16, so the cascade pays
    sooner (cascade_planner docstring)."""
    from radixkv.engine.engine import Engine
    from radixkv.model.loader import load_model

    engine = Engine(load_model("radixkv-tiny", dtype=dtype), cascade="auto")
    assert engine.kv_pool.dtype == getattr(torch, dtype)
    assert engine.cascade_planner.min_step_saved_tokens == tokens


def test_auto_threshold_on_both_sides() -> None:
    """With the engine's defaults for radixkv-tiny (128 K+V values per token and layer: the
    cascade pays from 5,120 saved tokens a step in fp32, bench/bench_cascade.py), "auto" plans
    plain decode one token below the threshold and the cascade just above it."""
    assert CascadePlanner.min_step_tokens_for(128) == 5120
    assert CascadePlanner.min_step_tokens_for(128, 2) == 4096
    assert CascadePlanner.min_step_tokens_for(128, 1) == 5120  # other sizes: fp32's values
    assert CascadePlanner.min_step_tokens_for(2048) == 320  # 8 kv heads x 128 dims
    assert CascadePlanner.min_step_tokens_for(2048, 2) == 256
    with pytest.raises(ValueError, match="kv_values_per_token"):
        CascadePlanner.min_step_tokens_for(0)
    planner = CascadePlanner(1, mode="auto", min_step_saved_tokens=4096)
    # four requests on a trunk of T tokens save 3T: 4,095 and 4,098
    for trunk_len, want in ((1365, False), (1366, True)):
        ids = PageIds(7)
        trunk = FakeNode(None, ids.take(trunk_len), 1)
        entries = [_entry(trunk, ids, 30, 1) for _ in range(4)]
        dec = planner.plan(entries)
        assert dec.kv_tokens_plain - (trunk_len + 120) == 3 * trunk_len
        assert dec.use_cascade is want
        assert dec.kv_tokens_cascade == (trunk_len + 120 if want else dec.kv_tokens_plain)
        _check_exact(dec, entries, 1)


def test_auto_keeps_big_segments_and_dissolves_small_ones() -> None:
    """A 1-page trunk under two 64-page branches: the trunk is read per request, branches once."""
    ps = 16
    ids = PageIds(3)
    trunk = FakeNode(None, ids.take(1), ps)
    a = FakeNode(trunk, ids.take(64), ps)
    b = FakeNode(trunk, ids.take(64), ps)
    entries = [_entry(n, ids, 20, ps) for n in [a, b, a, b, a, b]]
    planner = CascadePlanner(ps, mode="auto", min_saved_tokens=256)
    dec = check_shared_pages(planner.plan(entries), entries)
    assert dec.use_cascade and dec.num_levels == 2 and dec.num_shared_segments == 2
    assert dec.kv_tokens_cascade == 2 * 64 * ps + 6 * (ps + 20)
    _check_exact(dec, entries, ps)


def test_no_sharing_and_single_entry_are_plain() -> None:
    ps = 2
    ids = PageIds(4)
    entries = [_entry(FakeNode(None, ids.take(3), ps), ids, 3, ps) for _ in range(3)]
    dec = CascadePlanner(ps, mode="on").plan(entries)
    assert not dec.use_cascade
    _check_exact(dec, entries, ps)
    one = CascadePlanner(ps, mode="on").plan(entries[:1])
    assert not one.use_cascade and one.order == (0,)


def test_bad_input_rejected() -> None:
    ps = 4
    ids = PageIds(5)
    node = FakeNode(None, ids.take(2), ps)
    planner = CascadePlanner(ps, mode="on")
    with pytest.raises(ValueError, match="empty"):
        planner.plan([])
    with pytest.raises(ValueError, match="trie path holds 2 pages"):
        planner.plan([DecodeEntry(node, [*node.pages, 7], 9, 1)] * 2)
    with pytest.raises(ValueError, match="never shared"):
        planner.plan([DecodeEntry(node, node.pages, 8, 2)])
    with pytest.raises(ValueError, match="needs 3 pages"):
        planner.plan([DecodeEntry(node, node.pages, 9, 2)])
    good = _entry(node, ids, 3, ps)
    bad = DecodeEntry(node, [node.pages[0], 999, *ids.take(1)], 9, 2)
    with pytest.raises(ValueError, match="differ"):
        check_shared_pages(planner.plan([good, bad]), [good, bad])
    with pytest.raises(ValueError, match="cascade mode"):
        CascadePlanner(ps, mode="sometimes")


@pytest.mark.parametrize("seed", range(6))
def test_random_forests_exact(seed: int) -> None:
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4, 16])
    ids = PageIds(seed)
    nodes: list[FakeNode | None] = [None]
    for _ in range(rng.randint(1, 12)):
        parent = rng.choice(nodes)
        nodes.append(FakeNode(parent, ids.take(rng.randint(1, 4)), ps))
    entries = [
        _entry(rng.choice(nodes), ids, rng.randint(1, 3 * ps), ps)
        for _ in range(rng.randint(1, 14))
    ]
    mode = rng.choice(["on", "auto"])
    dec = CascadePlanner(ps, mode=mode, min_saved_tokens=4, min_step_saved_tokens=8).plan(entries)
    check_shared_pages(dec, entries)
    _groups_contiguous(dec)
    _check_exact(dec, entries, ps, h_q=4, h_kv=rng.choice([1, 2, 4]), d=8)
    if dec.use_cascade:
        assert dec.kv_tokens_cascade < dec.kv_tokens_plain
    # the same entries column by column (the engine's call), unchecked levels: the same plan
    cols = CascadePlanner(
        ps, mode=mode, min_saved_tokens=4, min_step_saved_tokens=8, check_entries=False
    ).plan_columns(*(list(c) for c in zip(*entries, strict=True)))
    assert (cols.order, cols.use_cascade, cols.kv_tokens_cascade) == (
        dec.order, dec.use_cascade, dec.kv_tokens_cascade
    )  # fmt: skip
    assert cols.plan == dec.plan


def test_plan_columns_rejects_ragged_columns() -> None:
    planner = CascadePlanner(4)
    with pytest.raises(ValueError, match="differ in length"):
        planner.plan_columns([None, None], [[1], [2]], [1], [0, 0])
    with pytest.raises(ValueError, match="empty"):
        planner.plan_columns([], [], [], [])


@pytest.mark.parametrize(
    ("windows", "cascade"),
    [((), True), ((300, 300), True), ((276, 276), True), ((275, 275), False), ((275, 0), True),
     ((100, 275), False)],
)  # fmt: skip
def test_sliding_windows_shorter_than_every_row_make_it_plain(
    windows: tuple[int, ...], cascade: bool
) -> None:
    """A layer whose window a row outgrows attends without the cascade; when that is every
    layer, the step is planned plain (the longest row here: 256 shared + 20 own tokens)."""
    ids = PageIds(5)
    trunk = FakeNode(None, ids.take(16), 16)  # 256 tokens
    entries = [_entry(trunk, ids, 5 + 3 * r, 16) for r in range(6)]
    planner = CascadePlanner(16, mode="on", layer_windows=windows)
    assert planner.plan(entries).use_cascade is cascade
