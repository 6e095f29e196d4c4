"""fp32 matrix products on a CPU through oneDNN, where PyTorch's BLAS runs at half speed.

PyTorch's CPU fp32 matmuls (``F.linear``, ``torch.mm``, ``torch.bmm``) call its BLAS (MKL in
the official wheels). MKL picks its kernels by CPU vendor, and on AMD CPUs it runs its AVX2
ones even where AVX-512 is there: measured on a 2-core AMD EPYC (Zen 5), MKL reaches about 105
GFLOP/s a core and oneDNN (the library PyTorch already ships for its bf16 and compiled CPU
paths) about 230, for radixkv-tiny's linear layers (256 rows, as in a prefill chunk; 80 vs 165
for a decode step of 32 rows) and for attention's ``q @ k^T`` and ``p @ v`` alike.

:func:`linear` is ``F.linear`` through PyTorch's private ``torch.ops.mkldnn._linear_pointwise``
(the op ``torch.compile`` uses on CPUs) for CPU fp32 inference (under ``torch.inference_mode``
or ``torch.no_grad``: the op has no autograd formula). The op is probed on its first call: a
PyTorch without it, or a first call that fails, runs ``F.linear`` from then on. Results equal
``F.linear``'s to fp32 rounding (a different summation order). ``USE_ONEDNN = False`` (read per
call) turns it off. Its users: every model Linear (radixkv/model/linear.py) and the CPU
prefill attention (radixkv/attention/matmul_attention.py: its fp32 scores whatever the model's
dtype, and ``p @ v`` in fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

USE_ONEDNN = True  # read per call: tests and studies may turn the oneDNN path off

# (input, weight, bias, post-op name, post-op scalars, algorithm) -> output; None when missing
_ONEDNN_LINEAR: Callable[..., torch.Tensor] | None = getattr(
    torch.ops.mkldnn, "_linear_pointwise", None
)
_STATE: dict[str, bool] = {}  # "ok" -> the probe succeeded / failed


def onednn_available() -> bool:
    """Whether CPU fp32 inference runs through oneDNN (the op exists, has not failed, and
    ``USE_ONEDNN`` is on)."""
    return USE_ONEDNN and _ONEDNN_LINEAR is not None and _STATE.get("ok") is not False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight^T + bias``), through oneDNN for CPU fp32
    inference (module docstring). ``weight`` may be a strided view, e.g. ``v.t()``."""
    if (
        x.dtype is torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and onednn_available()
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
