"""KV pages stored in another dtype than the model computes in (``kv_cache_dtype``): fp8 pages
hold what the pool's conversion gives, attention over them equals attention over those values
in the compute dtype, pages move between pool, host tier and storage byte for byte, and the
engine's cache changes no output (hit or miss, chunked or not, loaded back from the host tier
or from storage) while the same memory holds twice the pages of bf16."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch
from engine_helpers import run_checked

from radixkv.attention.base import BatchLayout
from radixkv.attention.paged_ops import GatherBuffer
from radixkv.attention.torch_backend import TorchAttention
from radixkv.cli import build_parser
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool, load_as, parse_kv_cache_dtype, store_as
from radixkv.model.loader import LoadedModel, load_model

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- the pool --------------------------------------------------------------------------------
def test_fp8_pool_stores_the_conversion_and_saturates() -> None:
    pool = KVPool(2, 8, 4, 2, 8, E4M3, compute_dtype=torch.bfloat16)
    assert pool.converts and pool.compute_dtype == torch.bfloat16
    bf16 = KVPool(2, 8, 4, 2, 8, torch.bfloat16)
    assert pool.bytes_per_page * 2 == bf16.bytes_per_page
    assert "compute_dtype=torch.bfloat16" in repr(pool)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(6, 2, 8, generator=gen) * 3).to(torch.bfloat16)
    v = torch.randn(6, 2, 8, generator=gen).to(torch.bfloat16)
    k[0, 0, 0], k[1, 1, 1], v[2, 0, 3] = 1000.0, -1e6, float("inf")  # past e4m3's +-448
    slots = torch.tensor([0, 1, 2, 5, 8, 13])
    pool.write(1, slots, k, v)
    stored_k = pool.k_flat(1)[slots].to(torch.bfloat16)
    stored_v = pool.v_flat(1)[slots].to(torch.bfloat16)
    assert torch.equal(stored_k, pool.as_stored(k))
    assert torch.equal(stored_v, pool.as_stored(v))
    assert not torch.isnan(stored_k).any() and not torch.isnan(stored_v).any()
    assert stored_k[0, 0, 0] == 448 and stored_k[1, 1, 1] == -448 and stored_v[2, 0, 3] == 448
    assert not torch.equal(pool.as_stored(k), k)  # fp8 really rounds
    assert (pool.as_stored(k) - k).abs().max() > 0
    assert not _bytes(pool.k[0]).any()  # layer 0 untouched
    # a gather converts the stored pages back into the compute dtype
    buf = GatherBuffer()
    pages = torch.tensor([3, 0])
    got = buf.gather(pool.k[1], pages, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, pool.k[1].index_select(0, pages).to(torch.bfloat16))
    # copy_pages moves bytes
    pool.copy_pages([0, 1], [6, 7])
    assert torch.equal(_bytes(pool.k[:, 6:8]), _bytes(pool.k[:, 0:2]))
    assert torch.equal(_bytes(pool.v[:, 6:8]), _bytes(pool.v[:, 0:2]))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("wide", [torch.bfloat16, torch.float16, torch.float32])
def test_load_as_is_exact_on_every_value_a_page_can_hold(
    fp8: torch.dtype, wide: torch.dtype
) -> None:
    """The bit-move conversion gives PyTorch's own conversion on every byte store_as can write
    (zero and every finite normal value), into a fresh tensor or into ``out``."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8)
    ref = values.float()
    exponent = values.view(torch.uint8).bitwise_and(0x78 if fp8 == E4M3 else 0x7C)
    holdable = torch.isfinite(ref) & ((exponent != 0) | (ref == 0))
    assert int(holdable.sum()) in (240, 242)  # 256 less NaN/inf and the subnormals
    assert torch.equal(load_as(values, wide)[holdable], values.to(wide)[holdable])
    out = torch.full((256,), 7.0, dtype=wide)
    assert load_as(values, wide, out) is out
    assert torch.equal(out[holdable], values.to(wide)[holdable])
    # store_as writes only holdable bytes: saturated, subnormals flushed, round trip exact
    x = torch.cat([torch.randn(1000) * 50, torch.tensor([1e9, -1e9, float("inf"), 1e-7, -1e-7])])
    stored = store_as(x, fp8)
    back = stored.float()
    assert torch.isfinite(back).all() and back.abs().max() == {E4M3: 448, E5M2: 57344}[fp8]
    assert back[-2] == 0 and back[-1] == 0
    assert torch.equal(load_as(stored, wide), stored.to(wide))
    # a flush-to-zero CPU mode changes nothing: no holdable value is a subnormal, in or out
    if torch.set_flush_denormal(True):
        try:
            assert torch.equal(load_as(values, wide)[holdable], values.to(wide)[holdable])
        finally:
            torch.set_flush_denormal(False)


