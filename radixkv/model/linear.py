"""``Linear``: ``nn.Linear`` whose inference forward on a CPU in fp32 runs oneDNN's matmul.

PyTorch's CPU ``F.linear`` in fp32 calls its BLAS (MKL in the official wheels). MKL picks its
kernels by CPU vendor, and on AMD CPUs it runs its AVX2 ones even where AVX-512 is there:
measured on a 2-core AMD EPYC (Zen 5) with radixkv-tiny's shapes, MKL reaches about 105 GFLOP/s
a core, oneDNN (the library PyTorch already ships for its bf16 and compiled CPU paths) about
230, for 256 rows as for a 2,048-token prefill chunk, and 80 vs 165 for a decode step of 32
rows. The op is PyTorch's private
``torch.ops.mkldnn._linear_pointwise`` (the one ``torch.compile`` uses on CPUs), so it is probed
on first use and ``F.linear`` stays the fallback: a PyTorch without it, or a failing call, runs
the BLAS path.

Same parameters and state dict as ``nn.Linear`` (Hugging Face names load unchanged). Only
inference takes the oneDNN path (no autograd formula there): under ``torch.inference_mode`` or
``torch.no_grad``; training (tools/train_tiny.py) and any other dtype or device use
``F.linear``. Results equal ``F.linear``'s to fp32 rounding (a different summation order):
logits agree with Hugging Face's within the tests' 1e-4, and greedy tokens with it on the test
prompts. ``USE_ONEDNN = False`` (module attribute, read per call) turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

USE_ONEDNN = True  # read per call: tests and studies may turn the oneDNN path off

# (input, weight, bias, post-op name, post-op scalars, algorithm) -> output; None when missing
_ONEDNN_LINEAR: Callable[..., torch.Tensor] | None = getattr(
    torch.ops.mkldnn, "_linear_pointwise", None
)
_STATE: dict[str, bool] = {}  # "ok" -> the probe succeeded / failed


def onednn_linear_available() -> bool:
    """Whether CPU fp32 inference runs through oneDNN (the op exists, has not failed, and
    ``USE_ONEDNN`` is on)."""
    return USE_ONEDNN and _ONEDNN_LINEAR is not None and _STATE.get("ok") is not False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for CPU fp32 inference (module docstring)."""
    if (
        x.dtype is torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and onednn_linear_available()
    ):
        assert _ONEDNN_LINEAR is not None
        try:
            out = _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        except (RuntimeError, TypeError):
            if _STATE.get("ok"):
                raise  # worked before: a real error, not a missing kernel
            _STATE["ok"] = False
        else:
            _STATE["ok"] = True
            return out
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` with :func:`linear` as its forward (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", cpu fp32 inference: oneDNN"
