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
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from radixkv.attention.cascade_plan import CascadeLevel, CascadePlan
from radixkv.attention.paged_ops import (
    FLASH_CPU_WITH_LSE,
    GatherBuffer,
    flash_query_rows,
    merge_attention_states,
)
from radixkv.kv.kv_pool import load_as
from radixkv.pages import pages_for

__all__ = [
    "CascadeLevel",
    "CascadePlan",
    "TorchCascadeAttention",
    "cascade_attention",
    "merge_state",
]


merge_state = merge_attention_states  # the exact log-sum-exp merge, under its cascade name


# chunks of at least this many segments get their page index by tensor ops (a decode step's
# per-request level: one segment per row) rather than a Python pass over the segments
_VECTOR_SEGMENTS = 16


def _long_tensor(values: tuple[int, ...]) -> torch.Tensor:
    """A CPU long tensor of ``values`` (non-empty) through an int64 array: a few times faster
    than ``torch.tensor`` on a tuple of Python ints."""
    return torch.frombuffer(array("q", values), dtype=torch.int64)


class _SegmentPages:
    """Where some segments' pages lie in a level's ``kv_indices``, for chunks of many
    segments: ``kv`` / ``idx`` are the level's ``kv_indptr`` / ``kv_indices`` (CPU tensors,
    made once per level)."""

    def __init__(self, kv: torch.Tensor, idx: torch.Tensor, segs: list[int]) -> None:
        sel = torch.tensor(segs, dtype=torch.long)
        self.idx = idx
        self.start = kv[sel][:, None]  # [S, 1]
        self.count = (kv[sel + 1] - kv[sel])[:, None]  # [S, 1]
        self.most = int(self.count.max())

    def padded(self, n_pages: int) -> torch.Tensor:
        """``[S * n_pages]`` long: each segment's pages, padded with its first page."""
        j = torch.arange(n_pages, dtype=torch.long)[None, :]  # [1, P]
        pos = torch.where(j < self.count, self.start + j, self.start)
        return self.idx[pos.view(-1)]


@dataclass
class _Chunk:
    """Segments computed together: ``S`` segments padded to ``G`` rows and ``n_pages`` pages."""

    num_segments: int  # S
    group: int  # G
    # [S, G] long, query rows (padding repeats a valid row); None when ``row_range`` is set
    rows: torch.Tensor | None
    row_valid: torch.Tensor | None  # [S, G] bool, None when no padding
    pages: torch.Tensor  # [S, n_pages] long (padding: page of the same segment)
    pages_flat: torch.Tensor  # [S * n_pages], the same pages as one index (a view of ``pages``)
    kv_len: int  # padded KV length = n_pages * page_size, trimmed to the max real length
    kv_mask: torch.Tensor | None  # [S, 1, kv_len] bool, True = masked out; None if none
    # [R] long, rows written back (valid ones, in [S, G] order); None when ``row_range`` is set
    out_rows: torch.Tensor | None
    # rows a..b-1 in [S, G] order without padding: queries are read, and results written, as
    # one slice instead of a gather and a scatter
    row_range: tuple[int, int] | None = None
    first: bool = False  # no earlier chunk wrote these rows: store instead of merging
    # fused CPU path: each segment's keys cut into ``splits`` parts of ``split_len`` tokens (the
    # parts are batch entries, so a kernel that parallelises over the batch uses every thread
    # even for one shared segment), and their mask [S * splits, 1, split_len] (True = masked)
    splits: int = 1
    split_len: int = 0
    split_mask: torch.Tensor | None = None
    # pages p .. p+n-1 of one segment, no padding: K/V are read as a view of the cache, no
    # gather (a prefix prefilled in one go lies in consecutive pages of a fresh pool)
    page_run: tuple[int, int] | None = None
    bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # additive split_mask
    # fused CPU path, gathered chunks: (K buffer, V buffer, page shape, index_select targets
    # K and V [S * n_pages, ps, H, D], kernel views K and V [S * splits, H, split_len, D]), views
    # of the gather buffers kept for every later layer and step while the buffers stay the same
    kv_views: tuple[torch.Tensor, torch.Tensor, torch.Size, torch.Tensor, torch.Tensor,
                    torch.Tensor, torch.Tensor] | None = None  # fmt: skip


