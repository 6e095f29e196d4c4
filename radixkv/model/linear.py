"""``Linear``: ``nn.Linear`` whose inference forward on a CPU in fp32 runs oneDNN's matmul.

Why and how: radixkv/onednn.py (on AMD CPUs PyTorch's BLAS runs fp32 at half of what oneDNN
reaches). Same parameters and state dict as ``nn.Linear`` (Hugging Face names load unchanged).
Only inference takes the oneDNN path; training (tools/train_tiny.py) and any other dtype or
device use ``F.linear``. Logits agree with Hugging Face's within the tests' 1e-4, and greedy
tokens with it on the test prompts. ``radixkv.onednn.USE_ONEDNN = False`` turns it off.
"""

from __future__ import annotations

import torch
from torch import nn

from radixkv.onednn import linear


class Linear(nn.Linear):
    """``nn.Linear`` with :func:`radixkv.onednn.linear` as its forward (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", cpu fp32 inference: oneDNN"
