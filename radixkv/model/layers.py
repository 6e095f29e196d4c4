"""Building blocks of the Llama and Gemma families: RMSNorm (and Gemma's), rotary embeddings
(linear, llama3 and YaRN scaling), gated MLPs (SwiGLU, Gemma's GeGLU).

Numerics follow the Hugging Face reference so fp32 logits agree to ~1e-5: the norm is computed in
fp32 and cast back before the weight multiply; RoPE angles are ``position * inv_freq`` in fp32.

Without autograd (inference) the blocks skip work that only costs memory traffic, which on a
CPU in bf16 is a large share of a forward (the matmuls are ~4x faster than in fp32, the
elementwise passes are not): SwiGLU's activation and product run in place (bit-identical), and
RMSNorm of a half-precision input reduces in fp32 straight from the input and writes the
normalized rows once (:func:`rms_norm_half`; within one bf16 rounding of the reference).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixkv.model.linear import Linear


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim; the reduction runs in fp32."""

    def __init__(
        self, dim: int, eps: float, *, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        if in_dtype in _HALF and not torch.is_grad_enabled():
            return rms_norm_half(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(in_dtype)


_HALF = (torch.bfloat16, torch.float16)


def add_residual(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``x + alpha * y`` for a sublayer's output ``y`` on the residual stream ``x``: in place
    when autograd is off (the decoder layers own ``x``: the embedding's output or the previous
    layer's), a new tensor when autograd needs ``x`` kept."""
    if torch.is_grad_enabled():
        return x + alpha * y
    return x.add_(y, alpha=alpha)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (offset + weight)`` with ``offset`` 1 (its checkpoints
    store the scale as an offset from 1), all in fp32 and rounded once, as transformers
    computes it."""

    offset = 1.0

    def __init__(
        self, dim: int, eps: float, *, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.full((dim,), 1.0 - self.offset, device=device, dtype=dtype)
        )
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (self.offset + self.weight.float())).to(x.dtype)


class OlmoRMSNorm(GemmaRMSNorm):
    """OLMo's RMSNorm: ``x / rms(x) * weight`` with the weight multiplied in fp32 before the
    one rounding (Llama's RMSNorm rounds first, then multiplies)."""

    offset = 0.0


def rms_norm_half(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a bf16/fp16 ``x`` in three passes instead of seven: the sum of squares is
    reduced in fp32 directly from ``x`` (``vector_norm`` with an fp32 accumulator: no fp32 copy
    of ``x``), ``x * rsqrt`` is computed in fp32 and rounded once into the output, which is then
    scaled by ``weight`` in place. Same roundings as the reference (normalized value rounded to
    the input dtype, then times the weight); only the fp32 reduction order differs."""
    norm = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True, dtype=torch.float32)
    inv = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    out = torch.empty_like(x)
    torch.mul(x, inv, out=out)  # fp32 product (type promotion), one rounding on the write
    return out.mul_(weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """``[head_dim // 2]`` fp32 inverse frequencies, with ``linear``, ``llama3`` or ``yarn``
    scaling applied (``scaling`` as ModelConfig.rope_scaling holds it)."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "longrope":  # Phi-3: one factor per dim pair (the short ones: see config.py)
        return inv / torch.tensor(scaling["short_factor"], dtype=torch.float32, device="cpu")
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, factor, scaling)
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r}")
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # low_freq_factor and high_freq_factor interpolates smoothly between the two.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(
    inv: torch.Tensor, head_dim: int, theta: float, factor: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071), as Qwen2.5/Qwen3 and DeepSeek configs ask for it: dimensions
    that turn fewer than ``beta_slow`` times over the original context are interpolated (divided
    by ``factor``), those turning more than ``beta_fast`` times are kept, with a linear ramp over
    the dimensions in between."""
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return (inv / factor) * (1 - keep) + inv * keep


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN multiplies cos and sin by: the config's ``attention_factor``, else
    ``0.1 * ln(factor) + 1`` (or the ratio of that with ``mscale`` and with ``mscale_all_dim``,
    DeepSeek's form, when both are given); longrope's ``attention_factor`` (config.py works it
    out); 1.0 for every other rope type."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return float(scaling["attention_factor"])
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(float(m)) / mscale(float(m_all))
    return mscale(1.0)


class RotaryEmbedding:
    """Half-rotation RoPE (HF's ``rotate_half`` layout). The cos/sin table grows on demand.

    Deliberately not an ``nn.Module`` buffer: ``model.to(bfloat16)`` must not round the inverse
    frequencies. The table is fp32 and follows the device of the positions asked for.
    """

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        """``dim``: the dims of a head it rotates (head_dim, or its partial rotary share)."""
        self.inv_freq = rope_inv_freq(dim, theta, scaling)  # [dim/2] fp32, CPU
        self.attention_factor = rope_attention_factor(scaling)  # YaRN's; 1.0 otherwise
        # explicit CPU: the model may be built under a ``torch.device("meta")`` context
        self._cos = torch.empty(0, dim, device="cpu")
        self._sin = torch.empty(0, dim, device="cpu")

    def _grow(self, length: int, device: torch.device) -> None:
        size = max(length, 2 * self._cos.shape[0], 256)
        pos = torch.arange(size, dtype=torch.int64, device="cpu").float()
        freqs = pos.unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [size, D/2] fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self._cos, self._sin = cos.to(device), sin.to(device)

    def cos_sin(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, head_dim]`` fp32 for ``positions [T]``; ``max_pos`` bounds the table."""
        if max_pos >= self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(max_pos + 1, positions.device)
        return self._cos[positions], self._sin[positions]


class LayerTypeRope:
    """The RoPE tables of a model whose sliding-window layers have their own unscaled base
    (Gemma 3, OLMo 3: ``ModelConfig.local_rope_theta``); without one, every layer reads the
    same table."""

    def __init__(
        self, dim: int, theta: float, scaling: dict[str, Any] | None, local_theta: float | None
    ) -> None:
        self.full = RotaryEmbedding(dim, theta, scaling)
        self.local = None if local_theta is None else RotaryEmbedding(dim, local_theta, None)

    def tables(
        self, positions: torch.Tensor, max_pos: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """((cos, sin) of full layers, (cos, sin) of sliding layers), ``[T, dim]`` in ``dtype``
        (cast once for all layers, as apply_rope would cast them)."""
        cos, sin = self.full.cos_sin(positions, max_pos)
        full = (cos.to(dtype), sin.to(dtype))
        if self.local is None:
            return full, full
        cos, sin = self.local.cos_sin(positions, max_pos)
        return full, (cos.to(dtype), sin.to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated by ``cos``/``sin`` ``[T, R]`` (cast to x's dtype, as HF does):
    the first ``R`` dims of each head (all of them, or a partial rotary factor's share), the
    rest passed through."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos = cos.to(x.dtype).unsqueeze(1)
    sin = sin.to(x.dtype).unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# The gate activations of a gated MLP, by their Hugging Face names (hidden_act)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SwiGLU(nn.Module):
    """``down(act(gate(x)) * up(x))``, ``act`` SiLU (SwiGLU) or Gemma's tanh-approximated GELU
    (GeGLU); weight names match HF (gate_proj, up_proj, down_proj)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        *,
        device: torch.device | None,
        dtype: torch.dtype,
        act: str = "silu",
    ) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {ACTIVATIONS}")
        kw: dict[str, Any] = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = Linear(hidden, intermediate, **kw)
        self.up_proj = Linear(hidden, intermediate, **kw)
        self.down_proj = Linear(intermediate, hidden, **kw)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_proj, self.up_proj, self.down_proj, self.act)


def swiglu(
    x: torch.Tensor, gate: nn.Module, up: nn.Module, down: nn.Module, act: str = "silu"
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))``, for SwiGLU and modules that name its layers otherwise
    (Mixtral's experts); ``act`` one of ACTIVATIONS."""
    g = gate(x)
    if act != "silu":  # GELU has no in-place form; the product still is
        g = F.gelu(g, approximate="tanh")
        return down(g * up(x)) if torch.is_grad_enabled() else down(g.mul_(up(x)))
    if torch.is_grad_enabled():  # autograd needs the intermediate values kept
        return down(F.silu(g) * up(x))
    # in place: the same values, without two more [T, intermediate] buffers
    return down(F.silu(g, inplace=True).mul_(up(x)))
