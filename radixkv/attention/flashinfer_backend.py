"""FlashInfer paged attention (CUDA only). flashinfer is imported when this backend is built.

Per step ``plan`` splits the batch into decode sequences (one new token on top of a non-empty
past) and prefill sequences (everything else: fresh prompts, chunks on a cached prefix), builds
FlashInfer's CSR page metadata (``indptr``/``last_page_len`` int32 on the CPU, page indices int32 on
the GPU) and plans a ``BatchDecodeWithPagedKVCacheWrapper`` and a
``BatchPrefillWithPagedKVCacheWrapper`` once (and once more per sliding window that some
sequence of the step is longer than); every layer reuses those plans. Per layer ``forward``
writes the new K/V into their slots, then runs the planned kernels. The prefill kernel's causal
mask is aligned bottom-right (query ``i`` of ``n`` new tokens sees ``kv_len - n + i + 1`` keys),
which is exactly "attend to the past and to the new tokens up to yourself".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixkv.attention.base import AttentionBackend, BatchLayout, outgrown_windows
from radixkv.kv.kv_pool import KVPool
from radixkv.pages import pages_for

# The FlashInfer kernel family of every wrapper (prefill, decode, cascade levels). FlashInfer's
# "auto" picks FA3 on Hopper for a prefill batch holding a request of more than 64 query rows and
# FA2 otherwise, so one request's results would depend on what else shares its batch, and the
# kernels a deployment needs would depend on traffic. One family keeps results batch-independent
# and the kernel set small enough to compile ahead of time (bench/gpu_kit.py, docs/gpu.md).
KERNEL_BACKEND = "fa2"

# Per wrapper. FlashInfer's examples use 128 MiB; its split-KV scratch grows with batch size and
# heads, and 128 MiB covers batches of a few hundred sequences of 32 heads.
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether decode runs FlashInfer's tensor-core path (its prefill kernels) rather than the
    CUDA-core decode kernels, which are specialised for small GQA groups; the tensor-core path
    handles any group size and is faster for big ones. bench/gpu_kit.py reads this too, to
    know which kernels to compile ahead of time."""
    return num_qo_heads // num_kv_heads not in (1, 2, 4)


def _require_cuda(device: torch.device, what: str) -> None:
    """FlashInfer's kernels run on CUDA only. (The CPU contract tests replace this check.)"""
    if device.type != "cuda":
        raise ValueError(f"{what} needs a CUDA device, got {device}")


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
            n_pages = pages_for(n, page_size)
            indices.extend(pt[:n_pages])
            indptr.append(len(indices))
            last.append(n - (n_pages - 1) * page_size)
        self.indptr = torch.tensor(indptr, dtype=torch.int32)  # CPU
        self.last_page_len = torch.tensor(last, dtype=torch.int32)  # CPU
        self.indices = torch.tensor(indices, dtype=torch.int32).to(device)  # GPU


class _Kernels:
    """One planned prefill wrapper and one planned decode wrapper, each with its own workspace
    (both hold a live plan during the same step), for the layers of one attention window."""

    def __init__(
        self, fi: Any, num_qo_heads: int, num_kv_heads: int, device: torch.device,
        workspace_bytes: int,
    ) -> None:  # fmt: skip
        # Zeroed: FlashInfer asks for float workspaces initialised to 0 before their first use.
        self._prefill_ws = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode_ws = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            self._prefill_ws, "NHD", backend=KERNEL_BACKEND
        )
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._decode_ws,
            "NHD",
            use_tensor_cores=decode_uses_tensor_cores(num_qo_heads, num_kv_heads),
            backend=KERNEL_BACKEND,
        )


