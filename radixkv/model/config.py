"""ModelConfig: the shape and flags of a Llama-family causal LM, parsed from HF config.json;
MoEConfig: its mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.model.errors import ModelLoadError
from radixkv.model.families import family_of

log = logging.getLogger(__name__)

# Multimodal checkpoints served as their text model (the vision tower's weights are skipped):
# architecture -> the text model's, whose config is the checkpoint's text_config
TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# transformers' Gemma3TextConfig defaults, which the Hub's multimodal Gemma 3 configs leave out
# of their text_config (google/gemma-3-4b-it lists only sizes, rope_scaling, sliding_window)
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip
# Granite's four scalars (ModelConfig fields of the same names) and transformers' defaults
GRANITE_SCALARS = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": 1.0,
    "logits_scaling": 1.0,
}
# The mixture-of-experts architectures and the weight-name style of their experts (MoEConfig)
MOE_STYLES: dict[str, str] = {
    "MixtralForCausalLM": "mixtral",
    "GraniteMoeForCausalLM": "granite",
    "Qwen2MoeForCausalLM": "qwen",
    "Qwen3MoeForCausalLM": "qwen",
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

_FULL, _SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (_FULL, _SLIDING)  # ModelConfig.layer_types entries (HF's names)

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
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
class MoEConfig:
    """Sparse mixture-of-experts feed-forward layers; validated on construction.

    A sparse layer routes each token to its ``top_k`` most probable experts (softmax over the
    router's logits, in fp32) and sums the experts' SwiGLU outputs weighted by those
    probabilities, renormalized to sum to 1 when ``norm_topk_prob``.
    """

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    expert_size: int  # each expert's SwiGLU width (moe_intermediate_size; Mixtral's intermediate)
    norm_topk_prob: bool = True  # Mixtral always; Qwen's config says (transformers' default off)
    shared_expert_size: int = 0  # Qwen2-MoE's always-on expert, sigmoid-gated (0: none)
    sparse_step: int = 1  # every sparse_step-th layer is sparse (decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # dense anyway (mlp_only_layers; width intermediate_size)
    # checkpoint names of the expert weights: "qwen" = mlp.experts.N.{gate,up,down}_proj,
    # "mixtral" = block_sparse_moe.experts.N.{w1,w3,w2} (router: mlp.gate / block_sparse_moe.gate);
    # "granite": Mixtral's layout in memory, its experts fused in the checkpoint (loader.unfuse)
    style: str = "qwen"

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_size", "sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})"
            )
        s = self.shared_expert_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"MoEConfig.shared_expert_size must be an int >= 0, got {s!r}")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                   for i in self.dense_layers):  # fmt: skip
            raise ValueError(
                f"MoEConfig.dense_layers must be layer indices, got {self.dense_layers!r}"
            )
        if self.style not in ("qwen", "mixtral", "granite"):
            raise ValueError(
                f"MoEConfig.style must be 'qwen', 'mixtral' or 'granite', got {self.style!r}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) has experts rather than a dense MLP."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


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
    moe: MoEConfig | None = None  # the experts of a mixture-of-experts architecture
    # Granite's scalars (1.0 / None elsewhere): embeddings times embedding_multiplier, each
    # sublayer's output times residual_multiplier before its residual add, attention scores
    # times attention_multiplier instead of 1/sqrt(head_dim) (None), logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Sliding-window attention: layer i attends only its last ``sliding_window`` keys when
    # layer_types[i] == "sliding_attention" (HF's names); empty layer_types: every layer full
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: "gelu_pytorch_tanh")
    # Gemma 2's tanh soft caps: attention scores -> cap * tanh(score / cap) (None: off), and
    # the same on the final logits
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the RoPE base of sliding_attention layers, unscaled (rope_theta and rope_scaling
    # are the full layers'); None: every layer uses rope_theta / rope_scaling
    local_rope_theta: float | None = None
    # RoPE rotates the first partial_rotary_factor of each head's dims (Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3's every 4th: "NoPE")

    def __post_init__(self) -> None:
        family_of(self.architecture)  # ValueError listing the supported ones
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
        if self.moe is None and self.architecture in MOE_STYLES:
            raise ValueError(f"ModelConfig: {self.architecture} needs an MoEConfig (moe=)")
        if self.moe is not None and self.architecture not in MOE_STYLES:
            raise ValueError(f"ModelConfig: {self.architecture} takes no MoEConfig (moe=None)")
        for name in GRANITE_SCALARS:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_layers} layers"
                )
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise ValueError(
                    f"ModelConfig.layer_types: unknown type {bad[0]!r}; use one of {LAYER_TYPES}"
                )
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"ModelConfig.hidden_act: unsupported {self.hidden_act!r}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(
                f"ModelConfig.nope_layers must be layer indices, got {self.nope_layers}"
            )
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1], got {f!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"ModelConfig: partial_rotary_factor {f} leaves {self.rotary_dim} of "
                f"{self.head_dim} dims to rotate (must be even and positive)"
            )
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int, got {w!r}")
        if w is None and "sliding_attention" in self.layer_types:
            raise ValueError("ModelConfig: sliding_attention layers need a sliding_window")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens (0: full attention); empty when no layer has
        one (what the attention backends take as ``layer_windows``)."""
        if self.sliding_window is None or "sliding_attention" not in self.layer_types:
            return ()
        return tuple(self.sliding_window if t == "sliding_attention" else 0
                     for t in self.layer_types)  # fmt: skip

    @property
    def active_intermediate_size(self) -> float:
        """SwiGLU width a token runs through per layer, averaged over the layers: the dense
        width, or for a sparse layer ``top_k`` experts plus the shared one (what a token costs
        in multiply-adds, not what the model stores)."""
        moe = self.moe
        if moe is None:
            return float(self.intermediate_size)
        return self._mean_width(moe.top_k * moe.expert_size + moe.shared_expert_size)

    @property
    def stored_intermediate_size(self) -> float:
        """SwiGLU width a layer stores, averaged over the layers: the dense width, or for a
        sparse layer every expert plus the shared one."""
        moe = self.moe
        if moe is None:
            return float(self.intermediate_size)
        return self._mean_width(moe.num_experts * moe.expert_size + moe.shared_expert_size)

    def _mean_width(self, sparse_width: int) -> float:
        """Mean over the layers of ``sparse_width`` (sparse layers) and the dense width."""
        assert self.moe is not None
        sparse = sum(self.moe.is_sparse(i) for i in range(self.num_layers))
        dense = self.num_layers - sparse
        return (sparse * sparse_width + dense * self.intermediate_size) / self.num_layers

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
        if arch in TEXT_OF_MULTIMODAL:
            text = _text_config(cfg, file, arch)
            try:
                return cls.from_hf(text, file)
            except ModelLoadError as exc:  # name the field where it is: inside text_config
                if exc.field is None or exc.field in ("torch_dtype", "dtype", "eos_token_id"):
                    raise
                raise ModelLoadError(file, f"text_config.{exc.field}", exc.problem) from exc
        try:
            family = family_of(arch)
        except ValueError as exc:
            raise ModelLoadError(file, "architectures", str(exc)) from None
        flags = family.architectures[arch]
        hidden = pos_int("hidden_size", req("hidden_size"))
        heads = pos_int("num_attention_heads", req("num_attention_heads"))
        kv_heads = pos_int("num_key_value_heads", cfg.get("num_key_value_heads") or heads)
        head_dim = cfg.get("head_dim") or hidden // heads
        if arch == "Cohere2ForCausalLM":  # transformers derives it whatever the config says
            head_dim = hidden // heads
        head_dim = pos_int("head_dim", head_dim)
        max_pos = pos_int("max_position_embeddings", cfg.get("max_position_embeddings", 4096))
        local_theta = None
        if arch in _TYPED_ROPE:
            rope_theta, rope_scaling, local_theta = _parse_typed_rope(cfg, file, max_pos, arch)
        else:
            rope_theta, rope_scaling = _parse_rope(cfg, file, max_pos, head_dim)
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            max_pos = min(max_pos, rope_scaling["original_max_position_embeddings"])
            log.info("%s: longrope served up to its original context, %d tokens: %s",
                     file, max_pos, _LONGROPE_CAP)  # fmt: skip
        act_field, act = _activation(cfg, arch, family.activation)
        if act != family.activation:
            raise ModelLoadError(file, act_field, f"unsupported {act!r} for {arch}")
        dtype_value = cfg.get("torch_dtype", cfg.get("dtype", "float32")) or "float32"
        dtype_field = "torch_dtype" if "torch_dtype" in cfg else "dtype"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = pos_int("num_hidden_layers", req("num_hidden_layers"))
        nope = _parse_nope(cfg, file, num_layers) if arch == "SmolLM3ForCausalLM" else ()
        window, layer_types = _parse_windows(cfg, file, arch, num_layers, pos_int, nope)
        if arch == "Cohere2ForCausalLM":  # its full-attention layers have no RoPE
            nope = tuple(i for i, t in enumerate(layer_types) if t == _FULL)
        try:
            return cls(
                architecture=arch,
                vocab_size=pos_int("vocab_size", req("vocab_size")),
                hidden_size=hidden,
                intermediate_size=pos_int("intermediate_size", req("intermediate_size")),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=max_pos,
                rms_norm_eps=float(cfg.get(family.norm_eps_field, family.norm_eps_default)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                # transformers' default: the family's (tied for Gemma and Cohere)
                tie_word_embeddings=bool(
                    cfg.get("tie_word_embeddings", family.tie_word_embeddings)
                ),
                qkv_bias=flags.qkv_bias or bool(cfg.get("attention_bias", False)),
                o_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=flags.qk_norm
                or (arch == "CohereForCausalLM" and bool(cfg.get("use_qk_norm"))),
                dtype=parse_dtype(dtype_value, file, dtype_field),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                moe=_parse_moe(cfg, file, arch, pos_int) if arch in MOE_STYLES else None,
                **(_parse_granite(cfg, file) if arch.startswith("Granite") else {}),
                sliding_window=window,
                layer_types=layer_types,
                hidden_act=act,
                local_rope_theta=local_theta,
                partial_rotary_factor=_partial_rotary(cfg, file),
                nope_layers=nope,
                **family.own_config_fields(cfg, file, arch),
            )
        except ValueError as exc:
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(file, None, str(exc)) from exc


def _parse_rope(
    cfg: dict[str, Any], file: str, max_pos: int, head_dim: int | None = None
) -> tuple[float, dict[str, Any] | None]:
    """Read RoPE settings from either the classic (``rope_theta`` + ``rope_scaling``) or the
    newer (``rope_parameters``) config layout. ``max_pos``: the config's context length, YaRN's
    original context when the config leaves it out (as transformers reads it); ``head_dim``:
    for longrope's per-dimension factors."""
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
    if kind == "longrope":
        return float(theta), _parse_longrope(cfg, params, file, field_name, max_pos, head_dim)
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


# Why longrope models are served up to their original context only
_LONGROPE_CAP = (
    "transformers switches every position of a sequence to the long factors once it grows past "
    "the original context, re-rotating tokens a prefix cache holds"
)


def _parse_longrope(
    cfg: dict[str, Any], params: dict[str, Any], file: str, field_name: str, max_pos: int,
    head_dim: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Phi-3's LongRoPE as radixkv serves it: the short factors (the only ones transformers
    uses up to ``original_max_position_embeddings``, where the context is capped) and the
    attention factor, from the configured context over the original one."""
    old = params.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if isinstance(old, bool) or not isinstance(old, int) or old <= 0:
        raise ModelLoadError(
            file, "original_max_position_embeddings", f"must be a positive int, got {old!r}"
        )
    short = params.get("short_factor")
    half = None if head_dim is None else int(head_dim * _partial_rotary(cfg, file)) // 2
    if (
        not isinstance(short, list)
        or not short
        or (half is not None and len(short) != half)
        or (
            not all(isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in short)
        )
    ):
        raise ModelLoadError(
            file, f"{field_name}.short_factor",
            f"must list {half or 'the'} positive factors, one per rotated dim pair",
        )  # fmt: skip
    factor = params.get("factor") or max_pos / old
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    if isinstance(attention, bool) or not isinstance(attention, int | float) or attention <= 0:
        raise ModelLoadError(
            file, f"{field_name}.attention_factor", f"must be positive, got {attention!r}"
        )
    return {
        "rope_type": "longrope",
        "short_factor": tuple(float(x) for x in short),
        "attention_factor": float(attention),
        "original_max_position_embeddings": old,
    }


def _partial_rotary(cfg: dict[str, Any], file: str) -> float:
    """``partial_rotary_factor`` at the top of the config or in ``rope_parameters``."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    f = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    f = 1.0 if f is None else f
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
        raise ModelLoadError(file, "partial_rotary_factor", f"must be in (0, 1], got {f!r}")
    return float(f)


def _text_config(cfg: dict[str, Any], file: str, arch: str) -> dict[str, Any]:
    """The text model's config.json of a multimodal checkpoint: its ``text_config`` over
    transformers' defaults, with the checkpoint's dtype and special token ids."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(file, "text_config", f"must be an object for {arch}, got {text!r}")
    out = {**_GEMMA3_TEXT_DEFAULTS, **text, "architectures": [TEXT_OF_MULTIMODAL[arch]]}
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def _parse_nope(cfg: dict[str, Any], file: str, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` lists 1 (RoPE) or 0 (none) per
    layer; left out, every ``no_rope_layer_interval``-th layer has none (transformers')."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval", 4)
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ModelLoadError(file, "no_rope_layer_interval", f"must be > 0, got {every!r}")
        flags = [int((i + 1) % every != 0) for i in range(num_layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) for f in flags)
    ):
        raise ModelLoadError(
            file, "no_rope_layers", f"must list 0 or 1 for each of {num_layers} layers"
        )
    return tuple(i for i, f in enumerate(flags) if not f)


def _parse_windows(
    cfg: dict[str, Any], file: str, arch: str, num_layers: int, pos_int: Any,
    nope: tuple[int, ...] = (),
) -> tuple[int | None, tuple[str, ...]]:  # fmt: skip
    """``(sliding_window, layer_types)`` as transformers reads them for ``arch``: Mistral and
    Mixtral window every layer when ``sliding_window`` is set, Qwen3-MoE when
    ``use_sliding_window`` is on too; Qwen2/Qwen3 (and Qwen2-MoE) follow ``use_sliding_window``
    and the config's ``layer_types``, else window the layers from ``max_window_layers`` on
    (Qwen2-MoE: every other layer below it); Ministral follows its ``layer_types`` (else
    every layer); SmolLM3 windows its NoPE layers (``nope``) when ``use_sliding_window``;
    Llama and Granite have no windows."""
    window = cfg.get("sliding_window")
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Olmo3ForCausalLM", "Cohere2ForCausalLM"):
        if window is None:
            raise ModelLoadError(file, "sliding_window", f"missing for {arch}")
        window = pos_int("sliding_window", window)
        types = cfg.get("layer_types")
        if types is None:  # Gemma 2: every other layer; Gemma 3: all but every 6th; OLMo 3: 4th
            period = {"Gemma2ForCausalLM": 2, "Olmo3ForCausalLM": 4}.get(arch)
            if arch == "Cohere2ForCausalLM":  # (Cohere 2: every 4th full, unless it says)
                period = cfg.get("sliding_window_pattern", 4)
            period = period or cfg.get("sliding_window_pattern", 6)
            period = pos_int("sliding_window_pattern", period)
            types = [_SLIDING if (i + 1) % period else _FULL for i in range(num_layers)]
        return window, _check_layer_types(types, file, num_layers)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                "MinistralForCausalLM"):  # fmt: skip
        on = window is not None
    elif arch.startswith(("Qwen2", "Qwen3", "SmolLM3")):
        on = bool(cfg.get("use_sliding_window", False)) and window is not None
    else:
        on = False
    if not on:
        return None, ()
    window = pos_int("sliding_window", window)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                "Qwen3MoeForCausalLM"):  # fmt: skip
        return window, ("sliding_attention",) * num_layers
    types = cfg.get("layer_types")
    if arch == "MinistralForCausalLM" and types is None:
        types = [_SLIDING] * num_layers
    if arch == "SmolLM3ForCausalLM" and types is None:
        types = [_SLIDING if i in nope else _FULL for i in range(num_layers)]
    if types is None:
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ModelLoadError(file, "max_window_layers", f"must be an int >= 0, got {first!r}")
        if arch == "Qwen2MoeForCausalLM":
            types = [_SLIDING if i % 2 == 0 and i < first else _FULL for i in range(num_layers)]
        else:
            types = [_SLIDING if i >= first else _FULL for i in range(num_layers)]
    return window, _check_layer_types(types, file, num_layers)


def _check_layer_types(types: Any, file: str, num_layers: int) -> tuple[str, ...]:
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in LAYER_TYPES for t in types)
    ):
        raise ModelLoadError(
            file, "layer_types", f"must list {LAYER_TYPES} for each of the {num_layers} layers"
        )
    return tuple(types)


def _activation(cfg: dict[str, Any], arch: str, default: str) -> tuple[str, str]:
    """``(field, activation)`` of the MLP's gate as transformers reads it (``default``: the
    family's): Gemma 2 and 3 from ``hidden_activation``, the others from ``hidden_act``
    (Gemma 1's legacy "gelu" means the tanh approximation, as transformers reads it)."""
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return "hidden_activation", cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    act = cfg.get("hidden_act") or default
    if arch == "GemmaForCausalLM" and act == "gelu":
        act = "gelu_pytorch_tanh"
    return "hidden_act", act


# Per-layer-type RoPE (Gemma 3, OLMo 3): transformers' default bases of full and sliding layers
# and the classic-layout field holding the sliding one (None: the default, as transformers
# reads an OLMo 3 config without rope_parameters)
_TYPED_ROPE: dict[str, tuple[float, float, str | None]] = {
    "Gemma3ForCausalLM": (1_000_000.0, 10_000.0, "rope_local_base_freq"),
    "Olmo3ForCausalLM": (500_000.0, 500_000.0, None),
}


def _parse_typed_rope(
    cfg: dict[str, Any], file: str, max_pos: int, arch: str
) -> tuple[float, dict[str, Any] | None, float]:
    """The two RoPEs of Gemma 3 and OLMo 3: ``(theta, scaling)`` of the full layers and the
    base of the sliding ones, from the classic layout (``rope_theta``, ``rope_scaling``, and
    Gemma's ``rope_local_base_freq``) or the newer per-layer-type ``rope_parameters``."""
    full_default, local_default, local_field = _TYPED_ROPE[arch]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and (_FULL in params or _SLIDING in params):
        full = params.get(_FULL) or {}
        local = params.get(_SLIDING) or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise ModelLoadError(file, "rope_parameters", "per-layer-type entries must be objects")
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ModelLoadError(
                file, f"rope_parameters.{_SLIDING}.rope_type",
                f"only unscaled RoPE on sliding layers is supported, got {kind!r}",
            )  # fmt: skip
        theta, scaling = _parse_rope(
            {"rope_parameters": {"rope_theta": full_default, **full}}, file, max_pos
        )
        local_theta = local.get("rope_theta", local_default)
    else:
        theta, scaling = _parse_rope({"rope_theta": full_default, **cfg}, file, max_pos)
        local_theta = cfg.get(local_field, local_default) if local_field else local_default
    if (
        isinstance(local_theta, bool)
        or not isinstance(local_theta, int | float)
        or local_theta <= 0
    ):
        raise ModelLoadError(
            file, local_field or f"rope_parameters.{_SLIDING}.rope_theta",
            f"must be positive, got {local_theta!r}",
        )  # fmt: skip
    return theta, scaling, float(local_theta)


def _parse_moe(cfg: dict[str, Any], file: str, arch: str, pos_int: Any) -> MoEConfig:
    """The MoEConfig of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json (fields as transformers
    names them; Qwen3-MoE's expert count appears as ``num_experts`` or ``num_local_experts``)."""
    style = MOE_STYLES[arch]
    key = next((k for k in ("num_experts", "num_local_experts") if k in cfg), "num_experts")
    if key not in cfg:
        raise ModelLoadError(file, "num_local_experts" if style != "qwen" else key, "missing")
    experts = pos_int(key, cfg[key])
    if "num_experts_per_tok" not in cfg:
        raise ModelLoadError(file, "num_experts_per_tok", "missing required field")
    top_k = pos_int("num_experts_per_tok", cfg["num_experts_per_tok"])
    if top_k > experts:
        raise ModelLoadError(
            file, "num_experts_per_tok", f"{top_k} exceeds the {experts} experts ({key})"
        )
    if style != "qwen":  # Mixtral, GraniteMoE: every layer sparse, experts intermediate_size wide
        width = pos_int("intermediate_size", cfg.get("intermediate_size"))
        return MoEConfig(experts, top_k, width, style=style)
    if "moe_intermediate_size" not in cfg:
        raise ModelLoadError(file, "moe_intermediate_size", "missing required field")
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        if "shared_expert_intermediate_size" not in cfg:
            raise ModelLoadError(file, "shared_expert_intermediate_size", "missing required field")
        shared = cfg["shared_expert_intermediate_size"]
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ModelLoadError(
                file, "shared_expert_intermediate_size", f"must be an int >= 0, got {shared!r}"
            )
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in dense
    ):
        raise ModelLoadError(
            file, "mlp_only_layers", f"must be a list of layer indices, got {dense!r}"
        )
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        expert_size=pos_int("moe_intermediate_size", cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_size=shared,
        sparse_step=pos_int("decoder_sparse_step", cfg.get("decoder_sparse_step", 1)),
        dense_layers=tuple(dense),
        style=style,
    )


def _parse_granite(cfg: dict[str, Any], file: str) -> dict[str, float]:
    """Granite's scalars from its config.json (transformers' defaults where left out)."""
    out = {}
    for name, default in GRANITE_SCALARS.items():
        value = cfg.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(file, name, f"must be a positive number, got {value!r}")
        out[name] = float(value)
    return out
