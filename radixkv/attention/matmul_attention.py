"""Causal prefill attention as blocks of matrix products, for CPUs (bf16 and fp32).

PyTorch's CPU flash-attention kernel leaves most of a CPU's matrix speed unused: its small
per-tile GEMMs do not reach the bf16 units of a CPU with AVX512-BF16 but no AMX (bf16 runs at
about float32 speed), and in fp32 it runs at about the BLAS's speed, which on AMD CPUs is half
of what oneDNN reaches (radixkv/onednn.py). On a 2-core AVX512-BF16 AMD EPYC, one 4,096-token
causal head of 64 dims takes the kernel 19 ms in bf16 or fp32, and the blocks here 7.8 ms in
bf16 and 7.9 ms in fp32; a 128-token chunk on 3,968 cached tokens 0.96 ms (flash kernel, past
and own keys merged by log-sum-exp) against 0.47 ms. So on a CPU the torch backend computes
bf16 prefill attention here, and fp32 prefill attention too when oneDNN is there.

Queries go in row blocks; each block's scores over the keys it may see are one matrix product
per kv head (GQA: a kv head's query heads share it), ``(scale * q) @ k^T`` in fp32 through
:func:`radixkv.onednn.linear` (``F.linear`` where oneDNN is missing), whatever the model's
dtype: q and k are upcast once per call. The causal triangle of the block's own keys is masked,
softmax runs in fp32, and the probabilities, in the values' dtype, multiply V in a second
product (bf16 through PyTorch's oneDNN matmul, fp32 through oneDNN as the scores).

Accuracy, mean error against an fp64 reference: fp32, 1.1-1.4x the flash kernel's (about 1e-8
on unit-scale data: the order of the sums differs); bf16, 1.1-1.3x the kernel's on random data,
where the kernel also rounds its probabilities to bf16 before ``p @ v``. Scores are never
rounded to bf16: an earlier version here computed them with bf16 products, which round each
score on output, and needed a second product to shift them by their row maximum first; fp32
scores through oneDNN cost less than the two bf16 products (7.8 ms against 10 ms for the head
above) and are more accurate (that version was 1.2-1.45x the kernel's error). Exponentials of
very negative scores land in float32's denormal range, which CPUs compute slowly, but on
radixkv-tiny with real text a score floor bought nothing measurable, so there is none.
"""

from __future__ import annotations

import torch

from radixkv.onednn import linear

# A block's score matrix ([rows * group, keys] fp32, per kv head) is kept near this size: large
# enough that each product is efficient, small enough to stay in the caches until softmax.
BLOCK_BYTES = 4 << 20
MIN_ROWS, MAX_ROWS = 32, 256


def block_rows(group: int, num_keys: int, itemsize: int = 4) -> int:
    """Query rows per block for ``num_keys`` keys and ``group`` query heads per kv head (a
    multiple of 16 in [32, 256])."""
    rows = BLOCK_BYTES // (itemsize * group * max(num_keys, 1))
    return max(MIN_ROWS, min(MAX_ROWS, rows // 16 * 16))


def causal_matmul_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of the last ``n`` of ``L`` positions over all ``L``.

    ``q [n, Hq, D]`` are the queries of positions ``L - n .. L - 1``; ``k, v [L, Hkv, D]`` the
    keys and values of positions ``0 .. L - 1`` (any strides). Query ``i`` attends keys
    ``0 .. L - n + i``. Returns ``[n, Hq, D]`` in ``q``'s dtype (bf16 or fp32; module
    docstring). ``Hq`` is a multiple of ``Hkv``. Run under ``torch.inference_mode`` or
    ``no_grad`` to get oneDNN's fp32 products.
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    past = length - n
    # fp32 queries [Hkv, n * g, D] with the scale folded in, and per kv head K as the score
    # product's [L, D] "weight" (fp32) and V^T as a [D, L] view (the values' own dtype)
    qh = (q.float() * scale).view(n, hkv, g, d).transpose(0, 1).reshape(hkv, n * g, d)
    kf = k.float()
    kh, vh = kf.transpose(0, 1), v.transpose(0, 1)
    if hkv > 1 or not (kf.is_contiguous() and v.is_contiguous()):
        # each head's K and V as one contiguous [L, D] matrix (a fused QKV output is strided)
        kh, vh = kh.contiguous(), vh.contiguous()
    out = torch.empty_like(q)
    out_heads = out.view(n, hkv, g, d)
    rows = block_rows(g, length)
    neg_inf = float("-inf")
    # causal mask of a block's own keys: row i may not see its block's column j > i
    upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
    for h in range(hkv):
        keys, vals_t = kh[h], vh[h].t()
        for a in range(0, n, rows):
            b = min(n, a + rows)
            r, end = b - a, past + b
            scores = linear(qh[h, a * g : b * g], keys[:end], None)  # [r * g, end] fp32
            scores.view(r, g, end)[..., past + a :].masked_fill_(upper[:r, None, :r], neg_inf)
            probs = torch.softmax(scores, dim=-1).to(v.dtype)
            out_heads[a:b, h] = linear(probs, vals_t[:, :end], None).view(r, g, d)
    return out
