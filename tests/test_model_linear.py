"""The model's Linear: oneDNN for CPU fp32 inference, F.linear everywhere else, same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import radixkv.onednn as onednn_mod
from radixkv.model.linear import Linear
from radixkv.onednn import onednn_available


def _pair(bias: bool) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    return layer, torch.randn(37, 96)


@pytest.mark.parametrize("bias", [True, False])
def test_inference_matches_f_linear(bias: bool) -> None:
    layer, x = _pair(bias)
    want = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
    with torch.inference_mode():
        got = layer(x)
    with torch.no_grad():
        got_no_grad = layer(x)
    assert got.dtype == torch.float32 and got.shape == (37, 200)
    assert (got.double() - want).abs().max().item() < 1e-4
    assert torch.equal(got, got_no_grad)
    if onednn_mod._ONEDNN_LINEAR is not None:
        assert onednn_available()  # the probe succeeded: this PyTorch has it


def test_training_and_other_dtypes_use_f_linear_exactly() -> None:
    layer, x = _pair(True)
    x.requires_grad_(True)
    out = layer(x)  # grad enabled: F.linear, with its autograd
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        x16 = x.detach().bfloat16()
        l16 = Linear(96, 200).bfloat16()
        assert torch.equal(l16(x16), F.linear(x16, l16.weight, l16.bias))


def test_switch_off_and_state_dict_like_nn_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, x = _pair(True)
    monkeypatch.setattr(onednn_mod, "USE_ONEDNN", False)
    assert not onednn_available()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    plain = nn.Linear(96, 200)
    assert list(layer.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    assert "oneDNN" in repr(layer)


def test_a_failing_kernel_falls_back_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A PyTorch whose op is missing or refuses the call runs F.linear from then on."""
    layer, x = _pair(False)

    def broken(*_: object) -> torch.Tensor:
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(onednn_mod, "_ONEDNN_LINEAR", broken)
    monkeypatch.setattr(onednn_mod, "_STATE", {})
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert onednn_mod._STATE == {"ok": False} and not onednn_available()
