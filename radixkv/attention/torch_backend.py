"""Pure-PyTorch paged attention: the CPU default, also correct (if not fastest) on a GPU.

Per step (``plan``): flat write slots of all new tokens; decode sequences (one new token on a
non-empty past) are cut into small groups, each with a padded page index ``[g, max_pages]`` and a
key mask; prefill sequences keep their page list and a few query chunks with bottom-right causal
masks. Per layer (``forward``): one ``index_copy_`` writes the new K/V, one ``index_select`` of whole
pages per group gathers its keys into a reused buffer, and ``scaled_dot_product_attention`` does
the maths (a lone bf16 query row per head twice: ``paged_ops.flash_query_rows``). No per-token
Python loops.

A prefill on past tokens, on a CPU, splits its keys instead of masking them: all new queries
attend the past keys (a plain rectangle, no mask) and their own new keys (causal, exactly like a
fresh prefill), and the two partial results are merged exactly through their log-sum-exp. That
needs the log-sum-exp from PyTorch's CPU flash-attention kernel; elsewhere the queries go in
chunks with bottom-right causal masks instead.

A bf16 prefill on a CPU goes through :mod:`radixkv.attention.matmul_attention` instead (blocks
of matmuls over the fresh keys, or over the gathered past and fresh keys, scores in fp32
through oneDNN) where that beats the flash kernel on the CPU at hand (measured once per
process: 2-2.4x faster on a Zen 5 EPYC, slower on a Zen 4), at about the same accuracy. So
does an fp32 prefill where oneDNN runs the products (radixkv/onednn.py).

Layers with a sliding window get a second plan per window, made only in steps where some
sequence is longer than it: such a sequence's decode gathers just the pages of its window (a
key mask hides the slots before it), its prefill goes in query chunks, each over the pages from
its first query's window start, under a causal band mask; shorter sequences attend as in full.
Soft-capped scores (Gemma 2) are computed by :func:`paged_ops.softcapped_attention` (fp32
scores, capped, then softmax) in masked query chunks: PyTorch's kernels have no cap.

Why groups and a reused buffer: on a CPU the gather is a memory copy as large as the KV it
reads. Gathering a few sequences at a time into the same buffer keeps the copy in cache while
SDPA reads it, and never touches freshly allocated memory (page faults cost more than the copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.attention.base import (
    ROWS_MIN_BATCH,
    AttentionBackend,
    BatchLayout,
    outgrown_windows,
)
from radixkv.attention.matmul_attention import causal_matmul_attention, pays
from radixkv.attention.page_table_rows import pad_rows
from radixkv.attention.paged_ops import (
    FLASH_CPU_WITH_LSE,
    GatherBuffer,
    flash_query_rows,
    merge_attention_states,
    softcapped_attention,
)
from radixkv.kv.kv_pool import KVPool
from radixkv.onednn import onednn_available
from radixkv.pages import pages_for

# Queries of a prefill with cached/past tokens are processed in chunks of this many rows: each
# chunk attends keys 0 .. its last position, so only a chunk-sized triangle is wasted on masking.
PREFILL_QUERY_CHUNK = 256
# Decode sequences are gathered a group at a time; a group's K+V stays under this many bytes
# (but holds at least one sequence).
DECODE_GROUP_BYTES = 4 * 1024 * 1024


@dataclass
class _Prefill:
    start: int  # token range [start, end) in the ragged batch
    end: int
    num_past: int
    pages: torch.Tensor | None  # [n_pages] int64, only when num_past > 0
    # (a, b, mask): new tokens a..b-1 attend keys 0 .. num_past+b-1; mask [b-a, num_past+b] or None
    chunks: list[tuple[int, int, torch.Tensor | None]]


@dataclass
class _WindowChunk:
    """New tokens ``start .. end-1`` of a sequence longer than a sliding window: they attend
    the ``num_keys`` tokens held by ``pages`` from the first page's first slot, under ``mask``."""

    start: int
    end: int
    pages: torch.Tensor  # [n_pages] int64
    num_keys: int
    mask: torch.Tensor  # [end - start, num_keys] bool (True = attend): causal and in the window


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [g] rows of these sequences' tokens in the ragged batch
    first_row: int  # rows are first_row .. first_row+g-1 when contiguous, else -1
    pages: torch.Tensor  # [g * max_pages] int64, each sequence padded with a valid page
    num_seqs: int
    kv_len: int  # keys per sequence after padding, trimmed to the longest sequence
    # [g, 1, 1, kv_len] bool (True = attend); None without padding or keys before a window
    mask: torch.Tensor | None


