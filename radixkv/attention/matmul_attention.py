"""Causal prefill attention as blocks of matrix products, for CPUs (bf16 and fp32).

PyTorch's CPU flash-attention kernel leaves most of a CPU's matrix speed unused: its small
per-tile GEMMs do not reach the bf16 units of a CPU with AVX512-BF16 but no AMX (bf16 runs at
about float32 speed), and in fp32 it runs at about the BLAS's speed, which on AMD CPUs is half
of what oneDNN reaches (radixkv/onednn.py). On a 2-core AVX512-BF16 AMD EPYC, one 4,096-token
causal head of 64 dims takes the kernel 19 ms in bf16 or fp32, the same work as batched bf16
matmuls (``torch.bmm``, oneDNN) 7-10 ms, and as fp32 oneDNN matmuls 9.6 ms; a 128-token chunk
on 3,968 cached tokens 0.96 ms (flash kernel, past and own keys merged by log-sum-exp) against
0.60 ms. So on a CPU the torch backend computes bf16 prefill attention here, and fp32 prefill
attention too when oneDNN is there.

Queries go in row blocks; each block's scores over the keys it may see are one matrix product
per kv head (GQA: a kv head's query heads share it), the causal triangle of the block's own
keys is masked, softmax runs over the scores with an fp32 accumulator (PyTorch's CPU softmax),
and the probabilities multiply V in a second product.

fp32: one pass, ``(scale * q) @ k^T`` and ``p @ v`` through :func:`radixkv.onednn.linear`
(``F.linear`` where oneDNN is missing). The mean error against an fp64 reference is 1.1-1.4x
the flash kernel's (about 1e-8 on unit-scale data: the order of the sums differs).

bf16: a ``bmm`` rounds each score to bf16 on output, which by itself doubles the error of the
result against an fp32 reference compared with the flash kernel (that keeps scores in fp32). So
the scores are computed twice: once to find each row's largest score ``m``, then as
``scale * q.k - scale * m`` by ``baddbmm``, whose subtraction happens in the fp32 accumulator
before the one rounding. The scores that matter (near the row's maximum) are then small numbers
rounded to bf16, accurate to about 2^-9 of their distance from the maximum. Measured against an
fp64 reference: on radixkv-tiny's own attention (4,096 tokens) the mean error is 1.2x the flash
kernel's, on random data 1.03-1.08x (one pass: 1.9-2.3x; a cheaper estimate of ``m`` from the
block's own keys and the first keys was 16x worse on the trained model, whose largest scores
are elsewhere), and the attention runs 1.5-2x faster than the flash kernel.

Scores more than ``-SCORE_FLOOR`` below their row's maximum are raised to it before the softmax
(their weight changes from below e^-60 to e^-60 of the maximum's: nothing at bf16 precision).
Without the floor a trained model's peaked rows send most ``exp`` results into float32's
denormal range, which the CPU computes in slow microcode: 15% of the attention time.
"""

from __future__ import annotations

import torch

from radixkv.onednn import linear

# A block's score matrix ([kv heads, rows * group, keys] bf16) is kept near this size: large
# enough that each bmm is efficient, small enough to stay in the caches between the passes.
BLOCK_BYTES = 4 << 20
MIN_ROWS, MAX_ROWS = 32, 256
# Shifted scores (row maximum 0) are clamped to at least this: exp(-60) / 4096 keys is still a
# normal float32, so no softmax result is denormal.
SCORE_FLOOR = -60.0


def block_rows(num_qo_heads: int, num_keys: int, itemsize: int = 2) -> int:
    """Query rows per block for ``num_keys`` keys (a multiple of 16 in [32, 256])."""
    rows = BLOCK_BYTES // (itemsize * num_qo_heads * max(num_keys, 1))
    return max(MIN_ROWS, min(MAX_ROWS, rows // 16 * 16))


def causal_matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``n`` of ``L`` positions over all ``L``.

    ``q [n, Hq, D]`` are the queries of positions ``L - n .. L - 1``; ``k, v [L, Hkv, D]`` the
    keys and values of positions ``0 .. L - 1`` (any strides). Query ``i`` attends keys
    ``0 .. L - n + i``. Returns ``[n, Hq, D]`` in ``q``'s dtype. ``Hq`` is a multiple of ``Hkv``.
    bf16 and fp32 (module docstring); for fp32, run under ``torch.inference_mode`` or
    ``no_grad`` to get oneDNN's products.
    """
    if q.dtype is torch.float32:
        return _fp32_attention(q, k, v, scale)
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    past = length - n
    # head-major copies, once per call: [Hkv, n, g, D] (a row block is then one contiguous
    # [Hkv, rows * g, D] view), K transposed for q @ k^T, V as [Hkv, L, D]
    qh = q.view(n, hkv, g, d).transpose(0, 1).contiguous()
    kt = k.permute(1, 2, 0).contiguous()
    vh = v.transpose(0, 1).contiguous()
    out = torch.empty_like(q)
    out_heads = out.view(n, hkv, g, d)
    rows = block_rows(hq, length)
    neg_inf = float("-inf")
    # causal mask of a block's own keys: row i may not see its block's column j > i
    upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        r, end = b - a, past + b
        qb = qh[:, a:b].reshape(hkv, r * g, d)
        keys = kt[:, :, :end]
        hidden = upper[:r, None, :r]  # [r, 1 (group), r]
        first = torch.bmm(qb, keys)  # [Hkv, r * g, end], each score rounded to bf16
        first.view(hkv, r, g, end)[..., past + a :].masked_fill_(hidden, neg_inf)
        offset = first.amax(-1, keepdim=True).mul_(-scale)  # -scale * row max
        scores = torch.baddbmm(offset.expand(-1, -1, end), qb, keys, alpha=scale)
        scores.clamp_min_(SCORE_FLOOR)  # before the mask: masked keys stay -inf
        scores.view(hkv, r, g, end)[..., past + a :].masked_fill_(hidden, neg_inf)
        probs = torch.softmax(scores, dim=-1)
        o = torch.bmm(probs, vh[:, :end])  # [Hkv, r * g, D]
        out_heads[a:b] = o.view(hkv, r, g, d).transpose(0, 1)
    return out


def _fp32_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """causal_matmul_attention in fp32: one pass of oneDNN products per kv head and row block."""
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    past = length - n
    # [Hkv, n * g, D], the scale folded in (n * Hq * D multiplies instead of one per score);
    # per kv head, K as the product's [L, D] "weight" and V^T as a [D, L] view of it
    qh = (q * scale).view(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)
    kh = k.transpose(0, 1)
    vh = v.transpose(0, 1)
    if hkv > 1 or not (k.is_contiguous() and v.is_contiguous()):
        # each head's K and V as one contiguous [L, D] matrix (a fused QKV output is strided)
        kh, vh = kh.contiguous(), vh.contiguous()
    out = torch.empty_like(q)
    out_heads = out.view(n, hkv, g, d)
    rows = block_rows(hq, length, itemsize=4)
    neg_inf = float("-inf")
    upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for h in range(hkv):
        keys, vals_t = kh[h], vh[h].t()
        for a in range(0, n, rows):
            b = min(n, a + rows)
            r, end = b - a, past + b
            scores = linear(qh[h, a * g : b * g], keys[:end], None)  # [r * g, end]
            scores.view(r, g, end)[..., past + a :].masked_fill_(upper[:r, None, :r], neg_inf)
            probs = torch.softmax(scores, dim=-1)
            out_heads[a:b, h] = linear(probs, vals_t[:, :end], None).view(r, g, d)
    return out
