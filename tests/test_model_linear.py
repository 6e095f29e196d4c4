"""The model's Linear: oneDNN for CPU inference (fp32, and packed weights in fp32 and bf16),
F.linear everywhere else, same results."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import radixkv.onednn as onednn_mod
from radixkv.model.linear import Linear
from radixkv.onednn import onednn_available, packing_available

# whether this PyTorch can pack at all (the ops exist); tests of the packed copy need it
CAN_PACK = onednn_mod._REORDER is not None and onednn_mod._ONEDNN_LINEAR is not None
needs_packing = pytest.mark.skipif(not CAN_PACK, reason="this PyTorch has no oneDNN weight packing")
# whether this CPU can pack bf16 weights: oneDNN's bf16 reorder needs avx512bw/vl/dq or
# avx_ne_convert (an AVX2-only CPU has neither; there bf16 falls back to F.linear, tested below)
BF16_PACKS = CAN_PACK and bool(
    getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()
)


def _check_bf16_pack(layer: Linear) -> None:
    """bf16 weights are packed where the CPU has the units, and otherwise left plain, with the
    failed probe recorded so no later call tries again (the fallback path)."""
    if BF16_PACKS:
        assert layer._packed is not None and layer._packed.dtype == torch.bfloat16
    else:
        assert layer._packed is None
        assert onednn_mod._PACK_STATE.get(torch.bfloat16) is False
        assert not packing_available(torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test probes the ops from scratch, with packing on (whatever the environment says)."""
    monkeypatch.setattr(onednn_mod, "_STATE", {})
    monkeypatch.setattr(onednn_mod, "_PACK_STATE", {})
    monkeypatch.setattr(onednn_mod, "PREPACK", True)


def _pair(bias: bool, rows: int = 37) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    return layer, torch.randn(rows, 96)


def _reference(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    b = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), b)


