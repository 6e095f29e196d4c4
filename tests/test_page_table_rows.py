"""PageTableRows (the persistent page-table array) against fresh builds, and the torch
backend's array-built plan against the page tables it came from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixkv.attention.base import ROWS_MIN_BATCH, BatchLayout
from radixkv.attention.page_table_rows import PageTableRows, pad_rows
from radixkv.attention.torch_backend import TorchAttention
from radixkv.kv.kv_pool import KVPool
from radixkv.pages import pages_for


def _check(rows: PageTableRows, tables: list[list[int]]) -> None:
    snaps, pages, counts = rows.gather(tables)
    assert [list(s) for s in snaps] == tables
    assert counts.tolist() == [len(t) for t in tables]
    assert np.array_equal(pages, pad_rows(tables))


@pytest.mark.parametrize("seed", range(4))
def test_rows_match_a_fresh_build_over_random_steps(seed: int) -> None:
    """Tables join, leave, grow by a page, shrink, are replaced in place (a publish) or by a
    new list (a release and readmission): every step's rows equal a fresh conversion."""
    rng = random.Random(seed)
    rows = PageTableRows(check=True)  # also asserts against a fresh build itself
    live: list[list[int]] = []
    for _ in range(120):
        op = rng.random()
        if op < 0.25 or not live:
            live.insert(
                rng.randrange(len(live) + 1),
                [rng.randrange(1000) for _ in range(rng.randrange(0, 6))],
            )
        elif op < 0.4:
            live.pop(rng.randrange(len(live)))
        elif op < 0.6:
            rng.choice(live).append(rng.randrange(1000))
        elif op < 0.7:
            t = rng.choice(live)
            t[: rng.randrange(len(t) + 1)] = [rng.randrange(1000) for _ in range(len(t))][: len(t)]
        elif op < 0.8:
            t = rng.choice(live)
            del t[rng.randrange(len(t) + 1) :]
        elif op < 0.9:
            i = rng.randrange(len(live))
            live[i] = list(live[i])  # same contents, a new list
        else:
            rng.shuffle(live)
        if live:
            _check(rows, live)
    assert len(rows) <= max(64, 2 * len(live))  # rows of lists gone were recycled


def test_unchanged_tables_are_not_converted_again() -> None:
    rows = PageTableRows(check=False)
    tables = [[i, i + 1, i + 2] for i in range(0, 300, 3)]
    rows.gather(tables)
    assert rows.rows_converted == len(tables)
    tables[5].append(999)
    _, pages, _ = rows.gather(tables)
    assert rows.rows_converted == len(tables) + 1  # only the grown one
    assert pages[5, :4].tolist() == [15, 16, 17, 999]
    assert pages[4].tolist() == [12, 13, 14, 12]  # padded with its first page


def test_snapshots_are_immutable_copies() -> None:
    """A layout's page tables do not change when the engine changes its lists afterwards."""
    rows = PageTableRows(check=False)
    tables = [[1, 2], [3, 4]]
    snaps, _, _ = rows.gather(tables)
    tables[0][0] = 7
    tables[1].append(5)
    assert [list(s) for s in snaps] == [[1, 2], [3, 4]]
    again, pages, _ = rows.gather(tables)
    assert [list(s) for s in again] == [[7, 2], [3, 4, 5]]
    assert pages.tolist() == [[7, 2, 7], [3, 4, 5]]


def test_non_list_tables() -> None:
    rows = PageTableRows(check=True)
    tables = [(1, 2, 3), np.array([4, 5]), torch.tensor([6]), range(7, 9)]
    snaps, pages, counts = rows.gather(tables)  # type: ignore[arg-type]
    assert [list(s) for s in snaps] == [[1, 2, 3], [4, 5], [6], [7, 8]]
    assert counts.tolist() == [3, 2, 1, 2]
    assert pages.tolist() == [[1, 2, 3], [4, 5, 4], [6, 6, 6], [7, 8, 7]]


