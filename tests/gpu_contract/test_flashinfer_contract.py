"""radixkv's FlashInfer backends driven on the CPU against the real flashinfer API.

The real module's classes and functions are replaced by the recording stand-ins of
``standins.py``: each call is bound to the real signature and checked against what FlashInfer
documents (and the GPU kit relies on). Device ``cpu``: the stand-ins compute FlashInfer's
documented maths, so outputs are compared with the torch backend / an fp64 reference. Device
``meta``: the stand-in "GPU" is a different device from the CPU, so the placement of every
tensor (metadata on the CPU, page indices and data on the GPU) is checked.
"""

from __future__ import annotations

import random
import sys

import flashinfer as real_flashinfer
import pytest
import torch
from cascade_helpers import level, reference_decode
from standins import ContractError, FakeFlashInfer

from radixkv.attention import flashinfer_backend as fib
from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention
from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention
from radixkv.attention.flashinfer_backend import FlashInferAttention, decode_uses_tensor_cores
from radixkv.attention.hybrid import HybridAttention
from radixkv.attention.registry import get_backend
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
PREFILL = "BatchPrefillWithPagedKVCacheWrapper"
DECODE = "BatchDecodeWithPagedKVCacheWrapper"


def _install(monkeypatch: pytest.MonkeyPatch, device: str) -> FakeFlashInfer:
    stand_in = FakeFlashInfer(real_flashinfer, device)
    monkeypatch.setitem(sys.modules, "flashinfer", stand_in)
    monkeypatch.setattr(fib, "_require_cuda", lambda device, what: None)
    return stand_in


@pytest.fixture(params=["cpu", "meta"])
def fake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    return _install(monkeypatch, request.param)


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> FakeFlashInfer:
    return _install(monkeypatch, "cpu")


def test_real_module_has_every_name_radixkv_uses() -> None:
    for name in (PREFILL, DECODE, "merge_state", "merge_state_in_place"):
        assert hasattr(real_flashinfer, name), name
    assert real_flashinfer.__version__.startswith("0.7."), real_flashinfer.__version__


