"""``dtype="auto"``: which dtype a checkpoint is served in on a given device.

The one place that decides it (the loader asks here; nothing else second-guesses the answer),
so a finer rule for some device only changes :func:`auto_dtype`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO = "auto"

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` chose: ``dtype``, and ``note`` (None when it is simply the checkpoint's
    dtype) saying why it differs from the checkpoint's, for the log."""

    dtype: torch.dtype
    note: str | None = None


def auto_dtype(checkpoint: torch.dtype, device: torch.device) -> DtypeChoice:
    """The dtype to serve a checkpoint stored in ``checkpoint`` (its config.json
    ``torch_dtype``) on ``device`` with, when the user asked for ``"auto"``.

    Rule today:

    - on a GPU (any non-CPU device): the checkpoint's dtype, as trained and as stored;
    - on a CPU: float32 when the checkpoint is half precision (bfloat16 or float16). PyTorch
      runs half-precision matmuls on a CPU without native half-precision matrix units through
      conversion loops, several times slower than float32, and radixkv does not yet tell such
      a CPU from one that has them, so it assumes the slow case. The choice is logged.

    To extend (planned: pick bfloat16 on CPUs with native bf16 matrix units such as AVX512-BF16
    or AMX): add the device capability test here and return the half dtype with a note saying
    which capability was found; callers need no change. Explicit dtypes never come here.
    """
    if device.type == "cpu" and checkpoint in _HALF:
        name = str(checkpoint).removeprefix("torch.")
        return DtypeChoice(
            torch.float32,
            f"dtype auto: the checkpoint is {name}, served in float32 on the CPU "
            f"({name} matmuls are slow on CPUs without native {name} matrix units; "
            f"pass dtype={name} to keep it)",
        )
    return DtypeChoice(checkpoint)
