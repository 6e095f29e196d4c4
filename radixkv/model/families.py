"""The model families by name: which module computes which Hugging Face architectures.

A family is one module (``llama.py``, ``gemma.py``, ...: a :class:`~radixkv.model.causal_lm.CausalLM`
subclass) plus one row of :data:`MODEL_FAMILIES`: the class (``"module:Class"``, imported when a
model of the family is built), the ``architectures`` names of config.json it serves with their
flags, and the few config.json readings that differ by family (the gate activation, the default
of ``tie_word_embeddings``, where the norm epsilon is kept, and a ``config_fields`` function for
fields only the family has). :meth:`ModelConfig.from_hf <radixkv.model.config.ModelConfig.from_hf>`
and :func:`radixkv.model.loader.model_class` read this table; nothing else names a family. A
family that needs a ModelConfig field no family has yet adds that field to config.py too.

Torch-free: listing the supported architectures imports no model code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from radixkv.name_table import NameTable, import_target

# (config.json as a dict, its file name for errors, the architecture) -> ModelConfig keyword
# arguments of the family's own fields; raises ModelLoadError naming the field
ConfigFields = Callable[[dict[str, Any], str, str], dict[str, Any]]


class ArchFlags(NamedTuple):
    """What one architecture of a family switches on: a bias on the q/k/v projections, and
    RMSNorm of q and k per head (config.json may add a bias: ``attention_bias``)."""

    qkv_bias: bool = False
    qk_norm: bool = False


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """One row of :data:`MODEL_FAMILIES` (see the module docstring)."""

    model: str  # "package.module:Class", the CausalLM subclass (loader.model_class imports it)
    architectures: Mapping[str, ArchFlags]  # config.json "architectures"[0] -> flags
    activation: str = "silu"  # the MLP gate's (hidden_act's default and the one accepted)
    tie_word_embeddings: bool = False  # transformers' default when config.json leaves it out
    norm_eps_field: str = "rms_norm_eps"  # the config.json field of the norms' epsilon
    norm_eps_default: float = 1e-6
    config_fields: str | None = None  # "module:function", a ConfigFields; None: no own fields

    def own_config_fields(self, cfg: dict[str, Any], file: str, arch: str) -> dict[str, Any]:
        """ModelConfig keyword arguments of the family's own config.json fields (none when it
        has no ``config_fields`` function)."""
        if self.config_fields is None:
            return {}
        read: ConfigFields = import_target(self.config_fields)
        return read(cfg, file, arch)


_PLAIN = ArchFlags()

MODEL_FAMILIES: NameTable[ModelFamily] = NameTable(
    "model family",
    {
        # Llama, Mistral, Ministral, Qwen2/3, Granite, Phi-3, SmolLM3 and the MoE Mixtral,
        # Qwen2-MoE, Qwen3-MoE, GraniteMoE: one module with flags
        "llama": ModelFamily(
            "radixkv.model.llama:LlamaForCausalLM",
            {
                "LlamaForCausalLM": _PLAIN,
                "MistralForCausalLM": _PLAIN,
                "Qwen2ForCausalLM": ArchFlags(qkv_bias=True),
                "Qwen3ForCausalLM": ArchFlags(qk_norm=True),
                "MixtralForCausalLM": _PLAIN,
                "Qwen2MoeForCausalLM": ArchFlags(qkv_bias=True),
                "Qwen3MoeForCausalLM": ArchFlags(qk_norm=True),
                "GraniteForCausalLM": _PLAIN,
                "GraniteMoeForCausalLM": _PLAIN,
                "Phi3ForCausalLM": _PLAIN,
                "MinistralForCausalLM": _PLAIN,
                "SmolLM3ForCausalLM": _PLAIN,
            },
        ),
        # Gemma's RMSNorm, GeGLU, embeddings scaled by sqrt(hidden); from Gemma 2 on, norms
        # after attention and MLP too, and sliding windows
        "gemma": ModelFamily(
            "radixkv.model.gemma:GemmaForCausalLM",
            {
                "GemmaForCausalLM": _PLAIN,
                "Gemma2ForCausalLM": _PLAIN,
                "Gemma3ForCausalLM": ArchFlags(qk_norm=True),
            },
            activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            config_fields="radixkv.model.gemma:gemma_config_fields",
        ),
        # norms after each sublayer instead of before it, q/k normed over the whole projection;
        # OLMo 3 adds sliding windows on three layers of four
        "olmo": ModelFamily(
            "radixkv.model.olmo:OlmoForCausalLM",
            {
                "Olmo2ForCausalLM": ArchFlags(qk_norm=True),
                "Olmo3ForCausalLM": ArchFlags(qk_norm=True),
            },
        ),
        # LayerNorm, parallel attention and MLP, RoPE on adjacent dim pairs, logits times
        # logit_scale; Cohere 2 adds windows and NoPE full layers (qk norm: use_qk_norm)
        "cohere": ModelFamily(
            "radixkv.model.cohere:CohereForCausalLM",
            {"CohereForCausalLM": _PLAIN, "Cohere2ForCausalLM": _PLAIN},
            tie_word_embeddings=True,
            norm_eps_field="layer_norm_eps",
            norm_eps_default=1e-5,
            config_fields="radixkv.model.cohere:cohere_config_fields",
        ),
    },
)


def architectures() -> dict[str, str]:
    """Every supported architecture -> the name of its family (ValueError if two families
    claim one)."""
    out: dict[str, str] = {}
    for name in MODEL_FAMILIES:
        for arch in MODEL_FAMILIES.get(name).architectures:
            if arch in out:
                raise ValueError(f"architecture {arch!r} is in the {out[arch]} and {name} families")
            out[arch] = name
    return out


def family_of(arch: str) -> ModelFamily:
    """The family serving the architecture ``arch``; ValueError listing the supported ones."""
    name = architectures().get(arch)
    if name is None:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(architectures()))}"
        )
    return MODEL_FAMILIES.get(name)
