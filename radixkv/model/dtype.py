"""``dtype="auto"``: which dtype a checkpoint is served in on a given device.

The one place that decides it (the loader asks here; nothing else second-guesses the answer),
so a finer rule for some device only changes :func:`auto_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.model.cpu_bf16 import CpuBf16, cpu_bf16

AUTO = "auto"

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` chose: ``dtype``, and ``note`` (None when it is simply the checkpoint's
    dtype) saying why it differs from the checkpoint's, for the log."""

    dtype: torch.dtype
    note: str | None = None


def auto_dtype(
    checkpoint: torch.dtype, device: torch.device, *, bf16: CpuBf16 | None = None
) -> DtypeChoice:
    """The dtype to serve a checkpoint stored in ``checkpoint`` (its config.json
    ``torch_dtype``) on ``device`` with, when the user asked for ``"auto"``.

    The rule (vLLM's "auto" on GPUs, extended to CPUs by what their matrix units can do):

    - on a GPU (any non-CPU device): a half-precision checkpoint as stored; a float32 one in
      bfloat16 (float16 on a CUDA GPU without bf16), as vLLM does: the attention kernels
      (FlashInfer) have no float32 variant, and half the bytes is twice the decode speed;
    - on a CPU with native bf16 matrix units (AVX512-BF16 or AMX; ``bf16``, default
      :func:`~radixkv.model.cpu_bf16.cpu_bf16`): bfloat16, whatever the checkpoint (float16
      has the same width and a narrower range, so nothing that fit overflows; CPUs have no fast
      float16 matmuls); bf16 matmuls there run 2-4x faster than float32;
    - on any other CPU: float32, since PyTorch runs half matmuls there through conversion
      loops, several times slower than float32.

    Every change from the checkpoint's dtype comes with a ``note`` for the log. bf16 trades
    bit-exact reproducibility (docs/tuning.md): pass ``dtype=None`` (the checkpoint's) or an
    explicit dtype to keep it. Explicit dtypes never come here.
    """
    name = str(checkpoint).removeprefix("torch.")
    if device.type != "cpu":
        if checkpoint in _HALF:
            return DtypeChoice(checkpoint)
        half = torch.bfloat16
        if device.type == "cuda" and torch.cuda.is_available():
            half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        hname = str(half).removeprefix("torch.")
        return DtypeChoice(
            half,
            f"dtype auto: the checkpoint is {name}, served in {hname} on {device} (the GPU "
            f"attention kernels need half precision; pass dtype={name} to keep it)",
        )
    native = bf16 if bf16 is not None else cpu_bf16()
    if native.native:
        if checkpoint == torch.bfloat16:
            return DtypeChoice(torch.bfloat16)
        return DtypeChoice(
            torch.bfloat16,
            f"dtype auto: the checkpoint is {name}, served in bfloat16 on this CPU (native bf16 "
            f"units: {native.evidence}; pass dtype={name} to keep it)",
        )
    if checkpoint not in _HALF:
        return DtypeChoice(checkpoint)
    return DtypeChoice(
        torch.float32,
        f"dtype auto: the checkpoint is {name}, served in float32 on the CPU ({native.evidence}; "
        f"{name} matmuls are slow without native units; pass dtype={name} to keep it)",
    )