class FlashInferAttention(AttentionBackend):
    """Paged attention with FlashInfer's batch prefill and batch decode kernels. Layers with a
    sliding window run the same kernels planned with ``window_left = window - 1`` (a second
    pair of wrappers per window, planned only in steps where a sequence is longer than it)."""

    name = "flashinfer"

    def __init__(
        self,
        kv_pool: KVPool,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        *,
        layer_windows: Sequence[int] = (),
        softcap: float | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        super().__init__(
            kv_pool, num_qo_heads, num_kv_heads, head_dim, scale,
            layer_windows=layer_windows, softcap=softcap,
        )  # fmt: skip
        _require_cuda(kv_pool.device, "the flashinfer backend (its KV pool)")
        if kv_pool.compute_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer backend needs a fp16/bf16 model, got {kv_pool.compute_dtype}"
            )
        if kv_pool.dtype != kv_pool.compute_dtype:
            raise ValueError(
                f"the flashinfer backend reads pages in the model's dtype only, this pool "
                f"stores {kv_pool.dtype} (kv_cache_dtype): use attention_backend='torch', or "
                "kv_cache_dtype='auto' (FlashInfer's fp8 kernels are not built or checked here)"
            )
        self._fi = _import_flashinfer()
        self._workspace_bytes = workspace_bytes
        self._full = self._new_kernels()
        self._by_window: dict[int, _Kernels] = {}  # created on the first step that needs one
        self._active: dict[int, _Kernels] = {}  # this step's: windows some sequence exceeds
        self._pre_rows: torch.Tensor | None = None  # token rows of prefill seqs (mixed batch)
        self._dec_rows: torch.Tensor | None = None
        self._has_prefill = False
        self._has_decode = False

    def _new_kernels(self) -> _Kernels:
        return _Kernels(
            self._fi, self.num_qo_heads, self.num_kv_heads, self.kv_pool.device,
            self._workspace_bytes,
        )  # fmt: skip

    def plan(self, layout: BatchLayout) -> None:
        pool = self.kv_pool
        ps, dev = pool.page_size, pool.device
        if self.check_layouts:
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
        pre = _Csr(pre_tables, pre_lens, ps, dev) if pre_tables else None
        dec = _Csr(dec_tables, dec_lens, ps, dev) if dec_tables else None
        qo = torch.tensor(pre_qo, dtype=torch.int32)
        self._plan_kernels(self._full, qo, pre, dec, -1)
        self._active = {}
        for w in outgrown_windows(self.windows, layout.longest):
            if w not in self._by_window:
                self._by_window[w] = self._new_kernels()
            self._active[w] = self._by_window[w]
            self._plan_kernels(self._active[w], qo, pre, dec, w - 1)

    def _plan_kernels(
        self, kernels: _Kernels, qo: torch.Tensor, pre: _Csr | None, dec: _Csr | None,
        window_left: int,
    ) -> None:  # fmt: skip
        pool = self.kv_pool
        common: dict[str, Any] = {
            "q_data_type": pool.compute_dtype,
            "kv_data_type": pool.dtype,
            "sm_scale": self.scale,
            "window_left": window_left,  # -1: no window
            "logits_soft_cap": self.softcap,  # None: no cap
        }
        args = (self.num_qo_heads, self.num_kv_heads, self.head_dim, pool.page_size)
        if pre is not None:
            kernels.prefill.plan(
                qo, pre.indptr, pre.indices, pre.last_page_len, *args, causal=True, **common
            )
        if dec is not None:
            kernels.decode.plan(
                dec.indptr, dec.indices, dec.last_page_len, *args, pos_encoding_mode="NONE",
                **common,
            )  # fmt: skip

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k, v = self._write_new_kv(layer, q, k, v)
        return self.attend(layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``forward`` without the write (FlashInfer reads the new tokens' K/V from the pool)."""
        pool = self.kv_pool
        cache = (pool.k[layer], pool.v[layer])
        kernels = self._full
        if self._active and self.layer_windows[layer] in self._active:
            kernels = self._active[self.layer_windows[layer]]
        q = q.contiguous()
        if not self._has_decode:
            return kernels.prefill.run(q, cache)
        if not self._has_prefill:
            return kernels.decode.run(q, cache)
        assert self._pre_rows is not None and self._dec_rows is not None
        out = torch.empty_like(q)
        out[self._pre_rows] = kernels.prefill.run(q[self._pre_rows], cache)
        out[self._dec_rows] = kernels.decode.run(q[self._dec_rows], cache)
        return out
