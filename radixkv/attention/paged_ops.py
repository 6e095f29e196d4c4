"""Pure-PyTorch building blocks for attention over paged KV.

Reused by the torch backend and by the cascade (shared-prefix) attention: attention of a set of
queries over a list of pages that returns the output *and* its log-sum-exp, so partial results over
disjoint key sets can be merged exactly (:func:`merge_attention_states`).

LSE convention here: natural log of the sum of ``exp(scale * q.k)`` over the attended keys
(FlashInfer returns base 2; multiply by ``ln 2`` to compare).
"""

from __future__ import annotations

import torch

from radixkv.kv.kv_pool import load_as
from radixkv.pages import pages_for

# PyTorch's CPU flash-attention kernel, which (unlike F.scaled_dot_product_attention) also returns
# the log-sum-exp (natural log, scale included): (q, k, v, dropout_p, is_causal, *, attn_mask,
# scale) -> (o, lse, ...). A private op, so None when this PyTorch lacks it; callers keep a path
# without it.
FLASH_CPU_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_query_rows(q: torch.Tensor) -> torch.Tensor:
    """``q [B, H, R, D]`` as PyTorch's CPU flash kernel runs it fastest: a lone bf16 row per
    head (``R == 1``) is duplicated to two rows; anything else is returned as is. The caller
    keeps the first ``R`` rows of the kernel's outputs (``o[:, :, :R]``, ``lse[:, :, :R]``).

    Why: in bf16 the kernel's ``q @ k^T`` for a one-row query block falls to a much slower
    product than for two rows. On a 2-core Zen 4 EPYC, a decode step of 4 sequences x 4,104
    keys x one 64-dim head took 883 us with one row per head and 283 us with two (the second
    row's keys and values are read from cache, never again from memory); 2 sequences x 4 kv
    heads of 2,144 keys, 923 against 294 us. The duplicate row's output is bitwise the first's.
    fp32 runs one row fastest (204 against 249 us above), and fp16 gains nothing, so both pass
    through unchanged.
    """
    if q.shape[-2] != 1 or q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return q
    b, h, _, d = q.shape
    return q.expand(b, h, 2, d).contiguous()  # contiguous: the kernel is slower on a 0 stride


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Contiguous copy of the given pages laid end to end.

    ``cache [num_pages, page_size, H, D]``, ``pages [..., n]`` int64 ->
    ``[..., n * page_size, H, D]``. One ``index_select`` over whole pages.
    """
    flat = pages.reshape(-1)
    out = cache.index_select(0, flat)  # [prod(...) * n, ps, H, D]
    ps, h, d = cache.shape[1:]
    return out.view(*pages.shape[:-1], pages.shape[-1] * ps, h, d)


class GatherBuffer:
    """Grow-only scratch for gathered pages, reused by every layer and step (never returned).

    On a CPU a gather is a memory copy as large as the KV it reads; copying into the same buffer
    each time keeps it in cache for the kernel that reads it next and never touches freshly
    allocated memory (a fresh multi-megabyte tensor is fresh pages from the OS, whose faults cost
    more than the copy). What :meth:`gather` returns is valid until its next call.

    Pages stored in another dtype than attention computes in (an fp8 pool, see KVPool) are
    gathered as stored into a second scratch of their own dtype, then converted into this one:
    the conversion reads the small gathered copy, not the pool.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._stored: GatherBuffer | None = None  # scratch in the pool's dtype, when it differs

    def reserve(
        self, n: int, cache: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The buffer as ``[capacity, page numel]`` in ``dtype`` (default: ``cache``'s) with room
        for ``n`` pages of ``cache`` (``[N, ps, H, D]``). The same tensor until a larger ``n``,
        another page shape, dtype or device needs a new one, so views of it may be kept while
        it is returned."""
        dtype = cache.dtype if dtype is None else dtype
        shape = cache.shape
        row = shape[1] * shape[2] * shape[3]
        buf = self._buf
        if (
            buf is None
            or buf.shape[0] < n
            or buf.shape[1] != row
            or buf.dtype != dtype
            or buf.device != cache.device
        ):
            grow = buf is not None and buf.shape[1] == row and buf.dtype == dtype
            # a normal tensor even when first used under inference_mode, so later calls outside
            # inference mode may still write into it
            with torch.inference_mode(False):
                buf = self._buf = torch.empty(
                    max(n, 2 * buf.shape[0]) if grow and buf is not None else n,
                    row,
                    dtype=dtype,
                    device=cache.device,
                )
        return buf

    def gather(
        self, cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """``cache [N, ps, H, D]`` pages ``[n]`` (int64) -> ``[n, ps, H, D]`` view of the buffer,
        in ``dtype`` (default: ``cache``'s)."""
        n = pages.shape[0]
        out = self.reserve(n, cache, dtype)[:n].view(n, *cache.shape[1:])
        return self.gather_into(cache, pages, out)

    def gather_into(
        self, cache: torch.Tensor, pages: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Fill ``out`` (``[n, ps, H, D]``, any float dtype) with ``cache``'s pages ``[n]``,
        converted to ``out``'s dtype; returns ``out``."""
        if out.dtype == cache.dtype:
            return torch.index_select(cache, 0, pages, out=out)
        if self._stored is None:
            self._stored = GatherBuffer()
        return load_as(self._stored.gather(cache, pages), out.dtype, out)


def token_slots(page_table: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat pool slots ``page * page_size + offset`` of tokens ``start .. end-1`` (int64)."""
    first, last = start // page_size, pages_for(end, page_size)
    pages = page_table[first:last].to(torch.int64)
    offs = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    slots = (pages.unsqueeze(1) * page_size + offs).reshape(-1)
    base = first * page_size
    return slots[start - base : end - base]


def attend_pages_with_lse(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor | int,
    *,
    q_positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries over paged keys, returning ``(output, lse)`` in fp32.

    Two forms:

    * one key set for all queries: ``q [n, Hq, D]``, ``page_table [P]`` (int64), ``kv_lens`` an int
      (keys ``0 .. kv_len-1`` of that page list);
    * one key set per query row (batched decode): ``q [B, Hq, D]``, ``page_table [B, P]``,
      ``kv_lens [B]`` tensor (row ``b`` attends keys ``0 .. kv_lens[b]-1`` of its own pages).

    ``q_positions`` (``[n]`` or ``[B]``) makes it causal: a query at position ``p`` sees only keys
    ``j <= p`` (key ``j`` = token ``j`` of the page list). GQA: ``Hq`` is a multiple of the cache's
    ``H_kv``; query head ``h`` reads kv head ``h // (Hq // H_kv)``.

    Returns ``o [n|B, Hq, D]`` and ``lse [n|B, Hq]`` (natural log). A query that sees no key gets
    ``o = 0`` and ``lse = -inf``, so merging it with another state is a no-op.
    """
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    batched = page_table.dim() == 2
    k = gather_pages(k_cache, page_table).float()  # [(B,) L, Hkv, D]
    v = gather_pages(v_cache, page_table).float()
    length = k.shape[-3]
    key_idx = torch.arange(length, device=q.device)
    if batched:
        if not isinstance(kv_lens, torch.Tensor):
            raise TypeError("attend_pages_with_lse: batched form needs kv_lens as a [B] tensor")
        valid = key_idx.unsqueeze(0) < kv_lens.to(q.device).unsqueeze(1)  # [B, L]
        qg = q.float().view(n, hkv, group, d)
        scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # [B, Hkv, G, L]
        if q_positions is not None:
            valid = valid & (key_idx.unsqueeze(0) <= q_positions.unsqueeze(1))
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, G]
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        o = torch.einsum("bhgl,blhd->bhgd", probs, v)
        return o.reshape(n, hq, d), lse.reshape(n, hq)
    kv_len = int(kv_lens)
    k, v = k[:kv_len], v[:kv_len]
    qg = q.float().view(n, hkv, group, d)
    scores = torch.einsum("nhgd,lhd->hgnl", qg, k) * scale  # [Hkv, G, n, L]
    if q_positions is not None:
        visible = key_idx[:kv_len].unsqueeze(0) <= q_positions.unsqueeze(1)  # [n, L]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G, n]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    o = torch.einsum("hgnl,lhd->nhgd", probs, v)
    return o.reshape(n, hq, d), lse.permute(2, 0, 1).reshape(n, hq)


def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: ``o [N, H, D]``, ``lse [N, H]`` (natural log).

    Exact: the result equals attention over the union of the key sets. Either side may be empty
    (``lse = -inf``).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - safe).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """Attention with Gemma 2's soft-capped scores, ``softmax(cap * tanh(scale * q k^T / cap))
    v``, in fp32 (PyTorch's fused kernels have no cap). ``q [..., Hq, n, D]``, ``k, v [..., Hkv,
    L, D]`` with ``Hq`` a multiple of ``Hkv`` (a kv head's query heads are consecutive);
    ``mask`` broadcasts to ``[..., Hq, n, L]`` (True = attend; every row must see a key).
    Returns ``[..., Hq, n, D]`` in ``q``'s dtype."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / cap)
    scores = scores.tanh_().mul_(cap)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
