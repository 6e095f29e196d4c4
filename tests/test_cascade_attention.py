"""Cascade decode attention (torch) equals plain paged decode computed straight from the KV."""

from __future__ import annotations

import pytest
import torch
from cascade_helpers import level, random_kv, reference_decode

from radixkv.attention.cascade import (
    CascadeLevel,
    CascadePlan,
    TorchCascadeAttention,
    cascade_attention,
    merge_state,
)

TOL = 1e-5


@pytest.fixture(params=[True, False], ids=["fused", "matmul"])
def fused_cpu(request: pytest.FixtureRequest) -> bool:
    """Run a test through both the fused CPU kernel (required: a failure raises instead of
    falling back) and the portable matmul path."""
    return bool(request.param)


def _pages(start: int, n: int) -> list[int]:
    # Non-contiguous, shuffled-looking page ids so gathers really index.
    return [(start + 7 * i) % 997 for i in range(n)]


def _check(q, k, v, plan, page_tables, seq_lens, fused_cpu, scale=None):
    ref = reference_decode(q, k, v, page_tables, seq_lens, scale)
    out = cascade_attention(q, k, v, plan, scale, fused_cpu=fused_cpu)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert (out.double() - ref).abs().max().item() <= TOL
    plain_plan = CascadePlan.plain(page_tables, seq_lens, plan.page_size)
    plain = cascade_attention(q, k, v, plain_plan, scale, fused_cpu=fused_cpu)
    assert (plain.double() - ref).abs().max().item() <= TOL
    return out


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("h_q", "h_kv"), [(4, 4), (8, 2)])
def test_one_group(page_size: int, h_q: int, h_kv: int, fused_cpu: bool) -> None:
    d, n_req, shared_tok = 32, 5, 3 * page_size
    k, v = random_kv(1000, page_size, h_kv, d, seed=1)
    shared = _pages(11, shared_tok // page_size)
    tables, lens, uniq = [], [], []
    for r in range(n_req):
        u_len = 1 + 3 * r + (page_size // 2)  # partial last pages of different fill
        u_pages = _pages(300 + 40 * r, -(-u_len // page_size))
        tables.append(shared + u_pages)
        lens.append(shared_tok + u_len)
        uniq.append((1, u_pages, u_len))
    plan = CascadePlan(
        page_size, n_req, (level(page_size, [(n_req, shared, shared_tok)]), level(page_size, uniq))
    )
    q = torch.randn(n_req, h_q, d)
    _check(q, k, v, plan, tables, lens, fused_cpu)
    assert plan.kv_tokens_read() == shared_tok + sum(u[2] for u in uniq)


@pytest.mark.parametrize("page_size", [1, 16])
def test_several_groups_singletons_and_unshared(page_size: int, fused_cpu: bool) -> None:
    """Groups of 3 and 2, a group of size 1 and a request with no shared prefix at all."""
    d, h_q, h_kv = 16, 6, 3
    k, v = random_kv(1000, page_size, h_kv, d, seed=2)
    ga, gb, gc = _pages(1, 4), _pages(50, 2), _pages(90, 3)
    groups = [(ga, 3), (gb, 2), (gc, 1), ([], 1)]
    tables, lens, shared_segs, uniq = [], [], [], []
    r = 0
    for pages, size in groups:
        shared_segs.append((size, pages, len(pages) * page_size))
        for _ in range(size):
            u_len = 2 + 5 * r
            u_pages = _pages(500 + 30 * r, -(-u_len // page_size))
            tables.append(pages + u_pages)
            lens.append(len(pages) * page_size + u_len)
            uniq.append((1, u_pages, u_len))
            r += 1
    plan = CascadePlan(page_size, r, (level(page_size, shared_segs), level(page_size, uniq)))
    q = torch.randn(r, h_q, d)
    _check(q, k, v, plan, tables, lens, fused_cpu)


@pytest.mark.parametrize("page_size", [1, 16])
def test_nested_sharing_four_levels(page_size: int, fused_cpu: bool) -> None:
    """trunk -> {A -> {A1, A2}, B}; plus one request on the trunk only and one with nothing shared."""
    d, h_q, h_kv = 32, 8, 2
    ps = page_size
    k, v = random_kv(1000, ps, h_kv, d, seed=3)
    trunk, a, b, a1, a2 = (
        _pages(3, 5),
        _pages(100, 2),
        _pages(150, 3),
        _pages(200, 1),
        _pages(210, 2),
    )
    # rows: 0,1 -> A1 ; 2 -> A2 ; 3 -> A (no deeper share) ; 4,5 -> B ; 6 -> trunk ; 7 -> nothing
    prefixes = [
        trunk + a + a1,
        trunk + a + a1,
        trunk + a + a2,
        trunk + a,
        trunk + b,
        trunk + b,
        trunk,
        [],
    ]
    tables, lens, uniq = [], [], []
    for r, pre in enumerate(prefixes):
        u_len = 1 + 7 * r
        u_pages = _pages(600 + 20 * r, -(-u_len // ps))
        tables.append(pre + u_pages)
        lens.append(len(pre) * ps + u_len)
        uniq.append((1, u_pages, u_len))
    lv0 = level(ps, [(7, trunk, 5 * ps), (1, [], 0)])
    lv1 = level(ps, [(4, a, 2 * ps), (2, b, 3 * ps), (2, [], 0)])
    # A1 shared by rows 0,1; A2 read by row 2 alone (a size-1 group still in a shared level)
    lv2 = level(ps, [(2, a1, ps), (1, a2, 2 * ps), (5, [], 0)])
    plan = CascadePlan(ps, 8, (lv0, lv1, lv2, level(ps, uniq)))
    q = torch.randn(8, h_q, d)
    _check(q, k, v, plan, tables, lens, fused_cpu)
    # Shared pages read once: trunk + A + B + A1 + A2 + uniques
    assert plan.kv_tokens_read() == (5 + 2 + 3 + 1 + 2) * ps + sum(u[2] for u in uniq)


def test_split_kv_across_levels_any_order_and_scale(fused_cpu: bool) -> None:
    """A row's KV may be split over levels in any order; a custom sm_scale is honoured."""
    ps, d, h = 4, 8, 2
    k, v = random_kv(64, ps, h, d, seed=4)
    table, n = [9, 3, 40, 17], 14
    plan = CascadePlan(ps, 1, (level(ps, [(1, [40, 17], 6)]), level(ps, [(1, [9, 3], 8)])))
    q = torch.randn(1, h, d)
    _check(q, k, v, plan, [table], [n], fused_cpu, scale=0.3)


def test_lse_and_merge_state_exact(fused_cpu: bool) -> None:
    torch.manual_seed(5)
    ps, d, h = 2, 8, 2
    k, v = random_kv(16, ps, h, d, seed=5)
    q = torch.randn(1, h, d)
    whole = CascadePlan(ps, 1, (level(ps, [(1, [1, 2, 3], 6)]),))
    part_a = CascadePlan(ps, 1, (level(ps, [(1, [1], 2)]),))
    part_b = CascadePlan(ps, 1, (level(ps, [(1, [2, 3], 4)]),))
    o, s = TorchCascadeAttention(whole, fused_cpu=fused_cpu).forward(q, k, v, return_lse=True)
    oa, sa = TorchCascadeAttention(part_a, fused_cpu=fused_cpu).forward(q, k, v, return_lse=True)
    ob, sb = TorchCascadeAttention(part_b, fused_cpu=fused_cpu).forward(q, k, v, return_lse=True)
    om, sm = merge_state(oa, sa, ob, sb)
    assert torch.allclose(om, o, atol=1e-6) and torch.allclose(sm, s, atol=1e-6)
    # lse is the natural-log sum of exp(scores)
    kk = k[[1, 2, 3]].reshape(6, h, d)
    expect = torch.logsumexp(torch.einsum("hd,nhd->hn", q[0], kk) * d**-0.5, dim=-1)
    assert torch.allclose(s[0], expect, atol=1e-5)
    # an empty side contributes nothing; both empty gives zeros and -inf
    empty_o, empty_s = torch.zeros_like(oa), torch.full_like(sa, float("-inf"))
    o2, s2 = merge_state(empty_o, empty_s, oa, sa)
    assert torch.equal(o2, oa) and torch.equal(s2, sa)
    o3, s3 = merge_state(empty_o, empty_s, empty_o, empty_s)
    assert torch.equal(o3, empty_o) and torch.isneginf(s3).all()


def test_bf16_inputs_close_to_fp32(fused_cpu: bool) -> None:
    ps, d, h = 16, 32, 4
    k, v = random_kv(200, ps, h, d, seed=6)
    tables = [[5, 6, 7, 10 + r] for r in range(4)]
    lens = [3 * ps + 1 + r for r in range(4)]
    plan = CascadePlan(
        ps,
        4,
        (level(ps, [(4, [5, 6, 7], 3 * ps)]), level(ps, [(1, [10 + r], 1 + r) for r in range(4)])),
    )
    q = torch.randn(4, h, d)
    ref = reference_decode(q, k, v, tables, lens)
    out = cascade_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan, fused_cpu=fused_cpu)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() < 3e-2


def test_bad_plans_and_inputs_rejected(fused_cpu: bool) -> None:
    with pytest.raises(ValueError, match="no query rows"):
        CascadeLevel((0, 0), (0, 1), (3,), (1,))
    with pytest.raises(ValueError, match="kv_last_page_len must be 0"):
        CascadeLevel((0, 1), (0, 0), (), (2,))
    with pytest.raises(ValueError, match="kv_indptr ends"):
        CascadeLevel((0, 1), (0, 2), (3,), (1,))
    with pytest.raises(ValueError, match="read no KV"):
        CascadePlan(4, 2, (CascadeLevel((0, 1), (0, 1), (3,), (1,)),))
    with pytest.raises(ValueError, match="above page_size"):
        CascadePlan(4, 1, (CascadeLevel((0, 1), (0, 1), (3,), (5,)),))
    plan = CascadePlan(4, 1, (CascadeLevel((0, 1), (0, 1), (3,), (1,)),))
    k, v = random_kv(8, 4, 2, 8)
    with pytest.raises(ValueError, match="rows"):
        cascade_attention(torch.randn(2, 2, 8), k, v, plan, fused_cpu=fused_cpu)
    with pytest.raises(ValueError, match="page_size"):
        cascade_attention(torch.randn(1, 2, 8), *random_kv(8, 2, 2, 8), plan, fused_cpu=fused_cpu)
    with pytest.raises(ValueError, match="do not fit"):
        cascade_attention(torch.randn(1, 3, 8), k, v, plan, fused_cpu=fused_cpu)


@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_torch_backend_decode(page_size: int, fused_cpu: bool) -> None:
    """Against the model's own torch backend decode (same pool, same batch, GQA)."""
    from radixkv.attention.base import BatchLayout
    from radixkv.attention.torch_backend import TorchAttention
    from radixkv.kv.kv_pool import KVPool

    ps, h_q, h_kv, d = page_size, 8, 2, 16
    pool = KVPool(1, 1000, ps, h_kv, d, torch.float32, "cpu")
    k, v = random_kv(1000, ps, h_kv, d, seed=9)
    pool.k[0].copy_(k)
    pool.v[0].copy_(v)
    shared = _pages(5, 64 // ps)
    uniq = [(1, _pages(300 + 37 * r, -(-(r + 1) * 5 // ps)), (r + 1) * 5) for r in range(5)]
    tables = [shared + u[1] for u in uniq]
    lens = [64 + u[2] for u in uniq]
    backend = TorchAttention(pool, h_q, h_kv, d)
    backend.plan(BatchLayout.build(tables, [n - 1 for n in lens], [1] * 5))
    q = torch.randn(5, h_q, d)
    # the new token's K/V: write the values already in its slot, so both see the same pool
    slots = [t[(n - 1) // ps] * ps + (n - 1) % ps for t, n in zip(tables, lens)]
    k_new = pool.k[0].reshape(-1, h_kv, d)[slots].clone()
    v_new = pool.v[0].reshape(-1, h_kv, d)[slots].clone()
    out_backend = backend.forward(0, q, k_new, v_new)
    plan = CascadePlan(ps, 5, (level(ps, [(5, shared, 64)]), level(ps, uniq)))
    out = cascade_attention(q, pool.k[0], pool.v[0], plan, fused_cpu=fused_cpu)
    assert (out - out_backend).abs().max().item() <= 1e-5


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_keys_split_across_threads_exact(
    threads: int, fused_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk with fewer segments than threads has its keys cut into parts (padded to equal
    parts, partial last pages masked); output and lse equal one part's, on the path that merges
    every part at once (each level covers the whole batch) and on the general one."""
    import radixkv.attention.cascade as cascade_mod

    monkeypatch.setattr(cascade_mod, "MIN_SPLIT_TOKENS", 8)  # small keys still split
    ps, d, h_q, h_kv = 4, 16, 4, 2
    k, v = random_kv(1000, ps, h_kv, d, seed=11)
    own = [_pages(400 + 9 * r, 2) for r in range(5)]  # 5..8 tokens of each row's own
    own_level = level(ps, [(1, own[r], 5 + r % 4) for r in range(5)])
    own_lens = [5 + r % 4 for r in range(5)]
    # every level covers the whole batch: a trunk of 13 pages (parts padded to equal size)
    trunk = _pages(3, 13)
    whole = CascadePlan(ps, 5, (level(ps, [(5, trunk, 52)]), own_level))
    whole_case = ([trunk + o for o in own], [52 + n for n in own_lens])
    # one level, a partial last page in the split segment
    alone = CascadePlan(ps, 5, (level(ps, [(5, trunk, 51)]),))
    alone_case = ([trunk] * 5, [51] * 5)
    # general path: two shared segments (rows 0-1, 2-3), row 4 reads nothing shared
    pair_a, pair_b = _pages(700, 9), _pages(800, 11)
    shared = level(ps, [(2, pair_a, 36), (2, pair_b, 44), (1, [], 0)])
    parts = CascadePlan(ps, 5, (shared, own_level))
    pre = [pair_a, pair_a, pair_b, pair_b, []]
    pre_len = [36, 36, 44, 44, 0]
    parts_case = ([p + o for p, o in zip(pre, own)], [a + b for a, b in zip(pre_len, own_lens)])
    # one level of two one-row segments (a batch of two, fewer than the threads when > 2)
    two = CascadePlan(ps, 2, (level(ps, [(1, pair_a, 35), (1, pair_b, 44)]),))
    two_case = ([pair_a, pair_b], [35, 44])
    cases = ((whole, whole_case), (alone, alone_case), (parts, parts_case), (two, two_case))
    for plan, (tables, lens) in cases:
        q = torch.randn(plan.num_queries, h_q, d)
        ref = reference_decode(q, k, v, tables, lens)
        one = TorchCascadeAttention(plan, fused_cpu=fused_cpu, threads=1)
        many = TorchCascadeAttention(plan, fused_cpu=fused_cpu, threads=threads)
        assert all(c.splits == 1 for c in one._levels[0])
        if plan is not two or threads >= 4:  # two segments split only with 4 threads
            assert all(c.splits > 1 for c in many._levels[0])
        for _ in range(2):  # the first call probes the fused kernel; the second takes the fast path
            o1, s1 = one.forward(q, k, v, return_lse=True)
            o2, s2 = many.forward(q, k, v, return_lse=True)
            assert (o2.double() - ref).abs().max().item() <= TOL
            assert torch.allclose(o1, o2, atol=1e-6) and torch.allclose(s1, s2, atol=1e-5)


def test_previous_step_levels_reused_and_exact(fused_cpu: bool) -> None:
    """Built with the previous step's instance, an unchanged level keeps its prepared chunks,
    a changed one is prepared anew, and the output is exact."""
    ps, d, h = 4, 8, 2
    k, v = random_kv(300, ps, h, d, seed=12)
    trunk = _pages(5, 6)
    own = [_pages(100 + 5 * r, 2) for r in range(3)]
    q = torch.randn(3, h, d)

    def plan(extra: int) -> CascadePlan:
        own_level = level(ps, [(1, own[r], 5 + r + extra) for r in range(3)])
        return CascadePlan(ps, 3, (level(ps, [(3, trunk, 24)]), own_level))

    step1 = TorchCascadeAttention(plan(0), fused_cpu=fused_cpu)
    step2 = TorchCascadeAttention(plan(1), fused_cpu=fused_cpu, previous=step1)
    assert step2._levels[0] is step1._levels[0]
    assert step2._levels[1] is not step1._levels[1]
    tables = [trunk + o for o in own]
    lens = [24 + 5 + r + 1 for r in range(3)]
    out = step2.forward(q, k, v)
    assert (out.double() - reference_decode(q, k, v, tables, lens)).abs().max().item() <= TOL
    other_threads = TorchCascadeAttention(plan(1), previous=step2, threads=step2.threads + 1)
    assert other_threads._levels[0] is not step2._levels[0]


@pytest.mark.parametrize("threads", [1, 2])
def test_consecutive_pages_read_in_place(
    threads: int, fused_cpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment on one run of consecutive pages (a prefix prefilled in one go on a fresh pool)
    is read as a view of the cache instead of gathered; same results."""
    import radixkv.attention.cascade as cascade_mod

    monkeypatch.setattr(cascade_mod, "MIN_SPLIT_TOKENS", 8)
    ps, d, h_q, h_kv = 4, 16, 4, 2
    k, v = random_kv(300, ps, h_kv, d, seed=13)
    trunk = list(range(40, 52))  # 12 consecutive pages
    own = [[100 + 3 * r, 101 + 3 * r] for r in range(3)]  # consecutive within each row
    plan = CascadePlan(
        ps, 3, (level(ps, [(3, trunk, 48)]), level(ps, [(1, own[r], 5 + r) for r in range(3)]))
    )
    alone = CascadePlan(ps, 1, (level(ps, [(1, own[0], 7)]),))
    attn = TorchCascadeAttention(plan, fused_cpu=fused_cpu, threads=threads)
    assert attn._levels[0][0].page_run == (40, 12)
    assert TorchCascadeAttention(alone, threads=threads)._levels[0][0].page_run == (100, 2)
    q = torch.randn(3, h_q, d)
    ref = reference_decode(q, k, v, [trunk + o for o in own], [48 + 5 + r for r in range(3)])
    for _ in range(2):
        assert (attn.forward(q, k, v).double() - ref).abs().max().item() <= TOL
    out = cascade_attention(q[:1], k, v, alone, fused_cpu=fused_cpu)
    assert (out.double() - reference_decode(q[:1], k, v, [own[0]], [7])).abs().max() <= TOL


def test_gather_views_kept_across_layers_and_rebuilt_for_new_buffers() -> None:
    """The fused path keeps each gathered chunk's views of the gather buffers: every layer
    (another cache of the same shape) reuses them and reads its own pages; a later step whose
    chunk needs a larger buffer, or caches of another dtype, get fresh views. Exact throughout."""
    ps, d, h_q, h_kv = 4, 8, 4, 2
    layers = [random_kv(400, ps, h_kv, d, seed=20 + i) for i in range(2)]
    trunk = _pages(3, 10)
    own = [_pages(200 + 5 * r, 2) for r in range(3)]
    q = torch.randn(3, h_q, d)

    def plan(extra_pages: int) -> tuple[CascadePlan, list[list[int]], list[int]]:
        mine = [o + _pages(300 + 11 * r, extra_pages) for r, o in enumerate(own)]
        lens = [(len(m) - 1) * ps + 2 + r for r, m in enumerate(mine)]
        p = CascadePlan(
            ps, 3, (level(ps, [(3, trunk, 40)]), level(ps, [(1, m, n) for m, n in zip(mine, lens)]))
        )
        return p, [trunk + m for m in mine], [40 + n for n in lens]

    def check(attn: TorchCascadeAttention, tables, lens, dtype=torch.float32, tol=TOL) -> None:
        for k, v in layers:
            k, v = k.to(dtype), v.to(dtype)
            ref = reference_decode(q.to(dtype).double(), k.double(), v.double(), tables, lens)
            out = attn.forward(q.to(dtype), k, v)
            assert (out.double() - ref).abs().max().item() <= tol

    p1, tables1, lens1 = plan(0)
    step1 = TorchCascadeAttention(p1, fused_cpu=True)
    shared = step1._levels[0][0]
    assert shared.page_run is None  # gathered
    check(step1, tables1, lens1)
    views = shared.kv_views
    assert views is not None
    check(step1, tables1, lens1)
    assert shared.kv_views is views  # kept across layers and calls
    # the next step's private level is four times wider: the buffers grow, views follow them
    p2, tables2, lens2 = plan(6)
    step2 = TorchCascadeAttention(p2, fused_cpu=True, previous=step1)
    assert step2._levels[0][0] is shared
    check(step2, tables2, lens2)
    assert shared.kv_views is not views and shared.kv_views[0] is not views[0]
    check(step2, tables2, lens2, torch.bfloat16, tol=5e-2)  # bf16 caches: new buffers again
    assert shared.kv_views[3].dtype == torch.bfloat16
    check(step2, tables2, lens2)


def test_many_segment_chunks_match_the_per_segment_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk of many one-row segments (a decode step's per-request level) gets its page index
    and rows by array ops: the same chunks as the per-segment pass builds."""
    import random

    import radixkv.attention.cascade as cascade_mod
    from radixkv.attention.cascade import TorchCascadeAttention
    from radixkv.attention.cascade_plan import CascadeLevel

    rng = random.Random(0)
    # 300 rows of up to 59 tokens: sorted longest first into several chunks, rows not in order
    for ps, n in ((1, 40), (4, 40), (16, 40), (16, 300), (4, 300)):
        segs, page = [], 0
        for _ in range(n):
            length = rng.randrange(1, 60)
            k = -(-length // ps)
            segs.append((1, list(range(page, page + k)), length))
            page += k
        shared = CascadeLevel.from_segments(ps, [(n, [900, 901, 902], 3 * ps)])
        # a level of one- and many-row segments, some reading nothing
        mixed, row = [], 0
        while row < n:
            rows = min(n - row, rng.choice([1, 1, 2, 3]))
            length = rng.choice([0, rng.randrange(1, 40)])
            mixed.append((rows, list(range(2000 + row, 2000 + row + -(-length // ps))), length))
            row += rows
        levels = (
            shared,
            CascadeLevel.from_segments(ps, mixed),
            CascadeLevel.from_segments(ps, segs),
        )
        plan = CascadePlan(ps, n, levels)
        built = []
        for threshold in (16, 10**9):
            monkeypatch.setattr(cascade_mod, "_VECTOR_SEGMENTS", threshold)
            built.append(TorchCascadeAttention(plan, threads=2)._levels)
        if n == 300:  # several chunks, the rows of each out of order
            assert len(built[0][2]) > 1 and built[0][2][0].row_range is None
        for fast, slow in zip(*built, strict=True):
            for a, b in zip(fast, slow, strict=True):
                for f in ("num_segments", "group", "kv_len", "row_range", "splits", "page_run"):
                    assert getattr(a, f) == getattr(b, f), f
                for f in ("rows", "pages_flat", "kv_mask", "out_rows", "split_mask"):
                    x, y = getattr(a, f), getattr(b, f)
                    assert (x is None) == (y is None), f
                    assert x is None or torch.equal(x, y), f