def _strided(x: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``x`` on ``dev`` as a non-contiguous view (rows of a wider buffer), as the model's
    q/k/v can be when they are slices of one projection."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=dev)
    wide[..., : x.shape[-1]] = x.to(dev)
    view = wide[..., : x.shape[-1]]
    assert not view.is_contiguous()
    return view


# ------------------------------------------------------------------------------------------------
# FlashInferAttention (the paged prefill/decode backend)
def _batch(kind: str, ps: int, seed: int) -> tuple[list[list[int]], list[int], list[int], int]:
    rng = random.Random(seed)
    past, new = [], []
    kinds = {
        "decode": ["decode"] * 5,
        "prefill": ["fresh", "chunk", "fresh", "chunk1"],
        "mixed": ["decode", "fresh", "chunk", "decode", "chunk1", "decode"],
    }[kind]
    for k in kinds:
        if k == "decode":
            past.append(rng.randint(1, 3 * ps + 5))
            new.append(1)
        elif k == "fresh":
            past.append(0)
            new.append(rng.randint(1, 2 * ps + 7))
        elif k == "chunk":  # a chunk on a cached prefix, not page aligned
            past.append(rng.randint(1, 2 * ps + 3))
            new.append(rng.randint(2, ps + 9))
        else:  # a one-token prompt (past 0): prefill, not decode
            past.append(0)
            new.append(1)
    needs = [-(-(p + n) // ps) for p, n in zip(past, new)]
    ids = list(range(sum(needs) + 3))
    rng.shuffle(ids)
    tables, used = [], 0
    for n in needs:
        tables.append([*ids[used : used + n], ids[-1]])  # an extra trailing page is ignored
        used += n
    return tables, past, new, len(ids)


@pytest.mark.parametrize("heads", [(4, 2, 64), (8, 1, 128)], ids=["gqa2-d64", "gqa8-d128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_paged_backend(
    fake: FakeFlashInfer, kind: str, page_size: int, dtype: torch.dtype, heads: tuple[int, ...]
) -> None:
    hq, hkv, d = heads
    tables, past, new, num_pages = _batch(kind, page_size, seed=page_size + len(kind))
    layout = BatchLayout.build(tables, past, new)
    dev = fake.device
    pool = KVPool(2, num_pages, page_size, hkv, d, dtype, dev)
    ref_pool = KVPool(2, num_pages, page_size, hkv, d, torch.float32, "cpu")
    if dev.type == "cpu":
        g = torch.Generator().manual_seed(0)
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        ref_pool.k.copy_(pool.k)
        ref_pool.v.copy_(pool.v)
    backend = get_backend("flashinfer", pool, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    assert isinstance(backend, FlashInferAttention)
    ref = get_backend("torch", ref_pool, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d)
    backend.plan(layout)
    ref.plan(layout)
    t = layout.num_tokens
    for layer in (0, 1):  # one plan, every layer
        g = torch.Generator().manual_seed(10 + layer)
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        k = torch.randn(t, hkv, d, generator=g).to(dtype)
        v = torch.randn(t, hkv, d, generator=g).to(dtype)
        out = backend.forward(layer, _strided(q, dev), _strided(k, dev), _strided(v, dev))
        assert out.shape == (t, hq, d) and out.dtype == dtype and out.device == dev
        if dev.type == "cpu":
            want = ref.forward(layer, q.float(), k.float(), v.float())
            assert (out.float() - want).abs().max().item() <= TOL[dtype]
            assert torch.equal(pool.k[layer], ref_pool.k[layer].to(dtype))
            assert torch.equal(pool.v[layer], ref_pool.v[layer].to(dtype))
    # which wrappers were planned and run, how, and how often
    rec = fake.recorder
    has_decode = any(n == 1 and p > 0 for p, n in zip(past, new))
    has_prefill = not all(n == 1 and p > 0 for p, n in zip(past, new))
    assert rec.count(f"{DECODE}.plan") == int(has_decode)
    assert rec.count(f"{PREFILL}.plan") == int(has_prefill)
    assert rec.count(f"{DECODE}.run") == 2 * int(has_decode)
    assert rec.count(f"{PREFILL}.run") == 2 * int(has_prefill)
    (dec_init,) = [c for c in rec.calls if c.name == f"{DECODE}.__init__"]
    assert dec_init.args["use_tensor_cores"] is decode_uses_tensor_cores(hq, hkv)
    for c in rec.calls:
        if c.name == f"{PREFILL}.plan":
            assert c.args["causal"] is True
        if c.name.endswith(".plan"):
            assert c.args["q_data_type"] == dtype and c.args["kv_data_type"] == dtype
            assert c.args["sm_scale"] == pytest.approx(d**-0.5)


def test_replanning_reuses_wrappers(fake: FakeFlashInfer) -> None:
    pool = KVPool(1, 32, 16, 2, 64, torch.bfloat16, fake.device)
    backend = FlashInferAttention(pool, 4, 2, 64)
    for past, new in (([20, 3], [1, 1]), ([0, 40], [7, 1]), ([5], [9])):
        layout = BatchLayout.build(
            [list(range(i * 8, i * 8 + 8)) for i in range(len(past))], past, new
        )
        backend.plan(layout)
        t = sum(new)
        out = backend.forward(
            0, *(torch.zeros(t, h, 64, dtype=torch.bfloat16, device=fake.device) for h in (4, 2, 2))
        )
        assert out.shape == (t, 4, 64)
    assert fake.recorder.count(f"{PREFILL}.__init__") == 1
    assert fake.recorder.count(f"{DECODE}.__init__") == 1


def _layers_match(
    backend: AttentionBackend,
    ref: AttentionBackend,
    layout: BatchLayout,
    num_layers: int,
    dtype: torch.dtype,
    dev: torch.device,
) -> None:
    """Plan both on ``layout``, run every layer on the same random q/k/v: outputs on ``dev``
    with the right shape, and (on the CPU) as the fp32 reference's within ``TOL``."""
    backend.plan(layout)
    ref.plan(layout)
    t, hq, hkv, d = layout.num_tokens, ref.num_qo_heads, ref.num_kv_heads, ref.head_dim
    for layer in range(num_layers):
        g = torch.Generator().manual_seed(20 + layer)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        out = backend.forward(layer, q.to(dev), k.to(dev), v.to(dev))
        assert out.shape == (t, hq, d) and out.device == dev
        if dev.type == "cpu":
            want = ref.forward(layer, q.float(), k.float(), v.float())
            assert (out.float() - want).abs().max().item() <= TOL[dtype], layer


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_sliding_windows(fake: FakeFlashInfer, kind: str, softcap: float | None) -> None:
    """Layers with a window run wrappers planned with ``window_left = window - 1`` (one more
    pair per window some sequence exceeds, never for the full layers); outputs as the torch
    backend's banded attention. A step where every sequence fits its window plans none.
    Gemma 2's soft cap reaches every plan as ``logits_soft_cap``."""
    ps, hq, hkv, d, dtype = 4, 4, 2, 64, torch.bfloat16
    windows = (0, 5, 9)
    tables, past, new, num_pages = _batch(kind, ps, seed=7)
    layout = BatchLayout.build(tables, past, new)
    longest = max(p + n for p, n in zip(past, new))
    dev = fake.device
    pool = KVPool(3, num_pages, ps, hkv, d, dtype, dev)
    ref_pool = KVPool(3, num_pages, ps, hkv, d, torch.float32, "cpu")
    if dev.type == "cpu":
        g = torch.Generator().manual_seed(1)
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        ref_pool.k.copy_(pool.k)
        ref_pool.v.copy_(pool.v)
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, layer_windows=windows,
              softcap=softcap)  # fmt: skip
    backend = get_backend("flashinfer", pool, **kw)
    _layers_match(backend, get_backend("torch", ref_pool, **kw), layout, 3, dtype, dev)
    rec = fake.recorder
    plans = [c for c in rec.calls if c.name.endswith(".plan")]
    assert all(c.args.get("logits_soft_cap") == softcap for c in plans)
    lefts = sorted({c.args.get("window_left", -1) for c in plans})
    assert lefts == [-1] + [w - 1 for w in windows if w and longest > w]
    assert rec.count(f"{PREFILL}.__init__") == 1 + sum(1 for w in windows if w and longest > w)
    short = BatchLayout.build([tb[:2] for tb in tables], [0] * len(tables), [1] * len(tables))
    before = len(rec.calls)
    backend.plan(short)
    assert {c.args.get("window_left", -1) for c in rec.calls[before:]
            if c.name.endswith(".plan")} == {-1}  # fmt: skip


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_hybrid_window_kv(fake: FakeFlashInfer, kind: str) -> None:
    """Hybrid window KV on FlashInfer: a HybridKVPool gets a FlashInfer backend per pool, the
    windowed layers' planned on slot tables (slots a shuffle of the pages, only the pages the
    windows read attached); outputs as the torch backend's over one pool of every layer."""
    ps, hq, hkv, d, dtype = 4, 4, 2, 64, torch.bfloat16
    windows = (0, 5, 9)
    tables, past, new, num_pages = _batch(kind, ps, seed=11)
    layout = BatchLayout.build(tables, past, new)
    dev = fake.device
    hybrid = HybridKVPool.build(windows, num_pages, num_pages, ps, hkv, d, dtype, dev)
    need = {
        pt[i]
        for pt, p, n in zip(tables, past, new, strict=True)
        for i in range(max(0, p - max(windows) + 1) // ps, -(-(p + n) // ps))
    }
    order = sorted(need)
    random.Random(3).shuffle(order)
    hybrid.slots.attach(order)  # slot i to order[i]: slot ids are not page ids
    ref_pool = KVPool(3, num_pages, ps, hkv, d, torch.float32, "cpu")
    if dev.type == "cpu":
        g = torch.Generator().manual_seed(1)
        ref_pool.k.copy_(torch.randn(ref_pool.k.shape, generator=g).to(dtype))
        ref_pool.v.copy_(torch.randn(ref_pool.v.shape, generator=g).to(dtype))
        hybrid.full.k[0].copy_(ref_pool.k[0])
        hybrid.full.v[0].copy_(ref_pool.v[0])
        slots = torch.tensor([hybrid.slots.slot_of[p] for p in order])
        pages = torch.tensor(order)
        for j, layer in enumerate((1, 2)):
            hybrid.window.k[j, slots] = ref_pool.k[layer, pages].to(dtype)
            hybrid.window.v[j, slots] = ref_pool.v[layer, pages].to(dtype)
    kw = dict(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, layer_windows=windows)
    backend = get_backend("flashinfer", hybrid, **kw)
    assert isinstance(backend, HybridAttention)
    assert isinstance(backend.window, FlashInferAttention)
    assert isinstance(backend.full, FlashInferAttention)
    backend.check_layouts = True  # slot tables checked against the slot pool
    _layers_match(backend, get_backend("torch", ref_pool, **kw), layout, 3, dtype, dev)


def test_tiny_model_end_to_end(fake_cpu: FakeFlashInfer) -> None:
    """radixkv-tiny (bf16) through the model runner: a 300-token prefill, a 90-token chunk on
    it, then decode steps; logits as with the torch backend."""
    fake = fake_cpu
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner, SeqInput

    lm = load_model("radixkv-tiny", dtype=torch.bfloat16)
    c = lm.config
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 9)[:392]
    logits = {}
    for name in ("torch", "flashinfer"):
        kv = KVPool(c.num_layers, 32, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")
        runner = ModelRunner(lm.model, kv, backend=name)
        assert runner.backend_name == name
        table = list(range(32))
        parts = [runner.forward([SeqInput(ids[:300], table, 0)], all_logits=True)]
        parts.append(runner.forward([SeqInput(ids[300:390], table, 300)], all_logits=True))
        parts.append(runner.forward([SeqInput(ids[390:391], table, 390)], all_logits=True))
        parts.append(runner.forward([SeqInput(ids[391:392], table, 391)], all_logits=True))
        logits[name] = torch.cat(parts).float()
    diff = (logits["torch"] - logits["flashinfer"]).abs().max().item()
    assert diff <= 0.05 * logits["torch"].abs().max().item()
    assert fake.recorder.count(f"{DECODE}.run") == 2 * c.num_layers


# ------------------------------------------------------------------------------------------------
# FlashInferCascadeAttention
def _cascade_case(
    case: str, ps: int, seed: int
) -> tuple[CascadePlan, list[list[int]], list[int], int]:
    """Plans in row order: ``two_level`` (one trunk for every row, then each row's own pages),
    ``three_level`` (trunk, two branches, own: every row reads every level), ``three_partial``
    (nested and partial: some rows read nothing at some levels)."""
    rng = random.Random(seed)
    free = list(range(400))
    rng.shuffle(free)

    def pages(n_tok: int) -> list[int]:
        return [free.pop() for _ in range(-(-n_tok // ps))]

    trunk_len, branch_len = 3 * ps, 2 * ps
    trunk, br_a, br_b = pages(trunk_len), pages(branch_len), pages(branch_len)
    if case == "two_level":
        shared = [(trunk, trunk_len)] * 5
        paths = [[0]] * 5
    elif case == "three_level":
        shared = [(trunk + br_a, trunk_len + branch_len)] * 3 + [
            (trunk + br_b, trunk_len + branch_len)
        ] * 2
        paths = [[0, 1]] * 3 + [[0, 2]] * 2
    else:
        shared = [(trunk + br_a, trunk_len + branch_len)] * 2 + [(trunk, trunk_len)] * 2 + [([], 0)]
        paths = [[0, 1], [0, 1], [0], [0], []]
    own_lens = [rng.randint(1, 2 * ps + 3) for _ in paths]
    own = [pages(n) for n in own_lens]
    tables = [sp + o for (sp, _), o in zip(shared, own)]
    lens = [sl + n for (_, sl), n in zip(shared, own_lens)]
    nodes = {0: (trunk, trunk_len), 1: (br_a, branch_len), 2: (br_b, branch_len)}
    levels = []
    for depth in (0, 1):
        segs: list[tuple[int, list[int], int]] = []
        for p in paths:
            node = p[depth] if len(p) > depth else None
            pg, n = nodes[node] if node is not None else ([], 0)
            if segs and segs[-1][1] == pg and node is not None:
                segs[-1] = (segs[-1][0] + 1, pg, n)
            else:
                segs.append((1, pg, n))
        if any(n for _, _, n in segs):
            levels.append(level(ps, segs))
    levels.append(level(ps, [(1, o, n) for o, n in zip(own, own_lens)]))
    plan = CascadePlan(ps, len(paths), tuple(levels))
    return plan, tables, lens, 400


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", ["two_level", "three_level", "three_partial"])
def test_cascade(
    fake: FakeFlashInfer, case: str, page_size: int, dtype: torch.dtype, return_lse: bool
) -> None:
    hq, hkv, d = 8, 2, 64
    plan, tables, lens, num_pages = _cascade_case(case, page_size, seed=page_size)
    assert len(plan.levels) == (2 if case == "two_level" else 3)
    dev = fake.device
    g = torch.Generator().manual_seed(3)
    k = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    v = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(plan.num_queries, hq, d, generator=g).to(dtype)
    fi = FlashInferCascadeAttention(dev)
    for _ in range(2):  # a second step re-plans the same wrappers
        fi.plan(plan, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, q_data_type=dtype)
    assert fi._mode == ("per_level" if case == "three_partial" else "multi")
    res = fi.forward(_strided(q, dev), k.to(dev), v.to(dev), return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    assert out.shape == q.shape and out.dtype == dtype and out.device == dev
    if dev.type == "cpu":
        want = reference_decode(q, k, v, tables, lens)
        assert (out.double() - want).abs().max().item() <= TOL[dtype]
        if return_lse:
            _, want_lse = TorchCascadeAttention(plan).forward(
                q.float(), k.float(), v.float(), return_lse=True
            )
            assert lse is not None and lse.dtype == torch.float32
            assert (lse - want_lse).abs().max().item() <= 1e-3
    rec = fake.recorder
    assert rec.count(f"{PREFILL}.__init__") == len(plan.levels)  # one wrapper a level, reused
    assert rec.count(f"{PREFILL}.plan") == 2 * len(plan.levels)
    assert rec.count(f"{PREFILL}.run") == len(plan.levels)
    merges = rec.count("merge_state") + rec.count("merge_state_in_place")
    assert merges == (len(plan.levels) - 1 if fi._mode == "multi" else len(plan.levels))
    for c in rec.calls:
        if c.name == f"{PREFILL}.plan":
            assert c.args["causal"] is False
        if c.name == f"{PREFILL}.run":
            assert c.args["return_lse"] is True and c.args.get("lse_base", "log2") == "log2"


def test_one_level_plain_plan(fake: FakeFlashInfer) -> None:
    plan = CascadePlan.plain([[1, 2], [3]], [20, 5], 16)
    fi = FlashInferCascadeAttention(fake.device)
    fi.plan(plan, num_qo_heads=4, num_kv_heads=4, head_dim=64, q_data_type=torch.float16)
    dev = fake.device
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=dev)
    kv = torch.zeros(8, 16, 4, 64, dtype=torch.float16, device=dev)
    assert fi.forward(q, kv, kv.clone()).shape == (2, 4, 64)
    assert fake.recorder.count("merge_state_in_place") == 0


# ------------------------------------------------------------------------------------------------
# the stand-ins themselves catch what they are meant to catch
def _decode_wrapper(fake: FakeFlashInfer) -> object:
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=fake.device)
    return fake.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")


def _meta(fake: FakeFlashInfer, xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32).to(fake.device)


def test_standin_rejects_wrong_argument_names(fake: FakeFlashInfer) -> None:
    w = _decode_wrapper(fake)
    args = (
        torch.tensor([0, 1], dtype=torch.int32),
        _meta(fake, [0]),
        torch.tensor([3], dtype=torch.int32),
        4,
        2,
        64,
        16,
    )
    with pytest.raises(ContractError, match="unknown keyword"):
        w.plan(*args, q_dtype=torch.float16)  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="positionally"):
        w.plan(*args, "NONE")  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="missing a required argument"):
        w.plan(*args[:6])  # type: ignore[attr-defined]


def test_standin_rejects_int64_metadata_and_bad_types(fake: FakeFlashInfer) -> None:
    w = _decode_wrapper(fake)
    ok = dict(q_data_type=torch.float16, kv_data_type=torch.float16)
    with pytest.raises(ContractError, match="int32"):
        w.plan(
            torch.tensor([0, 1]),
            _meta(fake, [0]),
            torch.tensor([3], dtype=torch.int32),
            4,
            2,
            64,
            16,
            **ok,
        )  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="num_qo_heads"):
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            _meta(fake, [0]),
            torch.tensor([3], dtype=torch.int32),
            4.0,
            2,
            64,
            16,
            **ok,
        )  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="last_page_len"):
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            _meta(fake, [0]),
            torch.tensor([17], dtype=torch.int32),
            4,
            2,
            64,
            16,
            **ok,
        )  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="q_data_type"):
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            _meta(fake, [0]),
            torch.tensor([3], dtype=torch.int32),
            4,
            2,
            64,
            16,
            q_data_type=torch.float32,
        )  # type: ignore[attr-defined]


