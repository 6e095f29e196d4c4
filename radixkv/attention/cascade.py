"""Shared-prefix (cascade) decode attention over paged KV, in plain PyTorch.

A decode batch of N queries (one new token per request) is described by a :class:`CascadePlan`
(attention/cascade_plan.py):
a list of levels, each level a list of *segments*. A segment is a contiguous range of query rows
plus the KV tokens (pages) that all of those rows attend to at that level. A shared prefix read by
a group of G requests is one segment with G rows, so its K/V are gathered once and multiplied
against all G queries in one matmul; each request's own pages (including its partial last page
and the token being decoded) form a one-row segment in the last level. Every level yields a
partial result ``(o, lse)`` per row; partial results are combined exactly through their
log-sum-exp (:func:`merge_state`), so the output equals attention over the union of all the
row's KV tokens. Attention over a set of KV tokens does not depend on their order (positions are
already baked into K by RoPE), so a row's KV may be split across levels in any way.

Layout (FlashInfer's NHD): ``k_cache``/``v_cache`` are ``[num_pages, page_size, num_kv_heads,
head_dim]``; ``q`` is ``[N, num_q_heads, head_dim]`` with ``num_q_heads`` a multiple of
``num_kv_heads`` (GQA: query head h reads KV head ``h // (num_q_heads // num_kv_heads)``).

Nothing here writes to the KV cache: callers write the step's new K/V before attending.
LSEs are natural-log (FlashInfer's are base 2; :mod:`radixkv.attention.cascade_flashinfer`
converts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixkv.attention.cascade_plan import CascadeLevel, CascadePlan
from radixkv.attention.paged_ops import FLASH_CPU_WITH_LSE, merge_attention_states
from radixkv.pages import pages_for

__all__ = [
    "CascadeLevel",
    "CascadePlan",
    "TorchCascadeAttention",
    "cascade_attention",
    "merge_state",
]


merge_state = merge_attention_states  # the exact log-sum-exp merge, under its cascade name


@dataclass
class _Chunk:
    """Segments computed together: ``S`` segments padded to ``G`` rows and ``n_pages`` pages."""

    rows: torch.Tensor  # [S, G] long, query rows (padding repeats a valid row)
    row_valid: torch.Tensor | None  # [S, G] bool, None when no padding
    pages: torch.Tensor  # [S, n_pages] long (padding: page of the same segment)
    kv_len: int  # padded KV length = n_pages * page_size, trimmed to the max real length
    kv_mask: torch.Tensor | None  # [S, 1, kv_len] bool, True = masked out; None if none
    out_rows: torch.Tensor  # [R] long, rows written back (valid ones, in [S, G] order)
    first: bool = False  # no earlier chunk wrote these rows: store instead of merging
    bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive kv_mask


# Budget of gathered KV tokens per padded batch of one-row segments (see _prepare_level).
SINGLE_CHUNK_TOKENS = 4096

# The fused CPU attention kernel that also returns the log-sum-exp (paged_ops.FLASH_CPU_WITH_LSE)
# is a private PyTorch op, so with ``fused_cpu=None`` (the default) it is probed once per dtype and
# the portable matmul path is the fallback; ``fused_cpu=True`` requires it (a failure raises),
# ``False`` never uses it (tests run both paths).
_FUSED_STATE: dict[torch.dtype, bool] = {}  # dtype -> the fused kernel worked / failed


def _fused_op(
    q: torch.Tensor, fused_cpu: bool | None
) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """The fused CPU kernel when this call should use it (see ``_FUSED_STATE``), else None."""
    if q.device.type != "cpu" or fused_cpu is False:
        return None
    if fused_cpu and FLASH_CPU_WITH_LSE is None:
        raise RuntimeError("fused_cpu=True, but this PyTorch has no fused CPU attention with LSE")
    if fused_cpu or _FUSED_STATE.get(q.dtype) is not False:
        return FLASH_CPU_WITH_LSE
    return None


def _attend_chunk_fused(
    op: Callable[..., tuple[torch.Tensor, ...]], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: _Chunk,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Same contract as :func:`_attend_chunk`, through the fused CPU kernel (K/V read in place
    of a strided view, scores never materialised)."""
    S, G = c.rows.shape
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    h_q = q.shape[1]
    grp = h_q // h_kv
    k = k_cache.index_select(0, c.pages.view(-1)).view(S, -1, h_kv, d)[:, : c.kv_len]
    v = v_cache.index_select(0, c.pages.view(-1)).view(S, -1, h_kv, d)[:, : c.kv_len]
    # every query of the segment x every head of KV group h is one "position" of head h
    qs = q[c.rows].view(S, G, h_kv, grp, d).transpose(1, 2).reshape(S, h_kv, G * grp, d)
    mask = None
    if c.kv_mask is not None:
        mask = c.bias.get(q.dtype)
        if mask is None:
            mask = torch.zeros(c.kv_mask.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(c.kv_mask, float("-inf"))
            mask = c.bias[q.dtype] = mask.unsqueeze(1)  # [S, 1, 1, L]
    o, lse = op(qs, k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=mask, scale=scale)[
        :2
    ]
    # o [S, Hkv, G*grp, D], lse [S, Hkv, G*grp] -> rows
    o = o.float().view(S, h_kv, G, grp, d).transpose(1, 2).reshape(S * G, h_q, d)
    lse = lse.float().view(S, h_kv, G, grp).transpose(1, 2).reshape(S * G, h_q)
    if c.row_valid is not None:
        keep = c.row_valid.reshape(-1)
        o, lse = o[keep], lse[keep]
    return o, lse


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c: _Chunk,
    scale: float,
    fused_cpu: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the chunk's rows over their segment's KV -> (o [R, Hq, D], lse [R, Hq]) fp32.
    ``fused_cpu``: see ``_FUSED_STATE``."""
    op = _fused_op(q, fused_cpu)
    if op is not None:
        try:
            out = _attend_chunk_fused(op, q, k_cache, v_cache, c, scale)
        except (RuntimeError, TypeError):
            # required, or worked before: a real error, not a missing kernel
            if fused_cpu or _FUSED_STATE.get(q.dtype):
                raise
            _FUSED_STATE[q.dtype] = False
        else:
            _FUSED_STATE[q.dtype] = True
            return out
    return _attend_chunk_matmul(q, k_cache, v_cache, c, scale)


def _attend_chunk_matmul(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: _Chunk, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable path (any device): per-KV-head bmm with an explicit softmax."""
    S, G = c.rows.shape
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    h_q = q.shape[1]
    grp = h_q // h_kv
    # Gather each segment's K/V once: [S, L, Hkv, D]; all G rows of a segment share it.
    # (index_select over whole pages is several times faster than advanced indexing on CPU)
    k = k_cache.index_select(0, c.pages.view(-1)).view(S, -1, h_kv, d)[:, : c.kv_len]
    v = v_cache.index_select(0, c.pages.view(-1)).view(S, -1, h_kv, d)[:, : c.kv_len]
    qs = q[c.rows].view(S, G, h_kv, grp, d)
    o = torch.empty(S, G, h_kv, grp, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(S, G, h_kv, grp, dtype=torch.float32, device=q.device)
    # One bmm per KV head: k[:, :, h] is a strided [S, L, D] view that BLAS reads in place,
    # where a single 4-D matmul over (S, Hkv) would first copy all of K and V.
    for h in range(h_kv):
        qh = qs[:, :, h].reshape(S, G * grp, d)  # all rows of the segment x heads of group h
        scores = torch.bmm(qh, k[:, :, h].transpose(1, 2)).float().mul_(scale)  # [S, G*grp, L]
        if c.kv_mask is not None:
            scores.masked_fill_(c.kv_mask, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)  # every segment reads >= 1 token: m is finite
        p = torch.exp_(scores.sub_(m))
        denom = p.sum(dim=-1, keepdim=True)
        oh = torch.bmm(p.to(v.dtype), v[:, :, h]).float().div_(denom)  # [S, G*grp, D]
        o[:, :, h] = oh.view(S, G, grp, d)
        lse[:, :, h] = (m + torch.log(denom)).view(S, G, grp)
    o = o.view(S * G, h_q, d)
    lse = lse.view(S * G, h_q)
    if c.row_valid is not None:
        keep = c.row_valid.reshape(-1)
        o, lse = o[keep], lse[keep]
    return o, lse


class TorchCascadeAttention:
    """Plan once per decode step, then run for every layer (like FlashInfer's plan/run).

    The constructor turns the :class:`CascadePlan` into index tensors on ``device`` (once per
    step); ``forward`` (per layer) reads ``k_cache``/``v_cache``, never writes them, and returns
    ``[N, Hq, D]`` in ``q``'s dtype. One-row segments of a level (the per-request level) are
    batched with padding to the longest one; each multi-row (shared) segment gathers its pages
    once and attends all its rows' queries in one kernel call (PyTorch's fused CPU attention,
    or per-KV-head batched matmuls elsewhere). ``fused_cpu``: None uses PyTorch's fused CPU
    kernel when it works (else batched matmuls), True requires it, False never uses it.
    """

    def __init__(
        self,
        plan: CascadePlan,
        device: torch.device | str = "cpu",
        *,
        fused_cpu: bool | None = None,
    ) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.fused_cpu = fused_cpu
        self._levels: list[list[_Chunk]] = [self._prepare_level(lvl) for lvl in plan.levels]
        self._mark_first()

    def _make_chunk(self, lvl: CascadeLevel, segs: list[int]) -> _Chunk:
        ps = self.plan.page_size
        row_lists = [list(range(lvl.qo_indptr[i], lvl.qo_indptr[i + 1])) for i in segs]
        page_lists = [list(lvl.kv_indices[lvl.kv_indptr[i] : lvl.kv_indptr[i + 1]]) for i in segs]
        lens = [lvl.segment_kv_len(i, ps) for i in segs]
        g = max(len(r) for r in row_lists)
        n_pages = max(len(p) for p in page_lists)
        kv_len = max(lens)
        padded_rows = [r + [r[0]] * (g - len(r)) for r in row_lists]
        padded_pages = [p + [p[0]] * (n_pages - len(p)) for p in page_lists]
        dev = self.device
        row_valid = None
        if any(len(r) < g for r in row_lists):
            row_valid = torch.tensor(
                [[j < len(r) for j in range(g)] for r in row_lists], dtype=torch.bool, device=dev
            )
        kv_mask = None
        if any(n < kv_len for n in lens):
            ar = torch.arange(kv_len, device=dev)
            kv_mask = (ar[None, :] >= torch.tensor(lens, device=dev)[:, None]).view(
                len(segs), 1, kv_len
            )
        return _Chunk(
            rows=torch.tensor(padded_rows, dtype=torch.long, device=dev),
            row_valid=row_valid,
            pages=torch.tensor(padded_pages, dtype=torch.long, device=dev),
            kv_len=kv_len,
            kv_mask=kv_mask,
            out_rows=torch.tensor([x for r in row_lists for x in r], dtype=torch.long, device=dev),
        )

    def _mark_first(self) -> None:
        seen = torch.zeros(self.plan.num_queries, dtype=torch.bool)
        for chunks in self._levels:
            for c in chunks:
                rows = c.out_rows.cpu()
                c.first = not bool(seen[rows].any())
                seen[rows] = True

    def _prepare_level(self, lvl: CascadeLevel) -> list[_Chunk]:
        nonempty = [i for i in range(lvl.num_segments) if lvl.kv_last_page_len[i] > 0]
        single = [i for i in nonempty if lvl.qo_indptr[i + 1] - lvl.qo_indptr[i] == 1]
        multi = [i for i in nonempty if lvl.qo_indptr[i + 1] - lvl.qo_indptr[i] > 1]
        chunks = [self._make_chunk(lvl, [i]) for i in multi]
        # One-row segments go in padded batches of at most SINGLE_CHUNK_TOKENS gathered tokens:
        # longest first, so each batch pads little, and no gather buffer grows so large that
        # allocating it (fresh pages from the OS every call) costs more than the attention.
        ps = self.plan.page_size
        single.sort(key=lambda i: -lvl.segment_kv_len(i, ps))
        start = 0
        while start < len(single):
            width = pages_for(lvl.segment_kv_len(single[start], ps), ps) * ps  # padded tokens/row
            n = max(1, SINGLE_CHUNK_TOKENS // width)
            chunks.append(self._make_chunk(lvl, single[start : start + n]))
            start += n
        return chunks

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        sm_scale: float | None = None,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        n, h_q, d = q.shape
        if n != self.plan.num_queries:
            raise ValueError(f"q has {n} rows, the plan has {self.plan.num_queries}")
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}")
        if k_cache.shape[1] != self.plan.page_size:
            raise ValueError(f"cache page_size {k_cache.shape[1]} != plan {self.plan.page_size}")
        if k_cache.shape[3] != d or h_q % k_cache.shape[2] != 0:
            raise ValueError(f"q heads/dim {h_q}/{d} do not fit KV {tuple(k_cache.shape[2:])}")
        scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
        o = torch.zeros(n, h_q, d, dtype=torch.float32, device=q.device)
        lse = torch.full((n, h_q), float("-inf"), dtype=torch.float32, device=q.device)
        for chunks in self._levels:
            for c in chunks:
                o_c, lse_c = _attend_chunk(q, k_cache, v_cache, c, scale, self.fused_cpu)
                if not c.first:
                    o_c, lse_c = merge_state(o[c.out_rows], lse[c.out_rows], o_c, lse_c)
                o.index_copy_(0, c.out_rows, o_c)
                lse.index_copy_(0, c.out_rows, lse_c)
        out = o.to(q.dtype)
        return (out, lse) if return_lse else out

    __call__ = forward


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: CascadePlan,
    sm_scale: float | None = None,
    *,
    fused_cpu: bool | None = None,
) -> torch.Tensor:
    """One-shot :class:`TorchCascadeAttention` (plan + forward) -> ``[N, Hq, D]``."""
    out = TorchCascadeAttention(plan, q.device, fused_cpu=fused_cpu).forward(
        q, k_cache, v_cache, sm_scale
    )
    assert isinstance(out, torch.Tensor)  # no return_lse: the output alone
    return out