class _SingleRows(NamedTuple):
    """A level's one-row segments in chunk order, column by column (_prepare_level_arrays)."""

    lens: np.ndarray  # KV tokens of each
    lens_list: list[int]  # the same as Python ints
    start: np.ndarray  # where its pages start in the level's kv_indices
    count: np.ndarray  # its pages
    count_list: list[int]
    first_row: np.ndarray  # its row


# Budget of gathered KV tokens per padded batch of one-row segments (see _prepare_level).
SINGLE_CHUNK_TOKENS = 4096
# A segment's keys are split for parallelism only into parts of at least this many tokens:
# below it one kernel call's fixed cost outweighs what a second thread saves.
MIN_SPLIT_TOKENS = 512

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


def _chunk_queries(q: torch.Tensor, c: _Chunk) -> torch.Tensor:
    """The chunk's queries as ``[S, G, Hq, D]`` (a view when its rows are one range)."""
    if c.row_range is not None:
        a, b = c.row_range
        return q[a:b].view(c.num_segments, c.group, q.shape[1], q.shape[2])
    assert c.rows is not None
    return q[c.rows]


def _pages_of(
    cache: torch.Tensor, c: _Chunk, buf: GatherBuffer | None, dtype: torch.dtype
) -> torch.Tensor:
    """The chunk's pages of ``cache`` ``[N, ps, H, D]`` in ``c.pages`` order, in ``dtype``: a
    view when they are one run of consecutive pages stored in ``dtype``, else gathered (one
    index_select of whole pages; converted when stored in another dtype), into ``buf`` when
    given (valid until its next gather)."""
    if c.page_run is not None:
        first, count = c.page_run
        return load_as(cache[first : first + count], dtype)  # the view itself when in dtype
    if buf is None:
        return load_as(cache.index_select(0, c.pages_flat), dtype)
    return buf.gather(cache, c.pages_flat, dtype)