def test_standin_rejects_auto_kernels(fake: FakeFlashInfer) -> None:
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=fake.device)
    with pytest.raises(ContractError, match="pins FA2"):
        fake.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")


def test_standin_checks_placement_and_workspace(fake: FakeFlashInfer) -> None:
    if fake.device.type == "cpu":
        with pytest.raises(ContractError, match="zero-initialised"):
            fake.BatchPrefillWithPagedKVCacheWrapper(
                torch.ones(128 * 1024 * 1024, dtype=torch.uint8), "NHD", backend="fa2"
            )
        return
    w = _decode_wrapper(fake)
    with pytest.raises(ContractError, match="CPU tensor"):  # indptr on the GPU
        w.plan(
            _meta(fake, [0, 1]),
            _meta(fake, [0]),
            torch.tensor([3], dtype=torch.int32),
            4,
            2,
            64,
            16,
            q_data_type=torch.float16,
        )  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="on the GPU"):  # page indices on the CPU
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            4,
            2,
            64,
            16,
            q_data_type=torch.float16,
        )  # type: ignore[attr-defined]


def test_standin_checks_runs(fake: FakeFlashInfer) -> None:
    w = _decode_wrapper(fake)
    dev = fake.device
    q = torch.zeros(1, 4, 64, dtype=torch.float16, device=dev)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=dev)
    with pytest.raises(ContractError, match="before plan"):
        w.run(q, (cache, cache))  # type: ignore[attr-defined]
    w.plan(
        torch.tensor([0, 1], dtype=torch.int32),
        _meta(fake, [1]),
        torch.tensor([3], dtype=torch.int32),
        4,
        2,
        64,
        16,
        q_data_type=torch.float16,
    )  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="planned q_data_type"):
        w.run(q.bfloat16(), (cache, cache))  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="strides differ"):
        both = torch.zeros(2, 2, 16, 2, 64, dtype=torch.float16, device=dev)
        w.run(q, (both[:, 0], torch.zeros_like(both[:, 1])))  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match="NHD"):
        w.run(q, (cache.transpose(1, 2), cache.transpose(1, 2)))  # type: ignore[attr-defined]
    s = torch.zeros(1, 4, dtype=torch.float16, device=dev)
    with pytest.raises(ContractError, match="float32"):
        fake.merge_state_in_place(q, s, q, s.float())


