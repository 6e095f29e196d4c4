"""FlashInfer paged attention (CUDA only). flashinfer is imported when this backend is built.

Per step ``plan`` splits the batch into decode sequences (one new token on top of a non-empty
past) and prefill sequences (everything else: fresh prompts, chunks on a cached prefix), builds
FlashInfer's CSR page metadata (``indptr``/``last_page_len`` int32 on the CPU, page indices int32 on
the GPU) and plans a ``BatchDecodeWithPagedKVCacheWrapper`` and a
``BatchPrefillWithPagedKVCacheWrapper`` once; every layer reuses those plans. Per layer ``forward``
writes the new K/V into their slots, then runs the planned kernels. The prefill kernel's causal
mask is aligned bottom-right (query ``i`` of ``n`` new tokens sees ``kv_len - n + i + 1`` keys),
which is exactly "attend to the past and to the new tokens up to yourself".
"""

from __future__ import annotations

from typing import Any

import torch

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.kv.kv_pool import KVPool

# Per wrapper. FlashInfer's examples use 128 MiB; its split-KV scratch grows with batch size and
# heads, and 128 MiB covers batches of a few hundred sequences of 32 heads.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(
            "the flashinfer attention backend needs the 'flashinfer-python' package "
            "(pip install 'radixkv[gpu]'); use backend='torch' otherwise"
        ) from exc
    return flashinfer


class _Csr:
    """FlashInfer page-table metadata for a subset of the batch's sequences."""

    def __init__(
        self,
        tables: list[list[int]],
        kv_lens: list[int],
        page_size: int,
        device: torch.device,
    ) -> None:
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for pt, n in zip(tables, kv_lens, strict=True):
            n_pages = (n + page_size - 1) // page_size
            indices.extend(pt[:n_pages])
            indptr.append(len(indices))
            last.append(n - (n_pages - 1) * page_size)
        self.indptr = torch.tensor(indptr, dtype=torch.int32)  # CPU
        self.last_page_len = torch.tensor(last, dtype=torch.int32)  # CPU
        self.indices = torch.tensor(indices, dtype=torch.int32).to(device)  # GPU


class FlashInferAttention(AttentionBackend):
    """Paged attention with FlashInfer's batch prefill and batch decode kernels."""

    name = "flashinfer"

    def __init__(
        self,
        kv_pool: KVPool,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        super().__init__(kv_pool, num_qo_heads, num_kv_heads, head_dim, scale)
        if kv_pool.device.type != "cuda":
            raise ValueError("the flashinfer backend needs the KV pool on a CUDA device")
        if kv_pool.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer backend needs a fp16/bf16 KV pool, got {kv_pool.dtype}"
            )
        fi = _import_flashinfer()
        dev = kv_pool.device
        # Separate workspaces: both wrappers hold a live plan during the same step.
        self._prefill_ws = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self._decode_ws = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self._prefill_ws, "NHD")
        group = num_qo_heads // num_kv_heads
        # Tensor-core decode (prefill kernels) handles any GQA group size and is faster for big
        # groups; the CUDA-core decode kernels are specialised for small ones.
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._decode_ws, "NHD", use_tensor_cores=group not in (1, 2, 4)
        )
        self._pre_rows: torch.Tensor | None = None  # token rows of prefill seqs (mixed batch)
        self._dec_rows: torch.Tensor | None = None
        self._has_prefill = False
        self._has_decode = False

    def plan(self, layout: BatchLayout) -> None:
        pool = self.kv_pool
        ps, dev = pool.page_size, pool.device
        layout.validate(ps, pool.num_pages)
        self._plan_slots(layout)
        pre_tables, pre_lens, pre_qo = [], [], [0]
        dec_tables, dec_lens = [], []
        pre_rows: list[int] = []
        dec_rows: list[int] = []
        start = 0
        for pt, past, new in zip(layout.page_tables, layout.num_past, layout.num_new, strict=True):
            total = past + new
            pt_list = list(pt[: (total + ps - 1) // ps])
            if new == 1 and past > 0:
                dec_tables.append(pt_list)
                dec_lens.append(total)
                dec_rows.append(start)
            else:
                pre_tables.append(pt_list)
                pre_lens.append(total)
                pre_qo.append(pre_qo[-1] + new)
                pre_rows.extend(range(start, start + new))
            start += new
        self._has_prefill, self._has_decode = bool(pre_tables), bool(dec_tables)
        mixed = self._has_prefill and self._has_decode
        self._pre_rows = torch.tensor(pre_rows, device=dev) if mixed else None
        self._dec_rows = torch.tensor(dec_rows, device=dev) if mixed else None
        common: dict[str, Any] = {
            "q_data_type": pool.dtype,
            "kv_data_type": pool.dtype,
            "sm_scale": self.scale,
        }
        if self._has_prefill:
            csr = _Csr(pre_tables, pre_lens, ps, dev)
            self._prefill.plan(
                torch.tensor(pre_qo, dtype=torch.int32),
                csr.indptr,
                csr.indices,
                csr.last_page_len,
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                causal=True,
                **common,
            )
        if self._has_decode:
            csr = _Csr(dec_tables, dec_lens, ps, dev)
            self._decode.plan(
                csr.indptr,
                csr.indices,
                csr.last_page_len,
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                pos_encoding_mode="NONE",
                **common,
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self._write_new_kv(layer, q, k, v)
        pool = self.kv_pool
        cache = (pool.k[layer], pool.v[layer])
        q = q.contiguous()
        if not self._has_decode:
            return self._prefill.run(q, cache)
        if not self._has_prefill:
            return self._decode.run(q, cache)
        assert self._pre_rows is not None and self._dec_rows is not None
        out = torch.empty_like(q)
        out[self._pre_rows] = self._prefill.run(q[self._pre_rows], cache)
        out[self._dec_rows] = self._decode.run(q[self._dec_rows], cache)
        return out
