"""A model's fingerprint: a digest that changes whenever the KV it computes could change.

The storage tier keys stored KV pages by it (radixkv.cache.storage.page_format.kv_format_id),
so two engines share stored pages only when they run the same model: same architecture config
and same weights. Hashing every weight of a large model would take seconds at start-up; a
strided sample of each tensor (4,096 values, spread over the whole tensor) plus its name, shape
and dtype is enough to tell a fine-tune or another checkpoint from the original, because
training changes nearly every value.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["model_fingerprint"]

_SAMPLES = 4096  # values sampled per tensor


def model_fingerprint(model: torch.nn.Module, config: object) -> bytes:
    """16 bytes digesting ``config`` (its repr) and a strided sample of every parameter and
    buffer of ``model`` (with its name, shape and dtype)."""
    h = hashlib.blake2b(repr(config).encode(), digest_size=16, person=b"radixkv-model")
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name].detach()
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            flat = t.reshape(-1)
            if flat.numel() > _SAMPLES:
                flat = flat[:: flat.numel() // _SAMPLES][:_SAMPLES]
            h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()