def test_a_pool_in_its_own_dtype_is_unchanged() -> None:
    pool = KVPool(1, 4, 4, 1, 8, torch.float32)
    x = torch.randn(3, 1, 8)
    assert not pool.converts and pool.as_stored(x) is x
    assert "compute_dtype" not in repr(pool)


def test_bad_dtypes_are_named() -> None:
    with pytest.raises(ValueError, match="needs compute_dtype"):
        KVPool(1, 4, 4, 1, 8, E4M3)
    with pytest.raises(TypeError, match="compute_dtype must be"):
        KVPool(1, 4, 4, 1, 8, E4M3, compute_dtype=E5M2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        parse_kv_cache_dtype("int4", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp4")
    assert parse_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert parse_kv_cache_dtype("fp8", torch.float32) == E4M3
    assert parse_kv_cache_dtype("fp8_e5m2", torch.float32) == E5M2


# ---- attention over stored pages ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("stored", "compute"),
    [(E4M3, torch.float32), (E5M2, torch.float32), (E4M3, torch.bfloat16), (torch.bfloat16, torch.float32)],
)  # fmt: skip
def test_attention_reads_pages_as_stored(stored: torch.dtype, compute: torch.dtype) -> None:
    """Every path of the torch backend (fresh prefill, prefill on past pages, padded decode
    groups) over a converting pool gives exactly what a pool in the compute dtype gives when
    handed the stored values: nothing but the storage differs."""
    ps, hq, hkv, d = 4, 4, 2, 16
    gen = torch.Generator().manual_seed(1)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(compute)

    conv = KVPool(1, 32, ps, hkv, d, stored, compute_dtype=compute)
    ref = KVPool(1, 32, ps, hkv, d, compute)
    a, b = TorchAttention(conv, hq, hkv, d), TorchAttention(ref, hq, hkv, d)
    pt1, pt2 = list(range(0, 8)), list(range(8, 16))
    steps = [  # (page tables, past, new)
        ((pt1, pt2), (0, 0), (13, 6)),  # fresh prefills
        ((pt1,), (13,), (7,)),  # a prefill on 13 past tokens
        ((pt1, pt2), (20, 6), (1, 1)),  # decode, two lengths in one group (padding mask)
    ]
    for tables, past, new in steps:
        n = sum(new)
        q, k, v = rnd(n, hq, d), rnd(n, hkv, d), rnd(n, hkv, d)
        layout = BatchLayout.build(list(tables), list(past), list(new))
        a.plan(layout)
        b.plan(layout)
        out = a.forward(0, q, k, v)
        want = b.forward(0, q, conv.as_stored(k), conv.as_stored(v))
        assert out.dtype == compute
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6 if compute == torch.float32 else 0)
    assert torch.equal(conv.k.to(compute), ref.k) and torch.equal(conv.v.to(compute), ref.v)


# ---- moving pages ------------------------------------------------------------------------------
def test_fp8_pages_round_trip_host_and_storage_bytes() -> None:
    kv = KVPool(2, 8, 4, 2, 8, E5M2, compute_dtype=torch.float32)
    kv.write(0, torch.arange(32), torch.randn(32, 2, 8), torch.randn(32, 2, 8))
    kv.write(1, torch.arange(32), torch.randn(32, 2, 8), torch.randn(32, 2, 8))
    host = HostKVPool.like(kv, 4)
    assert host.dtype == E5M2 and host.bytes_per_page == kv.bytes_per_page
    copier = KVCopier(kv, host, background=False)
    copier.to_host([(1, 3), (2, 0)]).wait()
    copier.to_device([(3, 6), (0, 7)]).wait()
    assert torch.equal(_bytes(kv.k[:, 6:8]), _bytes(kv.k[:, 1:3]))
    assert torch.equal(_bytes(kv.v[:, 6:8]), _bytes(kv.v[:, 1:3]))
    # the storage payload: read_pages rows written into other host pages are the same bytes
    rows = host.read_pages([3, 0])
    assert rows.shape == (2, host.bytes_per_page)
    host.write_pages([1, 2], [r.numpy().tobytes() for r in rows])
    assert torch.equal(_bytes(host.k[1:3]), _bytes(host.k[[3, 0]]))
    assert torch.equal(_bytes(host.v[1:3]), _bytes(host.v[[3, 0]]))
    copier.close()