@pytest.mark.parametrize("rows", [1, 8, 37, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_matches_f_linear(bias: bool, rows: int) -> None:
    layer, x = _pair(bias, rows)
    with torch.inference_mode():
        got = layer(x)
    with torch.no_grad():
        got_no_grad = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    assert (got.double() - _reference(layer, x)).abs().max().item() < 1e-4
    assert torch.equal(got, got_no_grad)
    if onednn_mod._ONEDNN_LINEAR is not None:
        assert onednn_available()  # the probe succeeded: this PyTorch has it
    if CAN_PACK:  # a lone fp32 row keeps the plain weight (radixkv/onednn.py)
        assert (layer._packed is not None) is (rows > 1)


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 8, 37])
def test_packed_rows_match_the_unpacked_product(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing changes the speed, not the result (measured on this project's CPUs; a lone fp32
    row is not packed at all)."""
    layer, x = _pair(True, rows)
    assert layer.pack()
    with torch.inference_mode():
        got = layer(x)
        monkeypatch.setattr(onednn_mod, "PREPACK", False)
        unpacked = layer(x)
    assert (got - unpacked).abs().max().item() <= 1e-5 * unpacked.abs().max().item()


@needs_packing
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_bf16_inference_runs_packed_and_matches(rows: int) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 200).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    with torch.inference_mode():
        got = layer(x)
    _check_bf16_pack(layer)
    assert got.dtype == torch.bfloat16
    want = F.linear(x, layer.weight, layer.bias)  # bf16 rounding on both sides
    assert (got.float() - want.float()).abs().max().item() <= 0.05 * want.abs().max().item()
    assert (got.double() - _reference(layer, x)).abs().max().item() < 0.1


def test_training_and_other_dtypes_use_f_linear_exactly() -> None:
    layer, x = _pair(True)
    x.requires_grad_(True)
    out = layer(x)  # grad enabled: F.linear, with its autograd
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    assert layer._packed is None  # training never packs
    with torch.inference_mode():
        l64 = Linear(96, 200).double()
        x64 = x.detach().double()
        assert torch.equal(l64(x64), F.linear(x64, l64.weight, l64.bias))
        assert l64._packed is None


@needs_packing
def test_the_packed_copy_follows_the_weight() -> None:
    """Every way a weight changes reaches the next call: in place, a loaded state dict, a new
    Parameter, a cast; an unchanged weight is packed once."""
    layer, x = _pair(True)

    def check() -> None:
        with torch.inference_mode():
            got = layer(x)
        assert (got.double() - _reference(layer, x)).abs().max().item() < 1e-3

    check()
    packed = layer._packed
    check()
    assert layer._packed is packed  # packed once while the weight stays
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    check()
    assert layer._packed is not packed
    other = nn.Linear(96, 200)
    layer.load_state_dict(other.state_dict())
    check()
    layer.weight = nn.Parameter(torch.randn(200, 96))
    check()
    layer.to(torch.bfloat16)
    assert layer._packed is None  # dropped by the cast
    x = x.bfloat16()
    with torch.inference_mode():
        got = layer(x)
    _check_bf16_pack(layer)
    assert (got.double() - _reference(layer, x)).abs().max().item() < 0.2


@needs_packing
def test_state_dict_copies_and_pickles_never_carry_the_packed_copy() -> None:
    layer, x = _pair(True)
    with torch.inference_mode():
        want = layer(x)
    assert layer._packed is not None
    plain = nn.Linear(96, 200)
    assert list(layer.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert twin._packed is None
        with torch.inference_mode():
            assert torch.equal(twin(x), want)  # packs its own, the same way
        assert twin._packed is not None
    assert "oneDNN" in repr(layer)


def test_switches_off(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, x = _pair(True)
    monkeypatch.setattr(onednn_mod, "PREPACK", False)
    assert not packing_available(torch.float32)
    with torch.inference_mode():
        got = layer(x)
    assert layer._packed is None
    assert (got.double() - _reference(layer, x)).abs().max().item() < 1e-4
    monkeypatch.setattr(onednn_mod, "USE_ONEDNN", False)
    assert not onednn_available() and not packing_available(torch.float32)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_failing_kernel_falls_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyTorch whose op is missing or refuses the call runs F.linear from then on."""
    layer, x = _pair(False)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(onednn_mod, "_ONEDNN_LINEAR", broken)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert onednn_mod._STATE == {"ok": False} and not onednn_available()
    if CAN_PACK:
        assert onednn_mod._PACK_STATE.get(torch.float32) is False


def test_a_failing_packer_leaves_the_unpacked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, x = _pair(True)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("cannot reorder")

    monkeypatch.setattr(onednn_mod, "_REORDER", broken)
    with torch.inference_mode():
        got = layer(x)
    assert layer._packed is None and not packing_available(torch.float32)
    assert (got.double() - _reference(layer, x)).abs().max().item() < 1e-4
    if onednn_mod._ONEDNN_LINEAR is not None:
        assert onednn_available()  # the unpacked oneDNN product still runs


@needs_packing
def test_the_runner_packs_every_linear_when_it_starts() -> None:
    """No request pays for packing: the CPU runner packs every layer up front."""
    from radixkv.kv.kv_pool import KVPool
    from radixkv.model.loader import load_model
    from radixkv.model.runner import ModelRunner

    model = load_model("radixkv-tiny-random", dtype="float32").model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for m in linears:
        m.drop_packed()
    cfg = model.config
    pool = KVPool(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, pool)
    assert linears and all(m._packed is not None for m in linears)
    assert runner.packed_weight_bytes == sum(4 * m.weight.numel() for m in linears)
    packed = [m._packed for m in linears]
    ModelRunner(model, pool)  # a second runner on the same model packs nothing again
    assert all(m._packed is p for m, p in zip(linears, packed, strict=True))


def test_pack_says_whether_a_copy_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, _ = _pair(True)
    assert layer.pack() is CAN_PACK
    assert (layer._packed is not None) is CAN_PACK
    assert Linear(4, 4).double().pack() is False  # no packed layout for float64
    layer.drop_packed()
    monkeypatch.setattr(onednn_mod, "PREPACK", False)
    assert layer.pack() is False and layer._packed is None
