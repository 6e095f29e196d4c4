"""Pure-PyTorch paged attention: the CPU default, also correct (if not fastest) on a GPU.

Per step (``plan``): flat write slots for all new tokens; decode sequences (one new token) are
batched through a padded page index ``[B, max_pages]`` plus a key mask; prefill sequences keep their
page list and a few query chunks with bottom-right causal masks. Per layer (``forward``): one
``index_copy_`` writes the new K/V, one ``index_select`` of whole pages gathers each key set into a
contiguous buffer, and ``scaled_dot_product_attention`` does the maths. No per-token Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.attention.base import AttentionBackend, BatchLayout
from radixkv.attention.paged_ops import gather_pages, token_slots
from radixkv.kv.kv_pool import KVPool

# Queries of a prefill with cached/past tokens are processed in chunks of this many rows: each
# chunk attends keys 0 .. its last position, so only a chunk-sized triangle is wasted on masking.
PREFILL_QUERY_CHUNK = 256


@dataclass
class _Prefill:
    start: int  # token range [start, end) in the ragged batch
    end: int
    num_past: int
    pages: torch.Tensor | None  # [n_pages] int64, only when num_past > 0
    # (a, b, mask): new tokens a..b-1 attend keys 0 .. num_past+b-1; mask [b-a, num_past+b] or None
    chunks: list[tuple[int, int, torch.Tensor | None]]


@dataclass
class _Decode:
    token_idx: torch.Tensor | None  # [B] rows of the batch; None when the batch is all decode
    pages: torch.Tensor  # [B, max_pages] int64 (padded with a valid page)
    kv_len: int  # max_pages * page_size trimmed to the longest sequence
    mask: torch.Tensor | None  # [B, 1, 1, kv_len] bool (True = attend); None if no padding


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
    ) -> None:
        super().__init__(kv_pool, num_qo_heads, num_kv_heads, head_dim, scale)
        self._slots: torch.Tensor | None = None
        self._prefills: list[_Prefill] = []
        self._decode: _Decode | None = None
        self._num_tokens = 0

    def plan(self, layout: BatchLayout) -> None:
        pool = self.kv_pool
        ps, dev = pool.page_size, pool.device
        layout.validate(ps, pool.num_pages)
        slots: list[torch.Tensor] = []
        prefills: list[_Prefill] = []
        dec_rows: list[int] = []
        dec_pages: list[list[int]] = []
        dec_lens: list[int] = []
        start = 0
        for pt, past, new in zip(layout.page_tables, layout.num_past, layout.num_new, strict=True):
            total = past + new
            n_pages = (total + ps - 1) // ps
            pt_cpu = torch.tensor(pt[:n_pages], dtype=torch.int64)
            slots.append(token_slots(pt_cpu, past, total, ps))
            if new == 1 and past > 0:
                dec_rows.append(start)
                dec_pages.append(list(pt[:n_pages]))
                dec_lens.append(total)
            else:
                prefills.append(self._plan_prefill(start, past, new, pt_cpu))
            start += new
        self._num_tokens = start
        self._slots = torch.cat(slots).to(dev, non_blocking=True)
        self._prefills = prefills
        self._decode = self._plan_decode(dec_rows, dec_pages, dec_lens, start) if dec_rows else None

    def _plan_prefill(self, start: int, past: int, new: int, pt_cpu: torch.Tensor) -> _Prefill:
        dev = self.kv_pool.device
        if past == 0:
            return _Prefill(start, start + new, 0, None, [(0, new, None)])
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

    def _plan_decode(
        self, rows: list[int], pages: list[list[int]], lens: list[int], num_tokens: int
    ) -> _Decode:
        ps, dev = self.kv_pool.page_size, self.kv_pool.device
        max_pages = max(len(p) for p in pages)
        padded = [p + [p[0]] * (max_pages - len(p)) for p in pages]
        kv_len = max(lens)
        mask = None
        if any(n != kv_len for n in lens):
            lens_t = torch.tensor(lens, dtype=torch.int64)
            mask = (torch.arange(kv_len).unsqueeze(0) < lens_t.unsqueeze(1)).to(dev)
            mask = mask[:, None, None, :]
        all_decode = len(rows) == num_tokens
        del ps
        return _Decode(
            token_idx=None if all_decode else torch.tensor(rows, dtype=torch.int64, device=dev),
            pages=torch.tensor(padded, dtype=torch.int64, device=dev),
            kv_len=kv_len,
            mask=mask,
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._slots is None:
            raise RuntimeError("TorchAttention.forward called before plan()")
        if q.shape[0] != self._num_tokens:
            raise ValueError(f"planned {self._num_tokens} tokens, got q with {q.shape[0]}")
        pool = self.kv_pool
        pool.write(layer, self._slots, k, v)
        kc, vc = pool.k[layer], pool.v[layer]
        dec = self._decode
        if dec is not None and dec.token_idx is None:
            return self._attend_decode(dec, q, kc, vc)
        out = torch.empty_like(q)
        for item in self._prefills:
            self._attend_prefill(item, q, k, v, kc, vc, out)
        if dec is not None:
            assert dec.token_idx is not None
            out.index_copy_(0, dec.token_idx, self._attend_decode(dec, q[dec.token_idx], kc, vc))
        return out

    def _attend_decode(
        self, dec: _Decode, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        b, hq, d = q.shape
        hkv = self.num_kv_heads
        # [B, L, Hkv, D] -> [B, Hkv, L, D] views; queries grouped per kv head so GQA needs no copy
        keys = gather_pages(kc, dec.pages)[:, : dec.kv_len].transpose(1, 2)
        vals = gather_pages(vc, dec.pages)[:, : dec.kv_len].transpose(1, 2)
        qg = q.view(b, hkv, hq // hkv, d)
        o = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=dec.mask, scale=self.scale)
        return o.reshape(b, hq, d)

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
        kv_len = item.num_past + (e - s)
        keys = gather_pages(kc, item.pages)[:kv_len].transpose(0, 1).unsqueeze(0)  # [1,Hkv,L,D]
        vals = gather_pages(vc, item.pages)[:kv_len].transpose(0, 1).unsqueeze(0)
        for a, b, mask in item.chunks:
            n_keys = item.num_past + b
            o = F.scaled_dot_product_attention(
                q[s + a : s + b].transpose(0, 1).unsqueeze(0),
                keys[:, :, :n_keys],
                vals[:, :, :n_keys],
                attn_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            out[s + a : s + b] = o[0].transpose(0, 1)
