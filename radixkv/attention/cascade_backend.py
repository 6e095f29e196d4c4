"""An attention backend that runs a step's decode rows through a cascade plan.

The runner swaps it in for one step when the engine's planner decided the cascade pays. It has
the :class:`AttentionBackend` contract: ``plan(layout)`` once per step, ``forward(layer, q, k, v)``
per layer writes the step's new K/V into their slots and attends. The cascade plan's rows are
``order`` (``order[r]`` = the index, among the sequences the plan covers, of plan row ``r``, so
every sharing group is contiguous), so queries are permuted in and outputs back out. The maths
runs on FlashInfer when the wrapped backend is the flashinfer one, else on torch.

A plan covers the whole batch (a decode-only step) or, with the torch backend, only its decode
sequences (``rows``): the other sequences of a mixed step (prefills, chunks) are attended by the
wrapped backend, after one write of every new token's K/V. In a busy server most steps mix a
new request's prefill with everyone else's decodes, so without this the decodes of such steps
would read every shared prefix once per sequence.

Layers with a sliding window shorter than some planned sequence are not cascaded: a level
reads a whole shared prefix, most of which such a layer must not see. They attend through a
second backend of the wrapped kind, planned over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from radixkv.attention.base import AttentionBackend, BatchLayout, outgrown_windows
from radixkv.attention.cascade import CascadePlan, TorchCascadeAttention
from radixkv.attention.torch_backend import TorchAttention


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
    """Decode rows attended through a :class:`CascadePlan`; see the module docstring.

    ``set_plan`` must precede ``plan``. ``plan`` raises ValueError (and changes nothing) when the
    plan's row count differs from the planned sequences', or a plan covering only part of the
    batch is given to a backend wrapping anything but the torch backend; and, with
    ``check_layouts`` (debug checks, radixkv/debug.py: per row, so not every step in
    production), when the planned sequences are not all decode (one new token on a non-empty
    past) or do not match the cascade plan's rows and KV lengths.
    """

    name = "cascade"

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(
            inner.kv_pool, inner.num_qo_heads, inner.num_kv_heads, inner.head_dim, inner.scale,
            layer_windows=inner.layer_windows, softcap=inner.softcap,
        )  # fmt: skip
        if inner.softcap is not None:
            raise ValueError("cascade attention does not soft-cap scores (Gemma 2)")
        self.inner = inner
        self.inner_name = inner.name
        self._cascade: CascadePlan | None = None
        self._order: tuple[int, ...] = ()
        self._order_src: Sequence[int] | None = None  # the order set_plan was given last
        self._order_t_of: tuple[int, ...] | None = None  # the order _order_t was made from
        self._rows: tuple[int, ...] | None = None
        self._impl: Any = None
        self._fi: Any = None  # FlashInferCascadeAttention, created on first use
        self._order_t: torch.Tensor | None = None
        self._torch_impl: TorchCascadeAttention | None = None  # last step's: levels reused
        self._mixed: tuple[torch.Tensor, torch.Tensor] | None = None  # (plan's, others') tokens
        # Sliding windows shorter than some planned row: a cascade level is a whole shared
        # prefix, so layers with such a window attend through a backend of the inner kind
        # planned over the whole batch instead (created on the first step that needs it)
        self._cut: frozenset[int] = frozenset()
        self._banded: AttentionBackend | None = None

    @property
    def supports_mixed(self) -> bool:
        """Whether a plan may cover only the decode sequences of a mixed batch."""
        return isinstance(self.inner, TorchAttention)

    def set_plan(
        self, plan: CascadePlan, order: Sequence[int], rows: Sequence[int] | None = None
    ) -> None:
        """``rows``: the batch indices of the sequences the plan covers, in the planner's input
        order (``order`` indexes into them); None: the whole batch."""
        # (the planner hands the same order tuple while its shared part is reused: checked once)
        if order is not self._order_src and sorted(order) != list(range(plan.num_queries)):
            raise ValueError("cascade order must be a permutation of the plan's rows")
        if plan.page_size != self.kv_pool.page_size:
            raise ValueError(
                f"cascade plan page_size {plan.page_size} != KV pool's {self.kv_pool.page_size}"
            )
        if rows is not None and len(rows) != plan.num_queries:
            raise ValueError(f"{len(rows)} cascade rows for a plan of {plan.num_queries}")
        self._cascade = plan
        if order is not self._order_src:
            self._order_src = order
            self._order = tuple(order)
            self._order_t = None
            self._order_t_of = None
        self._rows = None if rows is None else tuple(rows)

    def plan(self, layout: BatchLayout) -> None:
        cp = self._cascade
        if cp is None:
            raise RuntimeError("CascadeDecodeBackend.plan called before set_plan()")
        pool = self.kv_pool
        if self.check_layouts:
            layout.validate(pool.page_size, pool.num_pages)
        n = len(layout.num_new)
        rows = tuple(range(n)) if self._rows is None else self._rows
        mixed = rows != tuple(range(n))
        if mixed and not self.supports_mixed:
            raise ValueError("a cascade plan over part of a batch needs the torch backend")
        if len(rows) != cp.num_queries:
            raise ValueError(f"batch has {len(rows)} sequences, the cascade plan {cp.num_queries}")
        if self.check_layouts:  # per row: debug-only, as the layout's own checks
            self._check_rows(layout, rows)
        dev = pool.device
        self._plan_slots(layout)
        # the planned rows' longest
        longest = 1 + (max(layout.num_past[i] for i in rows) if mixed else max(layout.num_past))
        self._cut = frozenset(outgrown_windows(self.windows, longest))
        if self._cut:
            if self._banded is None:
                self._banded = type(self.inner)(
                    pool, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.scale,
                    layer_windows=self.layer_windows,
                )  # type: ignore[call-arg]  # fmt: skip
            self._banded.check_layouts = False  # this layout was checked above
            self._banded.plan(layout)
        self._mixed = None
        if mixed:
            self._plan_mixed(layout, rows)
            self._order_t = self._order_t_of = None  # plan's tokens gathered in plan-row order
        elif self._order_t_of is not self._order:  # (the same order: the same tensor)
            identity = self._order == tuple(range(n))
            self._order_t = None if identity else torch.tensor(self._order, device=dev)
            self._order_t_of = self._order
        if dev.type == "cuda" and self.inner_name == "flashinfer":
            from radixkv.attention.cascade_flashinfer import FlashInferCascadeAttention

            if self._fi is None:
                self._fi = FlashInferCascadeAttention(dev)
            self._fi.plan(
                cp,
                num_qo_heads=self.num_qo_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                q_data_type=pool.compute_dtype,
                kv_data_type=pool.dtype,
                sm_scale=self.scale,
            )
            self._impl = self._fi
        else:
            prev = self._torch_impl
            torch_impl = self._torch_impl = TorchCascadeAttention(cp, dev, previous=prev)
            scale = self.scale
            self._impl = lambda q, kc, vc: torch_impl.forward(q, kc, vc, scale)

    def _check_rows(self, layout: BatchLayout, rows: tuple[int, ...]) -> None:
        """ValueError unless the planned rows are distinct decode sequences of the batch whose
        contexts are what the cascade plan's rows read."""
        n = len(layout.num_new)
        if len(set(rows)) != len(rows) or (rows and not 0 <= min(rows) <= max(rows) < n):
            raise ValueError(f"cascade rows {rows[:8]} are not distinct sequences of the batch")
        if any(layout.num_new[i] != 1 or layout.num_past[i] < 1 for i in rows):
            raise ValueError("cascade attention runs decode-only sequences (one new token each)")
        want = plan_row_kv_lens(self._cascade)  # type: ignore[arg-type]  # set_plan ran
        for r, i in enumerate(self._order):
            seq = rows[i]
            if want[r] != layout.num_past[seq] + 1:
                raise ValueError(
                    f"cascade plan row {r} reads {want[r]} tokens but sequence {seq} has "
                    f"{layout.num_past[seq] + 1}"
                )

    def _plan_mixed(self, layout: BatchLayout, rows: tuple[int, ...]) -> None:
        """Token indices of the plan's rows (in plan-row order) and of every other sequence's
        tokens; the wrapped backend is planned over those other sequences."""
        new = layout.arrays.num_new
        starts = np.cumsum(new) - new  # each sequence's first token
        planned = np.zeros(len(new), dtype=bool)
        planned[list(rows)] = True
        rest = np.flatnonzero(~planned)
        self.inner.plan(layout.select(rest.tolist()))
        casc_tok = starts[np.array(rows, np.int64)[np.array(self._order, np.int64)]]
        # every token of the other sequences, in batch order
        counts = new[rest]
        rest_tok = np.arange(int(counts.sum())) + np.repeat(
            starts[rest] - (np.cumsum(counts) - counts), counts
        )
        dev = self.kv_pool.device
        self._mixed = (torch.from_numpy(casc_tok).to(dev), torch.from_numpy(rest_tok).to(dev))

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k, v = self._write_new_kv(layer, q, k, v)
        pool = self.kv_pool
        if self._cut and self.layer_windows[layer] in self._cut:
            assert self._banded is not None
            return self._banded.attend(layer, q, k, v)
        if self._mixed is not None:
            casc_tok, rest_tok = self._mixed
            assert isinstance(self.inner, TorchAttention)  # plan() checked supports_mixed
            out = torch.empty_like(q)
            o_rest = self.inner.attend(
                layer, q.index_select(0, rest_tok), k.index_select(0, rest_tok),
                v.index_select(0, rest_tok),
            )  # fmt: skip
            out.index_copy_(0, rest_tok, o_rest)
            o_casc = self._impl(q.index_select(0, casc_tok), pool.k[layer], pool.v[layer])
            return out.index_copy_(0, casc_tok, o_casc)
        order = self._order_t
        q_rows = q if order is None else q.index_select(0, order)
        out = self._impl(q_rows, pool.k[layer], pool.v[layer])
        if order is None:
            return out
        return torch.empty_like(out).index_copy_(0, order, out)
