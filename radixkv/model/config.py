"""ModelConfig: the shape and flags of a Llama-family causal LM, parsed from HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.model.errors import ModelLoadError

# HF architecture name -> family flags (qkv bias, q/k RMSNorm). Mistral and Llama share code.
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Refused with the reason: dynamic NTK rescales every position whenever a sequence grows past
# the original context, so a cached prefix's K/V would no longer be what a longer request needs.
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling re-rotates every cached token as a sequence grows, which a "
    "prefix cache cannot reuse; use a static type (yarn, linear) for long contexts",
}
# Optional YaRN settings taken over as given (rope_inv_freq and rope_attention_factor read them)
_YARN_OPTIONAL = (
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)


def parse_dtype(
    value: Any, file: str = "config.json", field_name: str = "torch_dtype"
) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ModelLoadError(file, field_name, f"unsupported dtype {value}")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(
            file, field_name, f"unsupported dtype {value!r} (use float32, bfloat16 or float16)"
        )
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """Validated on construction; every size is a positive int."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None or {"rope_type": "linear"|"llama3", "factor": ..., ...} (HF's keys)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {sorted(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], file: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict; errors name ``file`` and the field."""

        def req(name: str) -> Any:
            if name not in cfg:
                raise ModelLoadError(file, name, "missing required field")
            return cfg[name]

        def pos_int(name: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ModelLoadError(file, name, f"must be a positive integer, got {value!r}")
            return value

        archs = req("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ModelLoadError(file, "architectures", f"must be a non-empty list, got {archs!r}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                file,
                "architectures",
                f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}",
            )
        flags = ARCHITECTURES[arch]
        hidden = pos_int("hidden_size", req("hidden_size"))
        heads = pos_int("num_attention_heads", req("num_attention_heads"))
        kv_heads = pos_int("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads
        head_dim = pos_int("head_dim", head_dim)
        max_pos = pos_int("max_position_embeddings", cfg.get("max_position_embeddings", 4096))
        rope_theta, rope_scaling = _parse_rope(cfg, file, max_pos)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(
                file, "hidden_act", f"unsupported {cfg['hidden_act']!r} (silu only)"
            )
        dtype_value = cfg.get("torch_dtype", cfg.get("dtype", "float32")) or "float32"
        dtype_field = "torch_dtype" if "torch_dtype" in cfg else "dtype"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        # Sliding-window attention is not implemented: contexts are capped at the window instead,
        # where full attention is the same computation.
        window = cfg.get("sliding_window")
        if window and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
            max_pos = min(max_pos, pos_int("sliding_window", window))
        try:
            return cls(
                architecture=arch,
                vocab_size=pos_int("vocab_size", req("vocab_size")),
                hidden_size=hidden,
                intermediate_size=pos_int("intermediate_size", req("intermediate_size")),
                num_layers=pos_int("num_hidden_layers", req("num_hidden_layers")),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=max_pos,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=flags["qkv_bias"] or bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=flags["qk_norm"],
                dtype=parse_dtype(dtype_value, file, dtype_field),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except ValueError as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(file, None, str(exc)) from exc


def _parse_rope(
    cfg: dict[str, Any], file: str, max_pos: int
) -> tuple[float, dict[str, Any] | None]:
    """Read RoPE settings from either the classic (``rope_theta`` + ``rope_scaling``) or the
    newer (``rope_parameters``) config layout. ``max_pos``: the config's context length, YaRN's
    original context when the config leaves it out (as transformers reads it)."""
    params = cfg.get("rope_parameters")
    field_name = "rope_parameters"
    if params is None:
        params = cfg.get("rope_scaling")
        field_name = "rope_scaling"
    theta = cfg.get("rope_theta")
    if params is not None and not isinstance(params, dict):
        raise ModelLoadError(file, field_name, f"must be an object, got {params!r}")
    params = dict(params or {})
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in _ROPE_REFUSED:
        raise ModelLoadError(file, field_name, f"rope type {kind!r}: {_ROPE_REFUSED[kind]}")
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            file, field_name, f"unsupported rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return float(theta), None
    scaling: dict[str, Any] = {"rope_type": kind}
    need = ["factor"]
    if kind == "llama3":
        need += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    if kind == "yarn":
        old = params.get("original_max_position_embeddings") or max_pos
        scaling["original_max_position_embeddings"] = old
        if params.get("factor") is None:  # DeepSeek's form: the factor is the context ratio
            params["factor"] = max_pos / old
        scaling.update((k, params[k]) for k in _YARN_OPTIONAL if params.get(k) is not None)
    for key in need:
        if key not in params:
            raise ModelLoadError(file, f"{field_name}.{key}", f"missing for rope type {kind!r}")
        scaling[key] = params[key]
    for key, value in scaling.items():
        if key not in ("rope_type", "truncate") and (
            isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
        ):
            raise ModelLoadError(
                file, f"{field_name}.{key}", f"must be a positive number, got {value!r}"
            )
    return float(theta), scaling
