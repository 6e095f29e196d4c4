"""``Linear``: ``nn.Linear`` whose inference forward on a CPU runs oneDNN's matmul, on a weight
packed once into oneDNN's layout.

Why and how: radixkv/onednn.py (on AMD CPUs PyTorch's BLAS runs fp32 at half of what oneDNN
reaches; a weight oneDNN has to repack on every call costs a decode step of 32 rows about a
third of its linear-layer time). Same parameters and state dict as ``nn.Linear`` (Hugging Face
names load unchanged). Only inference takes the oneDNN path; training (tools/train_tiny.py) and
any other dtype or device use ``F.linear``. Logits agree with Hugging Face's within the tests'
1e-4, and greedy tokens with it on the test prompts. ``radixkv.onednn.USE_ONEDNN = False``
turns oneDNN off, ``radixkv.onednn.PREPACK = False`` (or ``RADIXKV_PREPACK=0``) the packing.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from radixkv.onednn import linear, pack_weight, packing_available


class OutputDelta(Protocol):
    """What a :class:`Linear` adds to its output after the matmul: LoRA adapters' deltas
    (radixkv/model/lora.py's ``LoRALayer``)."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None: ...


class Linear(nn.Linear):
    """``nn.Linear`` with :func:`radixkv.onednn.linear` as its forward (module docstring).

    The packed weight (fp32 or bf16 on a CPU) is built by :meth:`pack`, which the model runner
    calls for every layer when it starts, or else on the first inference call that uses it, and
    kept beside the parameter (a second copy of the weight: memory for speed). A single fp32
    row is multiplied by the plain weight (radixkv/onednn.py says why). It is rebuilt when the
    weight changes: in place (``load_state_dict``, ``copy_``: the tensor's version counter;
    not for a weight created under ``torch.inference_mode``, which has none: call
    :meth:`drop_packed` after changing such a weight in place), replaced, or moved or cast
    (``.to()``, which also drops it). It is not a parameter or a buffer: state dicts, copies
    and pickles never carry it."""

    _packed: torch.Tensor | None = None
    _packed_for: tuple[int, int, int, torch.dtype] | None = None  # (id, data_ptr, version, dtype)
    # LoRA adapters' factors for this layer (radixkv/model/lora.py); None: no adapter has any
    lora: OutputDelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self._packed_weight(x))
        if self.lora is not None:
            self.lora.add_delta(x, y)
        return y

    def _packed_weight(self, x: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of the current weight when ``x``'s call can use one, else None."""
        if (
            x.dtype is not self.weight.dtype
            or torch.is_grad_enabled()
            # a single fp32 row: the plain weight is as fast (oneDNN multiplies it as a
            # vector), and its rounding stays that of every other row count (module docstring)
            or (x.dtype is torch.float32 and x.numel() == x.shape[-1])
        ):
            return None
        return self._current_pack()

    def _current_pack(self) -> torch.Tensor | None:
        """The packed copy of the current weight, made if missing or stale; None where packing
        is unavailable (device, dtype, switches) or failed."""
        w = self.weight
        if w.device.type != "cpu" or not packing_available(w.dtype):
            return None
        try:
            version = w._version
        except RuntimeError:  # an inference tensor has no version counter: in-place changes
            version = -1  # made under inference_mode go unseen (drop_packed() then)
        key = (id(w), w.data_ptr(), version, w.dtype)
        if key != self._packed_for:
            self._packed = None  # the old copy goes before the new one is made
            self._packed = pack_weight(w)
            self._packed_for = key
        return self._packed

    def pack(self) -> bool:
        """Pack the current weight now rather than on the next inference call (the model
        runner does it for every layer when it starts, so no request waits for it); True when
        a packed copy exists (False on other devices and dtypes, or with packing off)."""
        return self._current_pack() is not None

    def drop_packed(self) -> None:
        """Free the packed copy (the next CPU inference call packs again)."""
        self._packed = self._packed_for = None

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:
        self.drop_packed()  # .to(), .float(), .cuda(): the copy would be stale
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state.pop("_packed_for", None)
        state.pop("lora", None)  # adapters belong to an engine's LoRASet, not to the weights
        return state

    def extra_repr(self) -> str:
        return super().extra_repr() + ", cpu inference: oneDNN"


def pack_linears(model: nn.Module) -> int:
    """:meth:`Linear.pack` every Linear of ``model``; returns the bytes of the weights that now
    have a packed copy (about what the copies take)."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, Linear) and m.pack()
    )
