"""Causal prefill attention as blocks of bf16 matrix products, for CPUs with bf16 matrix units.

PyTorch's CPU flash-attention kernel runs bf16 at about float32 speed on a CPU with AVX512-BF16
but no AMX (its small per-tile GEMMs do not reach the bf16 units): on a 2-core AVX512-BF16
machine, 19 ms for one 4,096-token causal head of 64 dims, where the same work as batched bf16
matmuls (``torch.bmm``, oneDNN) takes 7-10 ms. For a bf16 prefill that attention is the largest
cost after the linear layers, so on a CPU the torch backend computes bf16 prefill attention here.

Queries go in row blocks; each block's scores over the keys it may see are one ``bmm`` per kv
head (GQA: a kv head's query heads share it), the causal triangle of the block's own keys is
masked, softmax runs over the bf16 scores with an fp32 accumulator (PyTorch's CPU softmax),
and the probabilities (bf16, as in every bf16 kernel) multiply V in a second ``bmm``.

Accuracy: a bf16 ``bmm`` rounds each score to bf16 on output, which by itself doubles the error
of the result against an fp32 reference compared with the flash kernel (that keeps scores in
fp32). So the scores are computed twice: once to find each row's largest score ``m``, then as
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

# A block's score matrix ([kv heads, rows * group, keys] bf16) is kept near this size: large
# enough that each bmm is efficient, small enough to stay in the caches between the passes.
BLOCK_BYTES = 4 << 20
MIN_ROWS, MAX_ROWS = 32, 256
# Shifted scores (row maximum 0) are clamped to at least this: exp(-60) / 4096 keys is still a
# normal float32, so no softmax result is denormal.
SCORE_FLOOR = -60.0


def block_rows(num_qo_heads: int, num_keys: int) -> int:
    """Query rows per block for ``num_keys`` keys (a multiple of 16 in [32, 256])."""
    rows = BLOCK_BYTES // (2 * num_qo_heads * max(num_keys, 1))
    return max(MIN_ROWS, min(MAX_ROWS, rows // 16 * 16))


def causal_matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``n`` of ``L`` positions over all ``L``.

    ``q [n, Hq, D]`` are the queries of positions ``L - n .. L - 1``; ``k, v [L, Hkv, D]`` the
    keys and values of positions ``0 .. L - 1`` (any strides). Query ``i`` attends keys
    ``0 .. L - n + i``. Returns ``[n, Hq, D]`` in ``q``'s dtype. ``Hq`` is a multiple of ``Hkv``.
    """
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