@pytest.mark.parametrize("seed", range(3))
def test_torch_plan_from_arrays_reads_the_right_pages(seed: int) -> None:
    """Decode groups and write slots built by array ops name exactly each sequence's pages
    (padding repeats its first page and is masked), in a mixed batch with tables longer than
    their tokens need."""
    rng = random.Random(seed)
    ps = 4
    pool = KVPool(
        num_layers=1, num_pages=400, page_size=ps, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    attn = TorchAttention(pool, 2, 1, 8)
    b = ROWS_MIN_BATCH + 12
    past = [rng.choice([0, rng.randrange(1, 40)]) for _ in range(b)]
    new = [1 if p and rng.random() < 0.8 else rng.randrange(1, 9) for p in past]
    tables = [
        rng.sample(range(400), pages_for(p + n, ps) + rng.randrange(2)) for p, n in zip(past, new)
    ]
    layout = BatchLayout.build(tables, past, new, rows=PageTableRows(check=True))
    attn.plan(layout)
    starts = np.cumsum(new) - new
    want_slots = [
        tables[i][t // ps] * ps + t % ps for i in range(b) for t in range(past[i], past[i] + new[i])
    ]
    assert attn._slots is not None and attn._slots.tolist() == want_slots
    seen = []
    for g in attn._groups:
        pages = g.pages.view(g.num_seqs, -1)
        for k, row in enumerate(g.rows.tolist()):
            i = int(np.flatnonzero(starts == row)[0])
            assert new[i] == 1 and past[i] > 0
            n = pages_for(past[i] + 1, ps)
            assert pages[k, :n].tolist() == tables[i][:n]
            assert set(pages[k, n:].tolist()) <= {tables[i][0]}
            keys = past[i] + 1
            if g.mask is not None:
                assert g.mask[k, 0, 0].tolist() == [j < keys for j in range(g.kv_len)]
            else:
                assert keys == g.kv_len
            seen.append(i)
        if g.first_row >= 0:
            assert g.rows.tolist() == list(range(g.first_row, g.first_row + g.num_seqs))
    assert seen == [i for i in range(b) if new[i] == 1 and past[i] > 0]


@pytest.mark.parametrize("seed", range(3))
def test_small_decode_batches_plan_the_same_groups(seed: int) -> None:
    """A decode batch of fewer than ROWS_MIN_BATCH sequences is planned from its lists: the
    same groups (rows, padded pages, masks) as the array ops give."""
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 16])
    pool = KVPool(
        num_layers=1, num_pages=400, page_size=ps, num_kv_heads=1, head_dim=8,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    attn = TorchAttention(pool, 2, 1, 8)
    # a tiny group budget, so that several groups form
    budget = 2 * ps * 8 * 4 * rng.choice([1, 3, 8])
    n = rng.randrange(1, ROWS_MIN_BATCH)
    past = [rng.randrange(1, 12 * ps) for _ in range(n)]
    tables = [rng.sample(range(400), pages_for(p + 1, ps) + rng.randrange(2)) for p in past]
    layout = BatchLayout.build(tables, past, [1] * n)
    with pytest.MonkeyPatch.context() as mp:
        import radixkv.attention.torch_backend as tb

        mp.setattr(tb, "DECODE_GROUP_BYTES", budget)
        small = attn._plan_small_decode(layout)
        a = layout.arrays
        n_pages = -(-(a.num_past + 1) // ps)
        pages = np.where(np.arange(a.pages.shape[1]) < n_pages[:, None], a.pages, a.pages[:, :1])
        big = attn._plan_decode(np.arange(n), pages, n_pages, a.num_past + 1)
    assert len(small) == len(big)
    for x, y in zip(small, big, strict=True):
        assert (x.first_row, x.num_seqs, x.kv_len) == (y.first_row, y.num_seqs, y.kv_len)
        assert torch.equal(x.rows, y.rows) and torch.equal(x.pages, y.pages)
        assert (x.mask is None) == (y.mask is None)
        assert x.mask is None or torch.equal(x.mask, y.mask)
