"""Causal prefill attention as blocks of matrix products, for CPUs (bf16 and fp32).

PyTorch's CPU flash-attention kernel can leave much of a CPU's matrix speed unused: its small
per-tile GEMMs do not reach the bf16 units of a CPU with AVX512-BF16 but no AMX (bf16 runs at
about float32 speed), and in fp32 it runs at about the BLAS's speed, which on AMD CPUs is half
of what oneDNN reaches (radixkv/onednn.py). On a 2-core AMD EPYC with full-width AVX-512 (Zen
5), one 4,096-token causal head of 64 dims takes the kernel 19 ms in bf16 or fp32, and the
blocks here 7.8 ms in bf16 and 7.9 ms in fp32; a 128-token chunk on 3,968 cached tokens 0.96
ms (flash kernel, past and own keys merged by log-sum-exp) against 0.47 ms. But on a 2-core
EPYC whose AVX-512 runs at half width (Zen 4: fp32 and bf16 matmuls at half of Zen 5's speed)
the kernel is as fast or faster: 22.5 against 28 ms for that head in bf16, 21 against 22 in
fp32, and 38-40 against 46-61 ms for a 2,112-token prefill of 8 query and 4 kv heads. So whether
the blocks pay is measured, once per process and head shape (:func:`pays`), and the torch
backend computes CPU prefill attention here (bf16, and fp32 when oneDNN is there) only where
they do.

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

import time

import torch
import torch.nn.functional as F

from radixkv.onednn import linear

# "auto": the blocks run where they beat the flash kernel on this CPU (measured by ``pays``);
# "always" / "never" decide without measuring (read per call: tests and studies set it).
MODE = "auto"
# The measurement: a causal prefill of this many tokens, on at most two kv heads (the cost is
# per head, so more heads would only take longer), best of this many runs of each, interleaved.
CALIBRATION_TOKENS = 1024
CALIBRATION_RUNS = 3
# The blocks must take at most this share of the kernel's time to be chosen. Where the two are
# closer, the measurement's noise would pick either from one process to the next, and with it
# the rounding of every prefill: on a 2-core Zen 4, radixkv-tiny's bf16 head timed 1.64-2.39 ms
# (blocks) against 1.69-1.75 ms (kernel) in four processes, two picks each way, and the greedy
# outputs of a bf16 tree-of-thought run differed between processes at near ties. The kernel is
# kept there (at most 15% slower in prefill attention); a real win (2.4x on Zen 5) still counts.
MIN_SHARE = 0.85
_PAYS: dict[tuple[torch.dtype, int, int, int, int], bool] = {}

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


def pays(dtype: torch.dtype, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`causal_matmul_attention` beats PyTorch's CPU flash kernel for a causal
    prefill of this head shape and dtype on this CPU, with torch's current thread count.

    Under ``MODE = "auto"`` the first call per (dtype, query heads per kv head, head_dim,
    threads) times both (``CALIBRATION_TOKENS`` tokens, up to two kv heads, best of
    ``CALIBRATION_RUNS``; tens of milliseconds for a small model) and the answer is kept for
    the process, so one process takes one path throughout; the blocks are chosen only when they
    take under ``MIN_SHARE`` of the kernel's time, so that a near tie does not pick a different
    path (and rounding) from process to process. Both are exact attention: the choice changes
    speed and rounding, never which keys a query sees.
    """
    if MODE != "auto":
        return MODE == "always"
    group = num_qo_heads // num_kv_heads
    hkv = min(num_kv_heads, 2)
    key = (dtype, group, hkv, head_dim, torch.get_num_threads())
    answer = _PAYS.get(key)
    if answer is None:
        matmul_s, flash_s = _time_both(dtype, group * hkv, hkv, head_dim)
        answer = _PAYS[key] = matmul_s < MIN_SHARE * flash_s
    return answer


def _time_both(dtype: torch.dtype, hq: int, hkv: int, d: int) -> tuple[float, float]:
    """Best-of seconds of a ``CALIBRATION_TOKENS``-token causal prefill: (blocks, flash)."""
    n = CALIBRATION_TOKENS
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype)
    scale = d**-0.5
    # the flash kernel's [1, H, n, D] views, as the torch backend passes them
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def blocks() -> object:
        return causal_matmul_attention(q, k, v, scale)

    def flash() -> object:
        return F.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
        )

    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        blocks(), flash()  # first calls: allocations, oneDNN primitive creation
        for _ in range(CALIBRATION_RUNS):
            for i, fn in enumerate((blocks, flash)):
                t0 = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]
