"""Matrix products on a CPU through oneDNN: fp32 where PyTorch's BLAS runs at half speed, and
weights packed once into oneDNN's own layout for fp32 and bf16 inference.

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

Packed weights (:func:`pack_weight`, ``torch.ops.mkldnn._reorder_linear_weight``: what
``torch.compile``'s frozen CPU graphs do). Given a weight in PyTorch's plain layout, oneDNN
first copies it into its blocked layout, on every call; a model weight never changes during
inference, so the copy can be made once. The per-call copy reads and writes the whole weight
for every product, which a decode step of a few rows does not amortise: measured on a 2-core
AMD EPYC (Zen 4), radixkv-tiny's linear layers for 32 rows (a decode step of 32 sequences)
take 5.2 ms unpacked and 3.7 ms packed in fp32, 2.9 and 1.9 ms in bf16; for 256 rows (a
prefill chunk) 5-10% less; for a single bf16 row 1.06 against 0.42 ms. Outputs are
bit-identical to the unpacked oneDNN product's from 2 rows up (measured there). A single fp32
row rounds differently packed (a few ulps) and runs no faster (7% slower in that
measurement), so the model's Linear multiplies it by the plain weight. The
packed copy is a second copy of the weight in memory (the model's Linear keeps it beside its
parameter): ``PREPACK = False``, or the environment variable ``RADIXKV_PREPACK=0`` read at
import, turns packing off.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

USE_ONEDNN = True  # read per call: tests and studies may turn the oneDNN path off
# read per call too; the environment variable is for the command line and the server
PREPACK = os.environ.get("RADIXKV_PREPACK", "1").strip() not in ("0", "false", "no", "off")
# the row count oneDNN is told to expect when it picks the packed layout: a decode batch.
# (1 would keep fp32 weights plain, with no gain; 32 and 256 pick layouts that run every row
# count from 1 to 1,000 as fast as or faster than the plain weight, measured)
PACK_ROWS = 32
PACKED_DTYPES = (torch.float32, torch.bfloat16)

# (input, weight, bias, post-op name, post-op scalars, algorithm) -> output; None when missing
_ONEDNN_LINEAR: Callable[..., torch.Tensor] | None = getattr(
    torch.ops.mkldnn, "_linear_pointwise", None
)
# (weight, expected rows) -> the weight in oneDNN's layout (an opaque mkldnn tensor)
_REORDER: Callable[..., torch.Tensor] | None = getattr(
    torch.ops.mkldnn, "_reorder_linear_weight", None
)
_STATE: dict[str, bool] = {}  # "ok" -> the probe succeeded / failed
_PACK_STATE: dict[torch.dtype, bool] = {}  # dtype -> packing and a packed product worked / failed


def onednn_available() -> bool:
    """Whether CPU fp32 inference runs through oneDNN (the op exists, has not failed, and
    ``USE_ONEDNN`` is on)."""
    return USE_ONEDNN and _ONEDNN_LINEAR is not None and _STATE.get("ok") is not False


def packing_available(dtype: torch.dtype) -> bool:
    """Whether CPU inference in ``dtype`` may use packed weights: fp32 or bf16, both ops
    present, ``PREPACK`` and ``USE_ONEDNN`` on, and no failure seen for that dtype."""
    return (
        PREPACK
        and USE_ONEDNN
        and dtype in PACKED_DTYPES
        and _ONEDNN_LINEAR is not None
        and _REORDER is not None
        and _PACK_STATE.get(dtype) is not False
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [out, in]`` (CPU, fp32 or bf16) copied into oneDNN's layout for
    :func:`linear`'s ``packed`` argument, or None where packing is unavailable (see
    :func:`packing_available`) or fails (then never tried again for that dtype). The copy does
    not follow later changes of ``weight``: the caller packs again (radixkv/model/linear.py)."""
    if weight.device.type != "cpu" or not packing_available(weight.dtype):
        return None
    assert _REORDER is not None
    try:
        with torch.inference_mode():
            return _REORDER(weight.detach(), PACK_ROWS)
    except (RuntimeError, TypeError):
        _PACK_STATE[weight.dtype] = False
        return None


def _probed_product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, state: dict, key: object
) -> torch.Tensor | None:
    """oneDNN's ``x @ w^T + bias``, its outcome recorded in ``state[key]``; None when it fails
    before it ever worked (a missing kernel: callers fall back), raises when it fails after."""
    assert _ONEDNN_LINEAR is not None
    try:
        out = _ONEDNN_LINEAR(x, w, bias, "none", [], "")
    except (RuntimeError, TypeError):
        if state.get(key):
            raise  # worked before: a real error, not a missing kernel
        state[key] = False
        return None
    state[key] = True
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight^T + bias``), through oneDNN for CPU fp32
    inference (module docstring). ``weight`` may be a strided view, e.g. ``v.t()``.
    ``packed``: ``pack_weight(weight)``, used for CPU inference in its dtype (fp32 or bf16)."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    if packed is not None and x.dtype is packed.dtype and USE_ONEDNN:
        out = _probed_product(x, packed, bias, _PACK_STATE, x.dtype)
        if out is not None:
            return out
    if x.dtype is torch.float32 and onednn_available():
        out = _probed_product(x, weight, bias, _STATE, "ok")
        if out is not None:
            return out
    return F.linear(x, weight, bias)