def test_standin_multilevel_wrapper(fake: FakeFlashInfer) -> None:
    """The multi-level stand-in (kept for callers of FlashInfer's own cascade wrapper) binds to the
    real class and agrees with the per-level path."""
    plan, tables, lens, num_pages = _cascade_case("three_level", 16, seed=1)
    dev = fake.device
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(num_pages, 16, 2, 64, generator=g).half().to(dev) for _ in range(2))
    q = torch.randn(plan.num_queries, 8, 64, generator=g).half().to(dev)
    ws = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    multi = fake.MultiLevelCascadeAttentionWrapper(len(plan.levels), ws, "NHD")
    i32 = lambda xs, d="cpu": torch.tensor(list(xs), dtype=torch.int32).to(d)  # noqa: E731
    multi.plan(  # type: ignore[attr-defined]
        [i32(lv.qo_indptr) for lv in plan.levels],
        [i32(lv.kv_indptr) for lv in plan.levels],
        [i32(lv.kv_indices, dev) for lv in plan.levels],
        [i32(lv.kv_last_page_len) for lv in plan.levels],
        8, 2, 64, 16, q_data_type=torch.float16,
    )  # fmt: skip
    out = multi.run(q, (k, v))  # type: ignore[attr-defined]
    if dev.type == "cpu":
        want = reference_decode(q, k, v, tables, lens)
        assert (out.double() - want).abs().max().item() <= TOL[torch.float16]
    assert not hasattr(multi, "_batch_prefill_wrappers")
