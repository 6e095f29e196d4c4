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

    The rule:

    - on a GPU (any non-CPU device): the checkpoint's dtype, as trained and as stored;
    - on a CPU with native bf16 matrix units (AVX512-BF16 or AMX; ``bf16``, default
      :func:`~radixkv.model.cpu_bf16.cpu_bf16`): a bfloat16 checkpoint stays bfloat16, and a
      float16 one runs in bfloat16 (same width, wider range, so nothing that fit overflows; CPUs
      have no fast float16 matmuls). bf16 matmuls there are 2-4x faster than float32;
    - on any other CPU: float32 for a half-precision checkpoint, since PyTorch runs half
      matmuls there through conversion loops, several times slower than float32.

    Float32 checkpoints stay float32 everywhere. Every change from the checkpoint's dtype has a
    ``note`` for the log. Explicit dtypes never come here.
    """
    if device.type != "cpu" or checkpoint not in _HALF:
        return DtypeChoice(checkpoint)
    name = str(checkpoint).removeprefix("torch.")
    native = bf16 if bf16 is not None else cpu_bf16()
    if native.native:
        if checkpoint == torch.bfloat16:
            return DtypeChoice(torch.bfloat16)
        return DtypeChoice(
            torch.bfloat16,
            f"dtype auto: the checkpoint is float16, served in bfloat16 on this CPU (native "
            f"bf16 units: {native.evidence}; pass dtype=float16 to keep it)",
        )
    return DtypeChoice(
        torch.float32,
        f"dtype auto: the checkpoint is {name}, served in float32 on the CPU ({native.evidence}; "
        f"{name} matmuls are slow without native units; pass dtype={name} to keep it)",
    )
