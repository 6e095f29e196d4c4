"""An attention backend that runs a decode-only step through a cascade plan.

The runner swaps it in for one step when the engine's planner decided the cascade pays. It has
the :class:`AttentionBackend` contract: ``plan(layout)`` once per step, ``forward(layer, q, k, v)``
per layer writes the step's new K/V into their slots and attends. The queries arrive in the
batch's order; the cascade plan's rows are ``order`` (``order[r]`` = batch index of plan row
``r``, so every sharing group is contiguous), so queries are permuted in and outputs back out.
The maths runs on FlashInfer when the wrapped backend is the flashinfer one, else on torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention


def plan_row_kv_lens(plan: CascadePlan) -> list[int]:
    """KV tokens each plan row reads over all levels (its full context when the plan is right)."""
    lens = [0] * plan.num_queries
    for lvl in plan.levels:
        for i in range(lvl.num_segments):
            n = lvl.segment_kv_len(i, plan.page_size)
            for r in range(lvl.qo_indptr[i], lvl.qo_indptr[i + 1]):
                lens[r] += n
    return lens


class CascadeDecodeBackend(AttentionBackend):
    """Decode-only attention through a :class:`CascadePlan`; see the module docstring.

    ``set_plan`` must precede ``plan``. ``plan`` raises ValueError (and changes nothing) when the
    layout is not all-decode or does not match the cascade plan's rows and KV lengths.
    """

    name = "cascade"

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(
            inner.kv_pool, inner.num_qo_heads, inner.num_kv_heads, inner.head_dim, inner.scale
        )
        self.inner_name = inner.name
        self._cascade: CascadePlan | None = None
        self._order: tuple[int, ...] = ()
        self._impl: Any = None
        self._fi: Any = None  # FlashInferCascadeAttention, created on first use
        self._order_t: torch.Tensor | None = None
        self._torch_impl: TorchCascadeAttention | None = None  # last step's: levels reused

    def set_plan(self, plan: CascadePlan, order: Sequence[int]) -> None:
        if sorted(order) != list(range(plan.num_queries)):
            raise ValueError("cascade order must be a permutation of the plan's rows")
        if plan.page_size != self.kv_pool.page_size:
            raise ValueError(
                f"cascade plan page_size {plan.page_size} != KV pool's {self.kv_pool.page_size}"
            )
        self._cascade = plan
        self._order = tuple(order)

    def plan(self, layout: BatchLayout) -> None:
        cp = self._cascade
        if cp is None:
            raise RuntimeError("CascadeDecodeBackend.plan called before set_plan()")
        pool = self.kv_pool
        if self.check_layouts:
            layout.validate(pool.page_size, pool.num_pages)
        n = len(layout.num_new)
        if any(x != 1 for x in layout.num_new) or any(p < 1 for p in layout.num_past):
            raise ValueError("cascade attention runs decode-only batches (one new token each)")
        if n != cp.num_queries:
            raise ValueError(f"batch has {n} sequences, the cascade plan {cp.num_queries}")
        want = plan_row_kv_lens(cp)
        for r, i in enumerate(self._order):
            if want[r] != layout.num_past[i] + 1:
                raise ValueError(
                    f"cascade plan row {r} reads {want[r]} tokens but sequence {i} has "
                    f"{layout.num_past[i] + 1}"
                )
        dev = pool.device
        self._plan_slots(layout)
        identity = self._order == tuple(range(n))
        self._order_t = None if identity else torch.tensor(self._order, device=dev)
        if dev.type == "cuda" and self.inner_name == "flashinfer":
            from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention

            if self._fi is None:
                self._fi = FlashInferCascadeAttention(dev)
            self._fi.plan(
                cp,
                num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                q_data_type=pool.dtype,
                kv_data_type=pool.dtype,
                sm_scale=self.scale,
            )
            self._impl = self._fi
        else:
            prev = self._torch_impl
            torch_impl = self._torch_impl = TorchCascadeAttention(cp, dev, previous=prev)
            scale = self.scale
            self._impl = lambda q, kc, vc: torch_impl.forward(q, kc, vc, scale)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self._write_new_kv(layer, q, k, v)
        pool = self.kv_pool
        order = self._order_t
        q_rows = q if order is None else q.index_select(0, order)
        out = self._impl(q_rows, pool.k[layer], pool.v[layer])
        if order is None:
            return out
        return torch.empty_like(out).index_copy_(0, order, out)