# ---- the engine --------------------------------------------------------------------------------
def _prompts(seed: int, n: int = 5, shared: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(shared)]
    return [system + [rng.randrange(5, 250) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_engine_cache_changes_no_output_with_fp8_pages(
    tiny: LoadedModel, kv_cache_dtype: str
) -> None:
    """Cold, warm (prefix served from fp8 pages) and chunked runs agree token for token, and
    every page and lock is accounted for after each step."""
    prompts = _prompts(0)
    eng = Engine(tiny, page_size=4, num_pages=256, kv_cache_dtype=kv_cache_dtype)
    assert eng.kv_pool.dtype == parse_kv_cache_dtype(kv_cache_dtype, torch.float32)
    assert eng.kv_pool.compute_dtype == torch.float32
    cold = [o.outputs[0].token_ids for o in run_checked(eng, prompts, GREEDY)]
    warm_out = run_checked(eng, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in warm_out] == cold
    assert all(o.num_cached_tokens >= 40 for o in warm_out)
    chunked = Engine(
        tiny, page_size=4, num_pages=256, kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=8
    )
    assert [o.outputs[0].token_ids for o in run_checked(chunked, prompts, GREEDY)] == cold
    # beams fork by copying their tail page: through the byte view
    (beams,) = eng.generate(
        [prompts[0]], SamplingParams(max_tokens=4, beam_width=3, n=3), use_tqdm=False
    )
    assert len({tuple(c.token_ids) for c in beams.outputs}) == 3
    eng.check_invariants()


def test_same_memory_holds_more_pages(tiny: LoadedModel) -> None:
    budget = 4 << 20
    pages = {
        kvd: Engine(tiny, page_size=4, kv_cache_memory=budget, kv_cache_dtype=kvd).kv_pool.num_pages
        for kvd in ("auto", "bfloat16", "fp8")
    }
    assert pages["bfloat16"] == 2 * pages["auto"]  # the model computes in float32
    assert pages["fp8"] == 4 * pages["auto"]


def test_fp8_pages_load_back_from_the_host_tier(tiny: LoadedModel) -> None:
    """A pool too small for the working set: prefixes go to the host tier as fp8 bytes and load
    back with the outputs of an engine that never evicts."""
    opts = dict(page_size=4, kv_cache_dtype="fp8_e4m3")
    prompts = [p for s in range(4) for p in _prompts(s, n=3)]
    ref = Engine(tiny, num_pages=1024, **opts)
    want = [o.outputs[0].token_ids for o in run_checked(ref, prompts + prompts, GREEDY)]
    eng = Engine(tiny, num_pages=48, host_cache_memory=4 << 20, **opts)
    got = [o.outputs[0].token_ids for o in run_checked(eng, prompts + prompts, GREEDY)]
    assert got == want
    eng.cache.wait_all()
    st = eng.stats()
    assert st.prefix_cache_host_hit_tokens > 0 and st.load_back_pages > 0


def test_storage_keeps_fp8_pages_apart(tiny: LoadedModel, tmp_path: Path) -> None:
    """Pages stored by an fp8 engine load into a restarted fp8 engine (same outputs) and never
    into one that stores another dtype: the storage key names the KV format."""
    url = f"file://{tmp_path}"
    opts = dict(page_size=4, num_pages=256, host_cache_memory=2_000_000, kv_storage=url)
    prompts = _prompts(5, n=3, shared=96)
    with Engine(tiny, kv_cache_dtype="fp8", **opts) as eng:
        first = [o.outputs[0].token_ids for o in run_checked(eng, prompts, GREEDY)]
    with Engine(tiny, **opts) as other:  # float32 pages: none of the stored ones fit
        run_checked(other, prompts, GREEDY)
        assert other.stats().prefix_cache_storage_hit_tokens == 0
    with Engine(tiny, kv_cache_dtype="fp8_e4m3", **opts) as again:
        assert [o.outputs[0].token_ids for o in run_checked(again, prompts, GREEDY)] == first
        assert again.stats().prefix_cache_storage_hit_tokens >= 96


def test_cascade_decode_over_fp8_pages(tiny: LoadedModel) -> None:
    """Branches sharing a prompt decode through the cascade (shared pages gathered once, then
    converted) with the outputs of plain paged decode over the same fp8 pages."""
    rng = random.Random(7)
    shared = [rng.randrange(5, 250) for _ in range(64)]
    prompts = [shared + [rng.randrange(5, 250) for _ in range(3)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = {}
    for mode in ("off", "on"):
        eng = Engine(tiny, page_size=4, num_pages=256, kv_cache_dtype="fp8", cascade=mode)
        outs[mode] = [o.outputs[0].token_ids for o in run_checked(eng, prompts, params)]
        if mode == "on":
            assert eng.stats().cascade_steps > 0
    assert outs["on"] == outs["off"]


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """--kv-cache-dtype on every command that builds an engine; a bad name is refused."""
    parser = EngineConfig.add_cli_arguments(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(parser.parse_args([])).kv_cache_dtype == "auto"
    args = parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert EngineConfig.from_cli_args(args).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    cli = build_parser()
    for command in (["demo"], ["generate", "x"]):
        assert cli.parse_args([*command, "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