def _keep_valid(o: torch.Tensor, lse: torch.Tensor, c: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    if c.row_valid is None:
        return o, lse
    keep = c.row_valid.reshape(-1)
    return o[keep], lse[keep]


def merge_parts(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of ``P`` partial states over disjoint key sets: ``o [P, ..., D]``,
    ``lse [P, ...]`` -> ``o [..., D]``, ``lse [...]``. Every row must have a finite ``lse`` in at
    least one part."""
    return merge_outputs(o, lse), torch.logsumexp(lse, dim=0)


def merge_outputs(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """:func:`merge_parts` without the merged LSE: each part weighted by its share of the
    softmax denominator, ``softmax(lse)`` over the parts (three tensor ops in all)."""
    return (o * torch.softmax(lse, dim=0).unsqueeze(-1)).sum(dim=0)


def _kernel_kv(base: torch.Tensor, c: _Chunk) -> torch.Tensor:
    """``base`` (contiguous ``[S * n_pages, ps, H, D]``, the chunk's pages in ``c.pages`` order)
    as the fused kernel reads it, ``[S * splits, H, split_len, D]``: a view."""
    if not base.is_contiguous():
        base = base.contiguous()
    ps, h, d = base.shape[1:]
    part = c.pages.shape[1] * ps // c.splits * h * d  # one part's padded tokens x H x D
    size = (c.num_segments * c.splits, h, c.split_len, d)
    return base.as_strided(size, (part, d, h * d, 1), base.storage_offset())


def _fused_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, c: _Chunk,
    bufs: tuple[GatherBuffer, GatherBuffer] | None, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The chunk's K and V in ``dtype`` for the fused kernel (see :func:`_kernel_kv`): views of
    the cache for a page run stored in ``dtype``, else gathered (converted when stored in
    another dtype), into ``bufs`` when given (views of them kept on the chunk, so a layer costs
    two ``index_select`` calls and nothing else)."""
    if c.page_run is not None:
        first, count = c.page_run
        end = first + count
        # views of the cache, or converted copies when the pages store another dtype
        k, v = load_as(k_cache[first:end], dtype), load_as(v_cache[first:end], dtype)
        return _kernel_kv(k, c), _kernel_kv(v, c)
    flat = c.pages_flat
    if bufs is None:
        return (
            _kernel_kv(load_as(k_cache.index_select(0, flat), dtype), c),
            _kernel_kv(load_as(v_cache.index_select(0, flat), dtype), c),
        )
    n = flat.shape[0]
    kb, vb = bufs[0].reserve(n, k_cache, dtype), bufs[1].reserve(n, v_cache, dtype)
    views = c.kv_views
    page = k_cache.shape[1:]
    if views is None or views[0] is not kb or views[1] is not vb or views[2] != page:
        ko, vo = kb[:n].view(n, *page), vb[:n].view(n, *page)
        views = c.kv_views = (kb, vb, page, ko, vo, _kernel_kv(ko, c), _kernel_kv(vo, c))
    bufs[0].gather_into(k_cache, flat, views[3])
    bufs[1].gather_into(v_cache, flat, views[4])
    return views[5], views[6]


def _attend_chunk_fused(
    op: Callable[..., tuple[torch.Tensor, ...]], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: _Chunk,
    scale: float, merge: bool = True, bufs: tuple[GatherBuffer, GatherBuffer] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Same contract as :func:`_attend_chunk`, through the fused CPU kernel (K/V read in place
    of a strided view, scores never materialised). ``merge=False``: the parts of split keys are
    returned unmerged, ``o [splits, R, Hq, D]`` and ``lse [splits, R, Hq]``.

    Every reshaping is one ``as_strided`` from the tensors' strides (decode runs this per chunk,
    layer and step, where a chain of views costs as much as a small kernel)."""
    S, G, n = c.num_segments, c.group, c.splits
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    h_q = q.shape[1]
    grp = h_q // h_kv
    k, v = _fused_kv(k_cache, v_cache, c, bufs, q.dtype)
    # every query of the segment x every head of KV group h is one "position" of head h, and
    # each of the n parts of a segment's keys is attended by all of the segment's queries
    # (stride 0): [S, n, Hkv, G, grp, D] -> [S * n, Hkv, G * grp, D]
    x = _chunk_queries(q, c)  # [S, G, Hq, D]
    s_s, s_g, s_h, s_d = x.stride()
    qs = x.as_strided(
        (S, n, h_kv, G, grp, d), (s_s, 0, grp * s_h, s_g, s_h, s_d), x.storage_offset()
    ).reshape(S * n, h_kv, G * grp, d)  # fmt: skip
    mask = None
    if c.split_mask is not None:
        mask = c.bias.get(q.dtype)
        if mask is None:
            mask = torch.zeros(c.split_mask.shape, dtype=q.dtype, device=q.device)
            mask.masked_fill_(c.split_mask, float("-inf"))
            mask = c.bias[q.dtype] = mask.unsqueeze(1)  # [S * n, 1, 1, L]
    o, lse = op(flash_query_rows(qs), k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    # o [S*n, Hkv, R, D], lse [S*n, Hkv, R] (R = G * grp, or more when flash_query_rows padded)
    # -> parts x rows: [n, S, G, Hkv, grp, D] -> [n, S*G, Hq, D], and the same for lse
    b, h, r, e = o.stride()
    o = o.as_strided(
        (n, S, G, h_kv, grp, d), (b, n * b, grp * r, h, r, e), o.storage_offset()
    ).reshape(n, S * G, h_q, d)  # fmt: skip
    b, h, r = lse.stride()
    lse = lse.as_strided(
        (n, S, G, h_kv, grp), (b, n * b, grp * r, h, r), lse.storage_offset()
    ).reshape(n, S * G, h_q)  # fmt: skip
    o, lse = o.float(), lse.float()
    if not merge:
        return o, lse
    # exact merge of the parts (each holds at least one key: lse is finite)
    o, lse = merge_parts(o, lse) if n > 1 else (o[0], lse[0])
    return _keep_valid(o, lse, c)


def _attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c: _Chunk,
    scale: float,
    fused_cpu: bool | None = None,
    bufs: tuple[GatherBuffer, GatherBuffer] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the chunk's rows over their segment's KV -> (o [R, Hq, D], lse [R, Hq]) fp32.
    ``fused_cpu``: see ``_FUSED_STATE``. ``bufs``: K and V gather buffers (else fresh tensors)."""
    op = _fused_op(q, fused_cpu)
    if op is not None:
        try:
            out = _attend_chunk_fused(op, q, k_cache, v_cache, c, scale, bufs=bufs)
        except (RuntimeError, TypeError):
            # required, or worked before: a real error, not a missing kernel
            if fused_cpu or _FUSED_STATE.get(q.dtype):
                raise
            _FUSED_STATE[q.dtype] = False
        else:
            _FUSED_STATE[q.dtype] = True
            return out
    return _attend_chunk_matmul(q, k_cache, v_cache, c, scale, bufs)


def _attend_chunk_matmul(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    c: _Chunk,
    scale: float,
    bufs: tuple[GatherBuffer, GatherBuffer] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Portable path (any device): per-KV-head bmm with an explicit softmax."""
    S, G = c.num_segments, c.group
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    h_q = q.shape[1]
    grp = h_q // h_kv
    # Gather each segment's K/V once: [S, L, Hkv, D]; all G rows of a segment share it.
    # (index_select over whole pages is several times faster than advanced indexing on CPU)
    kb, vb = bufs or (None, None)
    k = _pages_of(k_cache, c, kb, q.dtype).view(S, -1, h_kv, d)[:, : c.kv_len]
    v = _pages_of(v_cache, c, vb, q.dtype).view(S, -1, h_kv, d)[:, : c.kv_len]
    qs = _chunk_queries(q, c).view(S, G, h_kv, grp, d)
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
    return _keep_valid(o.view(S * G, h_q, d), lse.view(S * G, h_q), c)


class TorchCascadeAttention:
    """Plan once per decode step, then run for every layer (like FlashInfer's plan/run).

    The constructor turns the :class:`CascadePlan` into index tensors on ``device`` (once per
    step); ``forward`` (per layer) reads ``k_cache``/``v_cache``, never writes them, and returns
    ``[N, Hq, D]`` in ``q``'s dtype. One-row segments of a level (the per-request level) are
    batched with padding to the longest one; each multi-row (shared) segment gathers its pages
    once and attends all its rows' queries in one kernel call (PyTorch's fused CPU attention,
    or per-KV-head batched matmuls elsewhere). ``fused_cpu``: None uses PyTorch's fused CPU
    kernel when it works (else batched matmuls), True requires it, False never uses it.

    On a CPU, a chunk with fewer segments than threads has each segment's keys cut into up to
    ``threads`` parts (at least ``MIN_SPLIT_TOKENS`` each) that the fused kernel runs in
    parallel and that are merged exactly by their log-sum-exp: a shared prefix read by a whole
    batch is otherwise one kernel task, which leaves every thread but one idle. ``threads``
    defaults to ``torch.get_num_threads()``. ``previous``: the instance of an earlier step with
    the same device and thread count; its prepared levels are reused where this plan's level
    is equal (shared levels do not change while the same sequences keep decoding).
    """

    def __init__(
        self,
        plan: CascadePlan,
        device: torch.device | str = "cpu",
        *,
        fused_cpu: bool | None = None,
        threads: int | None = None,
        previous: TorchCascadeAttention | None = None,
    ) -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.fused_cpu = fused_cpu
        self.threads = torch.get_num_threads() if threads is None else max(1, int(threads))
        old: dict[CascadeLevel, list[_Chunk]] = {}
        # K and V gather buffers, handed on from step to step
        self._bufs = (GatherBuffer(), GatherBuffer()) if previous is None else previous._bufs
        if (
            previous is not None
            and previous.device == self.device
            and previous.threads == self.threads
            and previous.plan.page_size == plan.page_size
        ):
            old = {lvl: chunks for lvl, chunks in zip(previous.plan.levels, previous._levels)}
        self._levels: list[list[_Chunk]] = [
            old[lvl] if lvl in old else self._prepare_level(lvl) for lvl in plan.levels
        ]
        self._mark_first()
        n = plan.num_queries
        self._whole_rows = all(
            c.row_range == (0, n) and c.row_valid is None for chunks in self._levels for c in chunks
        )

    def _make_chunk(
        self,
        lvl: CascadeLevel,
        segs: list[tuple[int, int, int]],
        level_tensors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> _Chunk:
        """A chunk of the level's segments ``(index, rows, kv_len)`` (one chunk per step for
        a batch's private pages: kept to a few list passes and tensor builds).
        ``level_tensors``: the level's ``kv_indptr`` and ``kv_indices`` as CPU tensors, shared
        by its chunks (made here when needed and not given)."""
        ps = self.plan.page_size
        qo, kv, idx = lvl.qo_indptr, lvl.kv_indptr, lvl.kv_indices
        num = len(segs)
        seg_rows = [r for _, r, _ in segs]
        g = max(seg_rows)
        padded = g != min(seg_rows)
        lens = [n for _, _, n in segs]
        kv_len = max(lens)
        dev = self.device
        flat_pages: list[int] = []  # (the vector path leaves it empty: read only when num == 1)
        firsts = [qo[i] for i, _, _ in segs]  # each segment's first row
        if num >= _VECTOR_SEGMENTS:  # many segments (a level of one per request): tensor ops
            if level_tensors is None:
                level_tensors = (_long_tensor(kv), _long_tensor(idx))
            pages = _SegmentPages(*level_tensors, [i for i, _, _ in segs])
            n_pages = pages.most
        else:
            n_pages = max(kv[i + 1] - kv[i] for i, _, _ in segs)
        splits = self._num_splits(num, n_pages, min(lens))
        n_pages = -(-n_pages // splits) * splits  # pad so that every part has as many pages
        if num >= _VECTOR_SEGMENTS:
            flat = pages.padded(n_pages).to(dev)
        else:
            for i, _, _ in segs:
                a, b = kv[i], kv[i + 1]
                flat_pages.extend(idx[a:b])
                if b - a < n_pages:
                    flat_pages.extend([idx[a]] * (n_pages - (b - a)))
            flat = torch.tensor(flat_pages, dtype=torch.long, device=dev)
        first_row, last_row = firsts[0], qo[segs[-1][0] + 1]
        contiguous = not padded and firsts == list(range(first_row, first_row + num * g, g))
        rows = out_rows = row_valid = None
        row_range = (first_row, last_row) if contiguous else None
        if not contiguous and g == 1:  # one row each: the rows are the segments' first rows
            out_rows = torch.tensor(firsts, dtype=torch.long, device=dev)
            rows = out_rows.view(num, 1)
        elif not contiguous:
            row_lists = [list(range(qo[i], qo[i] + r)) for i, r, _ in segs]
            rows = torch.tensor(
                [rl + [rl[0]] * (g - len(rl)) for rl in row_lists], dtype=torch.long, device=dev
            )
            out_rows = torch.tensor(
                [x for rl in row_lists for x in rl], dtype=torch.long, device=dev
            )
            if padded:
                row_valid = torch.tensor(
                    [[j < len(rl) for j in range(g)] for rl in row_lists],
                    dtype=torch.bool,
                    device=dev,
                )
        kv_mask = split_mask = None
        split_len = kv_len if splits == 1 else n_pages // splits * ps
        if min(lens) < (kv_len if splits == 1 else n_pages * ps):
            lens_t = torch.tensor(lens, device=dev)[:, None]
            if kv_len > min(lens):
                kv_mask = (torch.arange(kv_len, device=dev)[None, :] >= lens_t).view(num, 1, -1)
            if splits == 1:
                split_mask = kv_mask
            else:
                full = torch.arange(n_pages * ps, device=dev)[None, :] >= lens_t  # [S, L]
                split_mask = full.view(num * splits, 1, split_len)
        page_run = None
        if num == 1 and flat_pages == list(range(flat_pages[0], flat_pages[0] + n_pages)):
            page_run = (flat_pages[0], n_pages)
        return _Chunk(
            num_segments=num,
            group=g,
            rows=rows,
            row_valid=row_valid,
            pages=flat.view(num, n_pages),
            pages_flat=flat,
            kv_len=kv_len,
            kv_mask=kv_mask,
            out_rows=out_rows,
            row_range=row_range,
            splits=splits,
            split_len=split_len,
            split_mask=split_mask,
            page_run=page_run,
        )

    def _num_splits(self, num_segments: int, n_pages: int, min_len: int) -> int:
        """Parts to cut each segment's keys into (1: none); every part keeps at least one real
        key of every segment, so no part is all padding."""
        if self.device.type != "cpu" or num_segments >= self.threads:
            return 1
        ps = self.plan.page_size
        n = min(self.threads // num_segments, n_pages * ps // MIN_SPLIT_TOKENS, n_pages)
        while n > 1 and (n - 1) * -(-n_pages // n) * ps >= min_len:
            n -= 1
        return max(1, n)

    def _mark_first(self) -> None:
        seen = [False] * self.plan.num_queries
        for chunks in self._levels:
            for c in chunks:
                if c.row_range is not None:
                    a, b = c.row_range
                    c.first = not any(seen[a:b])
                    seen[a:b] = [True] * (b - a)
                    continue
                assert c.out_rows is not None
                rows = c.out_rows.tolist()
                c.first = not any(seen[r] for r in rows)
                for r in rows:
                    seen[r] = True

    def _prepare_level(self, lvl: CascadeLevel) -> list[_Chunk]:
        if lvl.num_segments >= _VECTOR_SEGMENTS:
            return self._prepare_level_arrays(lvl)
        ps = self.plan.page_size
        qo, kv, last = lvl.qo_indptr, lvl.kv_indptr, lvl.kv_last_page_len
        single: list[tuple[int, int, int]] = []  # (segment, rows, kv_len)
        chunks = []
        for i in range(lvl.num_segments):
            if last[i] == 0:
                continue
            seg = (i, qo[i + 1] - qo[i], (kv[i + 1] - kv[i] - 1) * ps + last[i])
            if seg[1] == 1:
                single.append(seg)
            else:
                chunks.append(self._make_chunk(lvl, [seg]))
        # One-row segments go in padded batches of at most SINGLE_CHUNK_TOKENS gathered tokens:
        # longest first, so each batch pads little, and no gather buffer grows so large that
        # allocating it (fresh pages from the OS every call) costs more than the attention.
        # When they all fit in one batch they keep their row order (read and written as a slice).
        if single:
            widest = pages_for(max(n for _, _, n in single), ps) * ps
            if len(single) * widest > SINGLE_CHUNK_TOKENS:
                single.sort(key=lambda seg: -seg[2])
        start = 0
        tensors = None  # the level's indptr and indices as tensors, for its many-segment chunks
        if len(single) >= _VECTOR_SEGMENTS:
            tensors = (_long_tensor(kv), _long_tensor(lvl.kv_indices))
        while start < len(single):
            width = pages_for(single[start][2], ps) * ps  # padded tokens per row
            n = max(1, SINGLE_CHUNK_TOKENS // width)
            chunks.append(self._make_chunk(lvl, single[start : start + n], tensors))
            start += n
        return chunks

    def _prepare_level_arrays(self, lvl: CascadeLevel) -> list[_Chunk]:
        """:meth:`_prepare_level` by array ops for a level of many segments (a decode step's
        per-request level): the same chunks, in the same order, with the same tensors."""
        ps = self.plan.page_size
        n = lvl.num_segments
        # n segments of at least one row each ending at row n: one row each (the usual case)
        qo = np.arange(n + 1) if lvl.qo_indptr[-1] == n else np.array(lvl.qo_indptr, np.int64)
        kv = np.array(lvl.kv_indptr, np.int64)
        last = np.array(lvl.kv_last_page_len, np.int64)
        rows = qo[1:] - qo[:-1]
        count = kv[1:] - kv[:-1]  # pages of each segment
        lens = (count - 1) * ps + last  # KV tokens of each segment
        live = last != 0
        chunks = [
            self._make_chunk(lvl, [(i, int(rows[i]), int(lens[i]))])
            for i in np.flatnonzero(live & (rows != 1)).tolist()
        ]
        single = np.flatnonzero(live & (rows == 1))
        if not len(single):
            return chunks
        # the one-row segments' columns, in chunk order: longest first (a stable sort, as
        # _prepare_level's) when they need several batches, else in row order
        lens_list = lens[single].tolist()
        by_length = len(single) * pages_for(max(lens_list), ps) * ps > SINGLE_CHUNK_TOKENS
        if by_length:
            single = single[np.argsort(-lens[single], kind="stable")]
            lens_list = lens[single].tolist()
        cols = _SingleRows(
            lens[single], lens_list, kv[single], count[single], count[single].tolist(), qo[single]
        )
        idx = np.array(lvl.kv_indices, np.int64)
        start = 0
        while start < len(single):
            width = pages_for(lens_list[start], ps) * ps  # padded tokens per row
            end = min(len(single), start + max(1, SINGLE_CHUNK_TOKENS // width))
            if end - start >= _VECTOR_SEGMENTS:
                chunks.append(self._single_row_chunk(cols, start, end, idx, not by_length))
            else:
                segs = [(i, 1, n) for i, n in zip(single[start:end].tolist(), lens_list[start:end])]
                chunks.append(self._make_chunk(lvl, segs))
            start = end
        return chunks

    def _single_row_chunk(
        self, cols: _SingleRows, a: int, b: int, idx: np.ndarray, ascending: bool
    ) -> _Chunk:
        """:meth:`_make_chunk` of the one-row segments ``a .. b-1`` of ``cols`` (at least
        ``_VECTOR_SEGMENTS``; ``ascending``: their rows ascend), by array ops over the level's
        ``kv_indices`` ``idx``."""
        ps, dev = self.plan.page_size, self.device
        num = b - a
        lens = cols.lens[a:b]
        kv_len, shortest = max(cols.lens_list[a:b]), min(cols.lens_list[a:b])
        most = max(cols.count_list[a:b])
        splits = self._num_splits(num, most, shortest)
        n_pages = -(-most // splits) * splits  # every part as many pages
        start = cols.start[a:b, None]
        j = np.arange(n_pages)
        # each segment's pages, padded with its first page
        pos = np.where(j < cols.count[a:b, None], start + j, start)
        flat = torch.from_numpy(idx[pos.reshape(-1)]).to(dev)
        firsts = cols.first_row[a:b]  # each segment's (one) row
        first_row, last_row = int(firsts[0]), int(firsts[-1]) + 1
        if ascending:  # rows ascend: consecutive exactly when the last is num - 1 after the first
            contiguous = last_row - first_row == num
        else:
            contiguous = bool((firsts == np.arange(first_row, first_row + num)).all())
        rows = out_rows = None
        if not contiguous:
            out_rows = torch.from_numpy(firsts.copy()).to(dev)
            rows = out_rows.view(num, 1)
        kv_mask = split_mask = None
        split_len = kv_len if splits == 1 else n_pages // splits * ps
        if shortest < (kv_len if splits == 1 else n_pages * ps):
            if kv_len > shortest:
                m = np.arange(kv_len) >= lens[:, None]
                kv_mask = torch.from_numpy(m).to(dev).view(num, 1, -1)
            if splits == 1:
                split_mask = kv_mask
            else:
                full = np.arange(n_pages * ps) >= lens[:, None]  # [S, L]
                split_mask = torch.from_numpy(full).to(dev).view(num * splits, 1, split_len)
        return _Chunk(
            num_segments=num,
            group=1,
            rows=rows,
            row_valid=None,
            pages=flat.view(num, n_pages),
            pages_flat=flat,
            kv_len=kv_len,
            kv_mask=kv_mask,
            out_rows=out_rows,
            row_range=(first_row, last_row) if contiguous else None,
            splits=splits,
            split_len=split_len,
            split_mask=split_mask,
        )

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
        op = _fused_op(q, self.fused_cpu) if self._whole_rows else None
        if op is not None and _FUSED_STATE.get(q.dtype):
            # every chunk is the whole batch in order: all parts merged at once, no scatter
            parts = [_attend_chunk_fused(op, q, k_cache, v_cache, c, scale, False, self._bufs)
                     for chunks in self._levels for c in chunks]  # fmt: skip
            o_all = torch.cat([p[0] for p in parts])
            lse_all = torch.cat([p[1] for p in parts])
            if len(o_all) > 1 and not return_lse:
                return merge_outputs(o_all, lse_all).to(q.dtype)
            o, lse = merge_parts(o_all, lse_all) if len(o_all) > 1 else (o_all[0], lse_all[0])
            out = o.to(q.dtype)
            return (out, lse) if return_lse else out
        o: torch.Tensor | None = None
        lse: torch.Tensor | None = None
        for chunks in self._levels:
            for c in chunks:
                o_c, lse_c = _attend_chunk(
                    q, k_cache, v_cache, c, scale, self.fused_cpu, self._bufs
                )
                if o is None or lse is None:
                    if c.first and c.row_range == (0, n):  # the whole batch, in order: keep it
                        o, lse = o_c, lse_c
                        continue
                    o = torch.zeros(n, h_q, d, dtype=torch.float32, device=q.device)
                    lse = torch.full((n, h_q), float("-inf"), dtype=torch.float32, device=q.device)
                if c.row_range is not None:
                    a, b = c.row_range
                    if not c.first:
                        o_c, lse_c = merge_state(o[a:b], lse[a:b], o_c, lse_c)
                    o[a:b], lse[a:b] = o_c, lse_c
                    continue
                out_rows = c.out_rows
                assert out_rows is not None  # set whenever row_range is not
                if not c.first:
                    o_c, lse_c = merge_state(o[out_rows], lse[out_rows], o_c, lse_c)
                o.index_copy_(0, out_rows, o_c)
                lse.index_copy_(0, out_rows, lse_c)
        assert o is not None and lse is not None  # a plan covers every row (CascadePlan checks)
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