class TorchAttention(AttentionBackend):
    """See module docstring. Works for any device the pool lives on."""

    name = "torch"

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
    ) -> None:
        super().__init__(
            kv_pool, num_qo_heads, num_kv_heads, head_dim, scale,
            layer_windows=layer_windows, softcap=softcap,
        )  # fmt: skip
        self._prefills: list[_Prefill | _WindowChunk] = []
        self._groups: list[_DecodeGroup] = []
        # window -> (prefill items, decode groups) of the step for the layers with that window;
        # only windows some sequence of the step is longer than (the others attend in full)
        self._windowed: dict[int, tuple[list[_Prefill | _WindowChunk], list[_DecodeGroup]]] = {}
        self._kbuf = GatherBuffer()
        self._vbuf = GatherBuffer()
        on_cpu = kv_pool.device.type == "cpu"
        # soft-capped scores (Gemma 2) go through softcapped_attention in masked query chunks:
        # neither PyTorch's kernels nor the blocked matmuls cap them
        capped = self.softcap is not None
        self._split_past = on_cpu and FLASH_CPU_WITH_LSE is not None and not capped
        # prefill attention as blocked matmuls on a CPU (matmul_attention.py) where they beat
        # the flash kernel on it (measured once per process and head shape): bf16, and fp32
        # where oneDNN runs the products (on the BLAS, blocked matmuls never win in fp32)
        dtype = kv_pool.compute_dtype
        self._matmul_prefill = (
            on_cpu
            and not capped
            and (dtype == torch.bfloat16 or (dtype == torch.float32 and onednn_available()))
            and pays(dtype, num_qo_heads, num_kv_heads, head_dim)
        )

    @property
    def prefill_path(self) -> str:
        """What computes prefill attention, for logs: "blocked matmuls" (matmul_attention.py)
        or "flash kernel" (PyTorch's)."""
        return "blocked matmuls" if self._matmul_prefill else "flash kernel"

    # ---- plan --------------------------------------------------------------------------------
    def plan(self, layout: BatchLayout) -> None:
        pool = self.kv_pool
        ps = pool.page_size
        if self.check_layouts:
            layout.validate(ps, pool.num_pages)
        self._plan_slots(layout)
        n = len(layout.num_new)
        if n < ROWS_MIN_BATCH and layout.num_tokens == n and min(layout.num_past) > 0:
            self._prefills = []
            self._groups = self._plan_small_decode(layout)
            self._windowed = {
                w: self._plan_window(layout, w, [])
                for w in outgrown_windows(self.windows, layout.longest)
            }
            return
        a = layout.arrays
        past, new = a.num_past, a.num_new
        total = past + new
        starts = np.cumsum(new) - new  # each sequence's first token row
        decode = (new == 1) & (past > 0)
        prefills: list[_Prefill | _WindowChunk] = []
        for i in np.flatnonzero(~decode).tolist():  # prefills and chunks: few per step
            p, n = layout.num_past[i], layout.num_new[i]
            pt_cpu = torch.from_numpy(a.pages[i, : pages_for(p + n, ps)].copy())
            prefills.append(self._plan_prefill(int(starts[i]), p, n, pt_cpu))
        self._prefills = prefills
        dec = np.flatnonzero(decode)
        n_pages = -(-total[dec] // ps)
        pages = a.pages[dec]
        # pages a decode does not read (a table longer than its tokens need) repeat its first
        pages = np.where(np.arange(pages.shape[1]) < n_pages[:, None], pages, pages[:, :1])
        self._groups = self._plan_decode(starts[dec], pages, n_pages, total[dec])
        self._windowed = {
            w: self._plan_window(layout, w, prefills)
            for w in outgrown_windows(self.windows, layout.longest)
        }

    def _plan_window(
        self, layout: BatchLayout, window: int, full: list[_Prefill | _WindowChunk]
    ) -> tuple[list[_Prefill | _WindowChunk], list[_DecodeGroup]]:
        """The step for layers with sliding window ``window``: a sequence no longer than the
        window attends as in full (its item of ``full``, the full plan's prefill items); a
        longer one reads only the pages holding its window (decode: a group key mask hides
        the slots before the window; prefill: query chunks under causal band masks)."""
        ps = self.kv_pool.page_size
        items: list[_Prefill | _WindowChunk] = []
        decodes: list[tuple[int, list[int], int, int]] = []
        long_decode = False
        start = k = 0
        for pt, past, new in zip(layout.page_tables, layout.num_past, layout.num_new, strict=True):
            total = past + new
            if new == 1 and past > 0:
                lo = max(0, total - window)  # first key in the window
                first = lo // ps
                long_decode |= lo > 0
                decodes.append((start, list(pt[first : pages_for(total, ps)]),
                                total - first * ps, lo - first * ps))  # fmt: skip
            else:
                items.extend(
                    [full[k]]
                    if total <= window
                    else self._window_chunks(start, past, new, pt, window)
                )
                k += 1
            start += new
        if not long_decode:
            return items, self._groups
        return items, self._plan_decode(
            np.array([r for r, _, _, _ in decodes], np.int64),
            pad_rows([p for _, p, _, _ in decodes]),
            np.array([len(p) for _, p, _, _ in decodes], np.int64),
            np.array([n for _, _, n, _ in decodes], np.int64),
            np.array([k for _, _, _, k in decodes], np.int64),
        )

    def _window_chunks(
        self, start: int, past: int, new: int, pt: Sequence[int], window: int
    ) -> list[_WindowChunk]:
        """Query chunks of a prefill longer than ``window`` (rows ``start ..``): each gathers
        the pages from its first query's window start to its last query."""
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        chunks = []
        for a in range(0, new, PREFILL_QUERY_CHUNK):
            b = min(new, a + PREFILL_QUERY_CHUNK)
            first, end = past + a, past + b  # query positions first .. end-1
            base = max(0, first - window + 1) // ps * ps  # position of the first gathered key
            rows = torch.arange(first, end).unsqueeze(1)
            cols = torch.arange(base, end).unsqueeze(0)
            mask = (cols <= rows) & (cols > rows - window)
            pages = torch.tensor(pt[base // ps : pages_for(end, ps)], dtype=torch.int64)
            chunks.append(
                _WindowChunk(start + a, start + b, pages.to(dev), end - base, mask.to(dev))
            )
        return chunks

    def _plan_prefill(self, start: int, past: int, new: int, pt_cpu: torch.Tensor) -> _Prefill:
        dev = self.kv_pool.device
        if past == 0 and self.softcap is None:
            return _Prefill(start, start + new, 0, None, [(0, new, None)])
        if self._split_past or self._matmul_prefill:  # no chunks or masks: see _attend_prefill
            return _Prefill(start, start + new, past, pt_cpu.to(dev), [])
        chunks: list[tuple[int, int, torch.Tensor | None]] = []
        for a in range(0, new, PREFILL_QUERY_CHUNK):
            b = min(new, a + PREFILL_QUERY_CHUNK)
            mask = None
            if b - a > 1:
                rows = torch.arange(past + a, past + b).unsqueeze(1)  # query positions
                cols = torch.arange(past + b).unsqueeze(0)
                mask = (cols <= rows).to(dev)
            chunks.append((a, b, mask))
        return _Prefill(start, start + new, past, pt_cpu.to(dev), chunks)

    def _group_bounds(self, counts: list[int]) -> list[tuple[int, int]]:
        """Decode groups as ranges ``[i, k)`` of sequences with ``counts`` pages each: a group's
        gathered pages stay under DECODE_GROUP_BYTES (but it holds at least one sequence)."""
        pool = self.kv_pool
        page_bytes = 2 * pool.page_size * pool.num_kv_heads * pool.head_dim
        page_bytes *= pool.compute_dtype.itemsize  # what a group's gathered pages take
        # (j pages x page_bytes > DECODE_GROUP_BYTES exactly when j > budget: integers)
        budget = DECODE_GROUP_BYTES // page_bytes
        # On a CPU a group holds a multiple of the intra-op threads where there are that many
        # sequences, even past DECODE_GROUP_BYTES: the gather splits its pages evenly over the
        # threads and SDPA its (sequence, head) pairs, so each thread then reads the sequences
        # it gathered itself, from its own core's cache. With a lone long sequence per group the
        # other thread reads half of it from across the chip: on 2 cores, a 2,144-token bf16
        # sequence with 4 kv heads took 918 us to gather and attend alone, 342 us in pairs.
        threads = torch.get_num_threads() if pool.device.type == "cpu" else 1
        num = len(counts)
        bounds: list[tuple[int, int]] = []
        i = 0
        while i < num:
            j, biggest = i + 1, counts[i]
            while j < num:
                c = counts[j]
                widest = c if c > biggest else biggest
                if (j + 1 - i) * widest > budget:
                    break
                biggest, j = widest, j + 1
            n = j - i
            if n < threads:
                n = min(threads, num - i)
            else:
                n -= n % threads
            bounds.append((i, i + n))
            i += n
        return bounds

    def _plan_decode(
        self,
        rows: np.ndarray,
        pages: np.ndarray,
        n_pages: np.ndarray,
        kv_lens: np.ndarray,
        skipped: np.ndarray | None = None,
    ) -> list[_DecodeGroup]:
        """Groups of decode sequences, per sequence ``s``: its token's row ``rows[s]`` in the
        batch, its pages ``pages[s, :n_pages[s]]`` (``pages [D, W]``), ``kv_lens[s]`` tokens
        from the first page's first slot, of which the first ``skipped[s]`` are masked (before
        a sliding window; None: none). Columns of ``pages`` past a row's ``n_pages`` must
        repeat its first page (a valid page: the key mask hides it)."""
        counts = n_pages.tolist()
        lens = kv_lens.tolist()
        dev = self.kv_pool.device
        groups: list[_DecodeGroup] = []
        for i, k in self._group_bounds(counts):
            n = k - i
            kv_len, shortest = max(lens[i:k]), min(lens[i:k])
            skips = skipped is not None and bool(skipped[i:k].any())
            mask = None
            if skips or shortest != kv_len:
                keys = np.arange(kv_len)
                m = keys < kv_lens[i:k, None]
                if skips:
                    assert skipped is not None
                    m &= keys >= skipped[i:k, None]
                mask = torch.from_numpy(m).to(dev)[:, None, None, :]
            first = int(rows[i])
            groups.append(
                _DecodeGroup(
                    rows=torch.from_numpy(rows[i:k].copy()).to(dev),
                    # rows ascend: consecutive exactly when the last is n - 1 after the first
                    first_row=first if int(rows[k - 1]) - first == n - 1 else -1,
                    pages=torch.from_numpy(pages[i:k, : max(counts[i:k])].reshape(-1)).to(dev),
                    num_seqs=n,
                    kv_len=kv_len,
                    mask=mask,
                )
            )
        return groups

    def _plan_small_decode(self, layout: BatchLayout) -> list[_DecodeGroup]:
        """:meth:`_plan_decode`'s groups for a decode-only batch of fewer than
        ``ROWS_MIN_BATCH`` sequences, from its page tables as lists: for a handful of rows a
        Python pass costs less than the array calls' fixed cost. The same groups."""
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        lens = [p + 1 for p in layout.num_past]
        tables = [list(pt[: -(-n // ps)]) for pt, n in zip(layout.page_tables, lens, strict=True)]
        groups: list[_DecodeGroup] = []
        for i, k in self._group_bounds([len(t) for t in tables]):
            widest = max(len(t) for t in tables[i:k])
            flat: list[int] = []
            for t in tables[i:k]:
                flat.extend(t + [t[0]] * (widest - len(t)))
            kv_len = max(lens[i:k])
            mask = None
            if min(lens[i:k]) != kv_len:
                lens_t = torch.tensor(lens[i:k], dtype=torch.int64).unsqueeze(1)
                mask = (torch.arange(kv_len).unsqueeze(0) < lens_t).to(dev)[:, None, None, :]
            groups.append(
                _DecodeGroup(
                    rows=torch.arange(i, k, device=dev),
                    first_row=i,
                    pages=torch.tensor(flat, dtype=torch.int64, device=dev),
                    num_seqs=k - i,
                    kv_len=kv_len,
                    mask=mask,
                )
            )
        return groups

    # ---- forward -----------------------------------------------------------------------------
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k, v = self._write_new_kv(layer, q, k, v)
        return self.attend(layer, q, k, v)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``forward`` without the write: attention over the planned layout, the new tokens'
        K/V already in the pool and ``k, v`` as stored there (the cascade backend writes a
        mixed batch's K/V once, then hands this backend the rows it does not attend itself)."""
        pool = self.kv_pool
        kc, vc = pool.k[layer], pool.v[layer]
        out = torch.empty_like(q)
        prefills, groups = self._prefills, self._groups
        if self._windowed and self.layer_windows[layer] in self._windowed:
            prefills, groups = self._windowed[self.layer_windows[layer]]
        for item in prefills:
            if isinstance(item, _WindowChunk):
                self._attend_window_chunk(item, q, kc, vc, out)
            else:
                self._attend_prefill(item, q, k, v, kc, vc, out)
        for group in groups:
            if group.first_row >= 0:
                rows = slice(group.first_row, group.first_row + group.num_seqs)
                out[rows] = self._attend_decode(group, q[rows], kc, vc)
            else:
                o = self._attend_decode(group, q.index_select(0, group.rows), kc, vc)
                out.index_copy_(0, group.rows, o)
        return out

    def _attend_window_chunk(
        self, item: _WindowChunk, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        s, e = item.start, item.end
        keys, vals = self._paged_kv(kc, vc, item.pages, item.num_keys)
        o = self._sdpa(q[s:e].transpose(0, 1).unsqueeze(0), keys, vals, item.mask, gqa=True)
        out[s:e] = o[0].transpose(0, 1)

    def _sdpa(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
        *, gqa: bool,
    ) -> torch.Tensor:  # fmt: skip
        """``scaled_dot_product_attention`` at this backend's scale (``[..., H, n, D]``
        layouts; ``gqa``: q has a multiple of k's heads), or its soft-capped equivalent."""
        if self.softcap is not None:
            return softcapped_attention(q, k, v, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )

    def _attend_decode(
        self, group: _DecodeGroup, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        g, hq, d = q.shape
        hkv = self.num_kv_heads
        shape = (g, -1, hkv, d)
        # [g, L, Hkv, D] -> [g, Hkv, L, D] views; queries grouped per kv head: GQA without copies
        dt = q.dtype
        keys = self._kbuf.gather(kc, group.pages, dt).view(shape)[:, : group.kv_len].transpose(1, 2)
        vals = self._vbuf.gather(vc, group.pages, dt).view(shape)[:, : group.kv_len].transpose(1, 2)
        qg = q.view(g, hkv, hq // hkv, d)
        if self.softcap is not None:
            o = softcapped_attention(qg, keys, vals, group.mask, self.scale, self.softcap)
            return o.reshape(g, hq, d)
        o = F.scaled_dot_product_attention(
            flash_query_rows(qg), keys, vals, attn_mask=group.mask, scale=self.scale
        )
        return o[:, :, : hq // hkv].reshape(g, hq, d)

    def _attend_prefill(
        self,
        item: _Prefill,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        s, e = item.start, item.end
        if self._matmul_prefill:
            if item.pages is None:
                out[s:e] = causal_matmul_attention(q[s:e], k[s:e], v[s:e], self.scale)
            else:  # the new K/V are in the pool already: gather past and new keys together
                keys, vals = self._paged_tokens(kc, vc, item.pages, item.num_past + (e - s))
                out[s:e] = causal_matmul_attention(q[s:e], keys, vals, self.scale)
            return
        if item.pages is None:  # nothing in the pool before: attend the fresh K/V directly
            o = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1).unsqueeze(0),
                k[s:e].transpose(0, 1).unsqueeze(0),
                v[s:e].transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s:e] = o[0].transpose(0, 1)
            return
        if not item.chunks:
            out[s:e] = self._attend_split(item, q[s:e], k[s:e], v[s:e], kc, vc)
            return
        keys, vals = self._paged_kv(kc, vc, item.pages, item.num_past + (e - s))
        for a, b, mask in item.chunks:
            n_keys = item.num_past + b
            o = self._sdpa(
                q[s + a : s + b].transpose(0, 1).unsqueeze(0),
                keys[:, :, :n_keys],
                vals[:, :, :n_keys],
                mask,
                gqa=True,
            )
            out[s + a : s + b] = o[0].transpose(0, 1)

    def _paged_kv(
        self, kc: torch.Tensor, vc: torch.Tensor, pages: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of ``pages`` as ``[1, Hkv, length, D]`` views of the
        gather buffers (valid until the next gather)."""
        keys, vals = self._paged_tokens(kc, vc, pages, length)
        return keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)

    def _paged_tokens(
        self, kc: torch.Tensor, vc: torch.Tensor, pages: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of ``pages`` as ``[length, Hkv, D]`` views of the gather
        buffers (valid until the next gather)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        dt = self.kv_pool.compute_dtype
        keys = self._kbuf.gather(kc, pages, dt).view(shape)[:length]
        vals = self._vbuf.gather(vc, pages, dt).view(shape)[:length]
        return keys, vals

    def _attend_split(
        self,
        item: _Prefill,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor:
        """New queries ``q [n, Hq, D]`` over the past keys (pages) and their own ``k, v
        [n, Hkv, D]`` (causal), merged by log-sum-exp. Returns ``[n, Hq, D]``."""
        assert item.pages is not None and FLASH_CPU_WITH_LSE is not None
        n, hq, d = q.shape
        hkv, past = self.num_kv_heads, item.num_past
        g = hq // hkv
        past_pages = item.pages[: pages_for(past, self.kv_pool.page_size)]
        kp, vp = self._paged_kv(kc, vc, past_pages, past)
        # past part has no mask, so a kv head's g query heads can share one row axis:
        # [n, Hkv, G, D] -> [1, Hkv, G*n, D]
        qf = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d)
        o_p, lse_p = FLASH_CPU_WITH_LSE(qf, kp, vp, 0.0, False, scale=self.scale)
        o_p = o_p.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
        lse_p = lse_p.view(hkv, g, n).permute(2, 0, 1).reshape(n, hq)
        # own part: causal square, as in a fresh prefill; [1, H, n, D] views
        kn, vn = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if g > 1:
            kn, vn = kn.repeat_interleave(g, dim=1), vn.repeat_interleave(g, dim=1)
        o_n, lse_n = FLASH_CPU_WITH_LSE(
            q.transpose(0, 1).unsqueeze(0), kn, vn, 0.0, True, scale=self.scale
        )
        o, _ = merge_attention_states(o_p, lse_p, o_n[0].transpose(0, 1), lse_n[0].transpose(0, 1))
        return o.to(q.dtype)
