"""Cascade decode attention on FlashInfer (CUDA), same plans and results as the torch version.

``flashinfer`` is imported lazily, inside :class:`FlashInferCascadeAttention`, so importing this
module never needs it. Two ways to run a :class:`~radixkv.attention.cascade.CascadePlan`:

* every level's segments read KV for every row (a trunk shared by the whole batch, say): one
  ``MultiLevelCascadeAttentionWrapper`` (FlashInfer's own multi-level cascade);
* some rows read nothing at some level (nested or partial sharing): one
  ``BatchPrefillWithPagedKVCacheWrapper`` per level over just the rows that read something
  there (``causal=False``, ``return_lse=True``), combined with ``merge_state``.

Either way shared levels are whole pages of earlier tokens (the planner never shares the page of
the token being decoded), metadata (indptr, last page lengths) is int32 on the CPU and page
indices int32 on the GPU, ``q_data_type``/``kv_data_type`` are passed explicitly, and ``plan``
runs once per step while ``forward`` runs per layer. FlashInfer's LSE is base 2; ``forward``
with ``return_lse=True`` converts it to the natural log used by the torch version.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
        import flashinfer  # lazy: only here

        self._fi = flashinfer
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"FlashInfer cascade attention needs a CUDA device, got {device}")
        self.workspace = (
            workspace
            if workspace is not None
            else torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        )
        self._multi: Any = None  # MultiLevelCascadeAttentionWrapper, per number of levels
        self._multi_levels = 0
        self._per_level: list[Any] = []  # BatchPrefillWithPagedKVCacheWrapper pool
        self._mode = ""
        self._rows: list[torch.Tensor | None] = []
        self.plan_: CascadePlan | None = None

    def _prefill_wrapper(self, i: int) -> Any:
        while len(self._per_level) <= i:
            self._per_level.append(
                self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
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
        full = all(
            lvl.qo_indptr[-1] == n and all(x > 0 for x in lvl.kv_last_page_len)
            for lvl in plan.levels
        )
        self.plan_ = plan
        if full:
            if self._multi is None or self._multi_levels != len(plan.levels):
                self._multi = self._fi.MultiLevelCascadeAttentionWrapper(
                    len(plan.levels), self.workspace, "NHD"
                )
                self._multi_levels = len(plan.levels)
            self._multi.plan(
                [_i32(lvl.qo_indptr, "cpu") for lvl in plan.levels],
                [_i32(lvl.kv_indptr, "cpu") for lvl in plan.levels],
                [_i32(lvl.kv_indices, self.device) for lvl in plan.levels],
                [_i32(lvl.kv_last_page_len, "cpu") for lvl in plan.levels],
                num_qo_heads,
                num_kv_heads,
                head_dim,
                plan.page_size,
                **common,
            )
            self._mode = "multi"
            return
        self._rows = []
        for i, lvl in enumerate(plan.levels):
            rows, compact = _compact(lvl)
            if not rows:
                self._rows.append(torch.empty(0, dtype=torch.int64, device=self.device))
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
            all_rows = rows == list(range(n))
            self._rows.append(
                None if all_rows else torch.tensor(rows, dtype=torch.int64, device=self.device)
            )
        self._mode = "per_level"

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
        if self._mode == "multi" and not return_lse:
            return self._multi.run(q, (k_cache, v_cache))
        if self._mode == "multi":
            # same as the wrapper's run, keeping the merged LSE
            wrappers = self._multi._batch_prefill_wrappers
            out, lse = wrappers[-1].run(q, (k_cache, v_cache), return_lse=True)
            for w in wrappers[:-1]:
                o_i, s_i = w.run(q, (k_cache, v_cache), return_lse=True)
                self._fi.merge_state_in_place(out, lse, o_i, s_i)
            return out, lse * _LN2
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        for i, rows in enumerate(self._rows):
            if rows is not None and rows.numel() == 0:
                continue
            q_i = q if rows is None else q.index_select(0, rows)
            o_i, s_i = self._per_level[i].run(q_i, (k_cache, v_cache), return_lse=True)
            if rows is None:
                out, lse = self._fi.merge_state(out, lse, o_i, s_i)
            else:
                o_m, s_m = self._fi.merge_state(
                    out.index_select(0, rows), lse.index_select(0, rows), o_i, s_i
                )
                out.index_copy_(0, rows, o_m)
                lse.index_copy_(0, rows, s_m)
        return (out, lse * _LN2) if return_lse else out

    __call__ = forward
