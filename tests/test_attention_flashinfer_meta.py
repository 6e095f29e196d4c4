"""The flashinfer backend's CPU-side parts (no GPU, no flashinfer needed)."""

from __future__ import annotations

import sys

import pytest
import torch

from radixkv.attention.flashinfer_backend import FlashInferAttention, _Csr
from radixkv.kv.kv_pool import KVPool


def test_module_import_does_not_import_flashinfer() -> None:
    assert "flashinfer" not in sys.modules


def test_csr_metadata() -> None:
    csr = _Csr([[7, 3, 9], [4], [1, 2]], [33, 16, 17], page_size=16, device=torch.device("cpu"))
    assert csr.indptr.dtype == torch.int32 and csr.indptr.tolist() == [0, 3, 4, 6]
    assert csr.indices.tolist() == [7, 3, 9, 4, 1, 2]
    assert csr.last_page_len.tolist() == [1, 16, 1]
    # extra trailing pages of a table are not listed
    assert _Csr([[5, 6, 7]], [4], 4, torch.device("cpu")).indices.tolist() == [5]


def test_needs_cuda_pool() -> None:
    kv = KVPool(1, 4, 16, 2, 64)
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferAttention(kv, 4, 2, 64)


def test_refuses_pages_stored_in_another_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixkv.attention.flashinfer_backend as fib

    monkeypatch.setattr(fib, "_require_cuda", lambda device, what: None)
    kv = KVPool(1, 4, 16, 2, 64, torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"stores torch\.float8_e4m3fn \(kv_cache_dtype\)"):
        FlashInferAttention(kv, 4, 2, 64)
