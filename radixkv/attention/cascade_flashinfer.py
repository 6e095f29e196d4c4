"""Cascade decode attention on FlashInfer (CUDA), same plans and results as the torch version.

``flashinfer`` is imported lazily, inside :class:`FlashInferCascadeAttention`, so importing this
module never needs it. Each level of a :class:`~radixkv.attention.cascade.CascadePlan` is one
``BatchPrefillWithPagedKVCacheWrapper`` (FA2 kernels, as in the paged backend; ``causal=False``:
every query row is a decode token after all of that level's KV), run with ``return_lse=True``;
the levels' partial states are combined with FlashInfer's ``merge_state_in_place`` /
``merge_state``. Two modes:

* every level's segments read KV for every row (a trunk shared by the whole batch, say):
  ``"multi"``, the same computation as FlashInfer's ``MultiLevelCascadeAttentionWrapper.run``
  (last level, then the others merged in place), done here so that the merged LSE is at hand
  without reaching into that wrapper's private attributes;
* some rows read nothing at some level (nested or partial sharing): ``"per_level"``, each level
  planned over just the rows that read something there, merged into those rows.

Either way shared levels are whole pages of earlier tokens (the planner never shares the page of
the token being decoded), metadata (indptr, last page lengths) is int32 on the CPU and page
indices int32 on the GPU, ``q_data_type``/``kv_data_type`` are passed explicitly, the float
workspace is zeroed once (FlashInfer asks for a zero-initialised buffer), and ``plan`` runs once
per step while ``forward`` runs per layer. FlashInfer's LSE is base 2; ``forward`` with
``return_lse=True`` converts it to the natural log used by the torch version.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from radixkv.attention import flashinfer_backend as _fib
from radixkv.attention.cascade_plan import CascadeLevel, CascadePlan

__all__ = ["FlashInferCascadeAttention"]

_LN2 = math.log(2.0)
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def _i32(xs: Any, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int32, device=device)


def _compact(level: CascadeLevel) -> tuple[list[int], CascadeLevel]:
    """Rows that read KV at this level, and the level restricted to them (rows renumbered)."""
    rows: list[int] = []
    qo, kv, idx, last = [0], [0], [], []
    for i in range(level.num_segments):
        if level.kv_last_page_len[i] == 0:
            continue
        a, b = level.qo_indptr[i], level.qo_indptr[i + 1]
        rows.extend(range(a, b))
        qo.append(len(rows))
        idx.extend(level.kv_indices[level.kv_indptr[i] : level.kv_indptr[i + 1]])
        kv.append(len(idx))
        last.append(level.kv_last_page_len[i])
    return rows, CascadeLevel(tuple(qo), tuple(kv), tuple(idx), tuple(last))


class FlashInferCascadeAttention:
    """Plan-once, run-per-layer cascade decode attention on FlashInfer.

    ``plan`` allocates nothing on the GPU beyond small index tensors (the float workspace is
    allocated once, in the constructor, or passed in); ``forward`` reads the caches (NHD,
    ``[num_pages, page_size, Hkv, D]``), never writes them, and returns ``[N, Hq, D]`` in
    ``q``'s dtype.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        workspace: torch.Tensor | None = None,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        self._fi = _fib._import_flashinfer()  # lazy: only here
        self.device = torch.device(device)
        _fib._require_cuda(self.device, "FlashInfer cascade attention")
        self.workspace = (
            workspace
            if workspace is not None
            else torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        )
        self._per_level: list[Any] = []  # BatchPrefillWithPagedKVCacheWrapper pool, one a level
        self._mode = ""  # "multi" (every level reads for every row) or "per_level"
        # per level: None (all rows), an int64 row index tensor, or an empty one (level unused)
        self._rows: list[torch.Tensor | None] = []
        self.plan_: CascadePlan | None = None

    def _prefill_wrapper(self, i: int) -> Any:
        while len(self._per_level) <= i:
            self._per_level.append(
                self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend=_fib.KERNEL_BACKEND
                )
            )
        return self._per_level[i]

    def plan(
        self,
        plan: CascadePlan,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype | None = None,
        sm_scale: float | None = None,
    ) -> None:
        """Prepare every level for this step (once, before the first layer's ``forward``)."""
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(f"num_qo_heads {num_qo_heads} not a multiple of {num_kv_heads}")
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        kv_dtype = q_data_type if kv_data_type is None else kv_data_type
        common = dict(
            causal=False,
            sm_scale=scale,
            q_data_type=q_data_type,
            kv_data_type=kv_dtype,
        )
        n = plan.num_queries
        self._rows = []
        full = True
        for i, lvl in enumerate(plan.levels):
            rows, compact = _compact(lvl)
            if not rows:
                self._rows.append(torch.empty(0, dtype=torch.int64, device=self.device))
                full = False
                continue
            self._prefill_wrapper(i).plan(
                _i32(compact.qo_indptr, "cpu"),
                _i32(compact.kv_indptr, "cpu"),
                _i32(compact.kv_indices, self.device),
                _i32(compact.kv_last_page_len, "cpu"),
                num_qo_heads,
                num_kv_heads,
                head_dim,
                plan.page_size,
                **common,
            )
            if rows == list(range(n)):
                self._rows.append(None)
            else:
                self._rows.append(torch.tensor(rows, dtype=torch.int64, device=self.device))
                full = False
        self.plan_ = plan
        self._mode = "multi" if full else "per_level"

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.plan_ is None:
            raise RuntimeError("FlashInferCascadeAttention.forward called before plan()")
        if q.shape[0] != self.plan_.num_queries:
            raise ValueError(f"q has {q.shape[0]} rows, the plan has {self.plan_.num_queries}")
        q = q.contiguous()  # FlashInfer's kernels and merges read q's rows as packed
        cache = (k_cache, v_cache)
        if self._mode == "multi":
            # MultiLevelCascadeAttentionWrapper.run's order: the last level, the others merged in
            last = len(self._rows) - 1
            out, lse = self._per_level[last].run(q, cache, return_lse=True)
            for i in range(last):
                o_i, s_i = self._per_level[i].run(q, cache, return_lse=True)
                self._fi.merge_state_in_place(out, lse, o_i, s_i)
            return (out, lse * _LN2) if return_lse else out
        # rows not yet reached hold an empty state (LSE -inf); FlashInfer's merge gives the other
        # state's values exactly there
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for i, rows in enumerate(self._rows):
            if rows is not None and rows.numel() == 0:
                continue
            q_i = q if rows is None else q.index_select(0, rows)
            o_i, s_i = self._per_level[i].run(q_i, cache, return_lse=True)
            if rows is None:
                self._fi.merge_state_in_place(out, lse, o_i, s_i)
            else:
                o_m, s_m = self._fi.merge_state(
                    out.index_select(0, rows), lse.index_select(0, rows), o_i, s_i
                )
                out.index_copy_(0, rows, o_m)
                lse.index_copy_(0, rows, s_m)
        return (out, lse * _LN2) if return_lse else out

    __call__ = forward
