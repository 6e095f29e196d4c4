"""ModelRunner decode steps through a cascade plan give the logits of plain paged decode."""

from __future__ import annotations

import random

import pytest
import torch
from cascade_helpers import check_shared_pages

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.attention.cascade_backend import CascadeDecodeBackend
from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention
from radixkv.engine.cascade_planner import CascadePlanner, DecodeEntry
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import load_model
from radixkv.model.runner import ModelRunner, SeqInput


class Node:
    def __init__(self, parent: Node | None, num_tokens: int) -> None:
        self.parent = parent
        self.num_tokens = num_tokens


@pytest.fixture(scope="module")
def tiny():
    return load_model("radixkv-tiny", device="cpu")


def _runner(tiny, ps: int, kv_dtype: torch.dtype = torch.float32) -> ModelRunner:
    c = tiny.config
    kv = KVPool(
        c.num_layers, 128, ps, c.num_kv_heads, c.head_dim, kv_dtype, "cpu",
        compute_dtype=torch.float32,
    )  # fmt: skip
    return ModelRunner(tiny.model, kv, backend="torch")


@pytest.mark.parametrize(
    ("page_size", "kv_dtype"),
    [(4, torch.float32), (16, torch.float32), (4, torch.float8_e4m3fn), (16, torch.float8_e5m2)],
)  # fp8 pages: both paths read the same stored values, converted
def test_runner_cascade_decode_matches_plain(tiny, page_size: int, kv_dtype: torch.dtype) -> None:
    ps = page_size
    rng = random.Random(0)
    plain, casc = _runner(tiny, ps, kv_dtype), _runner(tiny, ps, kv_dtype)
    free = list(range(128))
    rng.shuffle(free)

    def take(n: int) -> list[int]:
        out = free[:n]
        del free[:n]
        return out

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 250) for _ in range(n)]

    # trunk (48 tokens) -> branch a (+16); requests: 2 under a, 2 under the trunk, 1 alone
    trunk_t, a_t = tokens(48), tokens(16)
    trunk_p, a_p = take(48 // ps), take(16 // ps)
    trunk = Node(None, 48)
    a = Node(trunk, 16)
    prefills = [SeqInput(trunk_t, trunk_p, 0), SeqInput(a_t, trunk_p + a_p, 48)]
    for s in prefills:
        plain.forward([s])
        casc.forward([s])
    reqs = []  # (node, shared pages, own tokens so far, own pages)
    for node, shared_pages, shared_len in [
        (a, trunk_p + a_p, 64),
        (a, trunk_p + a_p, 64),
        (trunk, trunk_p, 48),
        (trunk, trunk_p, 48),
        (None, [], 0),
    ]:
        own = tokens(rng.randint(1, 5))
        own_pages = take(-(-(shared_len + len(own) + 6) // ps) - len(shared_pages))
        reqs.append([node, shared_pages, shared_len, own, own_pages])
        s = SeqInput(own, shared_pages + own_pages, shared_len)
        first = plain.forward([s])
        casc.forward([s])
        own.append(int(first.argmax(-1)))  # the token the first decode step feeds
    # decode 5 steps; the batch order is scrambled so the plan must reorder rows
    batch = [3, 0, 4, 2, 1]
    planner = CascadePlanner(ps, mode="on")
    for _ in range(5):
        seqs, entries = [], []
        for i in batch:
            node, sp, sl, own, op = reqs[i]
            num_past = sl + len(own) - 1
            seqs.append(SeqInput([own[-1]], sp + op, num_past))
            entries.append(DecodeEntry(node, sp + op, num_past + 1, len(sp)))
        dec = check_shared_pages(planner.plan(entries), entries)
        assert dec.use_cascade and dec.num_levels == 3
        lp = plain.forward(seqs)
        lc = casc.forward(seqs, cascade=dec)
        assert (lp - lc).abs().max().item() <= 1e-4
        for i, tok in zip(batch, lp.argmax(-1).tolist()):
            reqs[i][3].append(tok)
    assert torch.allclose(plain.kv_pool.k.float(), casc.kv_pool.k.float(), atol=1e-5)


def test_cascade_backend_rejects_mismatched_batches(tiny) -> None:
    ps = 4
    runner = _runner(tiny, ps)
    node = Node(None, 8)
    entries = [DecodeEntry(node, [0, 1, 2 + i], 9 + i, 2) for i in range(2)]
    dec = CascadePlanner(ps, mode="on").plan(entries)
    be = CascadeDecodeBackend(runner.attn)
    with pytest.raises(RuntimeError, match="set_plan"):
        be.plan(BatchLayout.build([[0, 1, 2]], [8], [1]))
    be.set_plan(dec.plan, dec.order)
    with pytest.raises(ValueError, match="decode-only"):
        be.plan(BatchLayout.build([[0, 1, 2], [0, 1, 3]], [8, 8], [1, 2]))
    with pytest.raises(ValueError, match="reads 9 tokens"):
        be.plan(BatchLayout.build([[0, 1, 2], [0, 1, 3]], [9, 9], [1, 1]))
    with pytest.raises(ValueError, match="permutation"):
        be.set_plan(dec.plan, (0, 0))
    be.plan(BatchLayout.build([[0, 1, 2], [0, 1, 3]], [8, 9], [1, 1]))
    assert FlashInferCascadeAttention is not None  # importable on CPU


def test_mixed_batch_decodes_through_the_cascade(tiny) -> None:
    """A step that prefills one request while others decode: the cascade plan covers the decode
    rows only (wherever they sit in the batch), the torch backend the prefill; logits and the
    pool equal plain attention's."""
    ps = 4
    rng = random.Random(3)
    plain, casc = _runner(tiny, ps), _runner(tiny, ps)
    trunk_t = [rng.randrange(1, 250) for _ in range(32)]
    trunk_p = list(range(8))
    trunk = Node(None, 32)
    for r in (plain, casc):
        r.forward([SeqInput(trunk_t, trunk_p, 0)])
    seqs, entries, rows = [], [], []
    own_page = 20
    for i in range(5):
        if i == 2:  # a prefill in the middle of the batch: 9 new tokens on nothing cached
            seqs.append(SeqInput([rng.randrange(1, 250) for _ in range(9)], [60, 61, 62], 0))
            continue
        own = [rng.randrange(1, 250) for _ in range(3)]
        table = [*trunk_p, own_page]
        own_page += 1
        for r in (plain, casc):
            r.forward([SeqInput(own[:2], table, 32)])  # two own tokens computed
        seqs.append(SeqInput(own[2:], table, 34))  # the third decodes now
        entries.append(DecodeEntry(trunk, table, 35, 8))
        rows.append(i)
    dec = CascadePlanner(ps, mode="on").plan(entries)
    assert dec.use_cascade and casc.supports_mixed_cascade
    want = plain.forward(seqs, all_logits=True)
    got = casc.forward(seqs, all_logits=True, cascade=dec, cascade_rows=rows)
    assert (want - got).abs().max().item() <= 1e-4
    assert torch.allclose(plain.kv_pool.k, casc.kv_pool.k, atol=1e-6)
    be = casc._cascade
    assert be is not None
    with pytest.raises(ValueError, match="decode-only"):  # a prefill row among the plan's rows
        be.set_plan(dec.plan, dec.order, [0, 1, 2, 3])
        be.plan(BatchLayout.build([s.page_table for s in seqs], [s.num_past for s in seqs],
                                  [len(s.new_token_ids) for s in seqs]))  # fmt: skip
    with pytest.raises(ValueError, match="cascade rows"):
        be.set_plan(dec.plan, dec.order, [0, 1])


def test_mixed_cascade_needs_the_torch_backend(tiny) -> None:
    class Other(AttentionBackend):
        name = "other"

        def plan(self, layout: BatchLayout) -> None:
            raise AssertionError("not reached")

        def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
            raise AssertionError("not reached")

    runner = _runner(tiny, 4)
    be = CascadeDecodeBackend(Other(runner.kv_pool, 1, 1, 64))
    assert not be.supports_mixed
    node = Node(None, 8)
    entries = [DecodeEntry(node, [0, 1, 2 + i], 10, 2) for i in range(2)]
    dec = CascadePlanner(4, mode="on").plan(entries)
    be.set_plan(dec.plan, dec.order, [0, 2])
    layout = BatchLayout.build([[0, 1, 2], [9], [0, 1, 3]], [9, 0, 9], [1, 2, 1])
    with pytest.raises(ValueError, match="torch backend"):
        be.plan(layout)
