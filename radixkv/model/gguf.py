"""GGUF checkpoints (llama.cpp's single-file format): the model's config from the file's
metadata, and its tensors dequantized to float32 under the Hugging Face names the model
families use.

The ``gguf`` package reads the file memory-mapped; tensors are dequantized one at a time, in
row chunks (:data:`CHUNK_ROWS`), so the transient memory of a load is one tensor in float32
on top of the model's own weights. What llama.cpp's converter changed is undone: the rows of
a Llama-architecture model's Q and K projections were permuted (it rotates adjacent dims, the
HF layout halves), and metadata keys are llama.cpp's (``llama.embedding_length``, ...).

The tokenizer is rebuilt from the same metadata by :mod:`radixkv.model.gguf_tokenizer`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.hub import resolve_model_folder
from radixkv.model.layers import rope_inv_freq
from radixkv.model.packaged import packaged_model_path

# general.architecture -> the HF architecture radixkv computes it with, and whether llama.cpp's
# converter permuted the Q/K rows (its Llama converter does; Qwen's keep HF's layout, which
# llama.cpp runs as NEOX-style RoPE)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
# Tensor types dequantized at load (gguf.quants.dequantize), by GGMLQuantizationType name
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # fmt: skip
# Rows dequantized at a time: bounds the quantizer's temporaries, not the tensor
CHUNK_ROWS = 4096
# llama.cpp's per-block tensor names -> the HF module path under model.layers.N
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama 3.1+ files carry the RoPE scaling as per-frequency divisors (rope_freqs.weight) instead
# of metadata: the Llama 3 settings they are fitted against (factor varies by release)
_LLAMA3_FACTORS = (8.0, 16.0, 32.0, 4.0, 2.0)
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}  # fmt: skip
ROPE_FREQS = "rope_freqs.weight"


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file by its suffix (existing or not)."""
    return str(path).lower().endswith(".gguf")


def hf_name(name: str) -> str:
    """The HF parameter name of the GGUF tensor ``name`` (unknown names come back as they are,
    so the loader's 'unexpected tensor' error names them)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    return name


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: within each head, its converter interleaved the
    two halves of the rows (HF's rotate-half layout) into adjacent pairs (llama.cpp's RoPE);
    this puts them back. ``w``: ``[n_head * head_dim, ...]`` (a weight or a bias)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name, type name and the memory-mapped data."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # torch order: rows first
    data: np.ndarray  # memory-mapped; quantized types are rows of bytes
    qtype: Any  # gguf.GGMLQuantizationType


class GGUFCheckpoint:
    """A GGUF file opened memory-mapped: its metadata, the ModelConfig it describes and its
    tensors under HF names. Raises :class:`ModelLoadError` naming the file (and the key, tensor
    or architecture) for anything radixkv cannot serve."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or self.path.name.removesuffix(".gguf")
        if not self.path.is_file():
            raise ModelLoadError(str(self.path), None, "GGUF file not found")
        try:
            from gguf import GGUFReader
        except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
            raise ModelLoadError(
                str(self.path), None, "loading GGUF files needs the gguf package: pip install gguf"
            ) from None
        try:
            reader = GGUFReader(str(self.path), "r")
            # the metadata as plain Python: the reader's own per-value field objects (one
            # memory-mapped array per vocabulary string) cost more than the values, ~160 MB
            # for a 49k vocabulary, and would stay alive beside the weights being loaded
            self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        except (ValueError, OSError, KeyError) as exc:
            raise ModelLoadError(str(self.path), None, f"cannot read GGUF: {exc}") from exc
        self.arch = str(self.field("general.architecture", required=True))
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                str(self.path),
                "general.architecture",
                f"unsupported GGUF architecture {self.arch!r}; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}",
            )
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            type_name = t.tensor_type.name
            if type_name not in TENSOR_TYPES:
                raise ModelLoadError(
                    str(self.path),
                    t.name,
                    f"unsupported tensor type {type_name}; supported: {', '.join(TENSOR_TYPES)}",
                )
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = GGUFTensor(t.name, type_name, shape, t.data, t.tensor_type)

    # ------------------------------------------------------------------ metadata
    def field(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """The metadata value at ``key`` as Python (str, int, float, bool, list), else
        ``default`` (ModelLoadError naming the key when ``required``)."""
        if key not in self.metadata:
            if required:
                raise ModelLoadError(str(self.path), key, "missing GGUF metadata key")
            return default
        return self.metadata[key]

    def arch_field(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        """``field("<architecture>.<key>")``."""
        return self.field(f"{self.arch}.{key}", default, required=required)

    @cached_property
    def config(self) -> ModelConfig:
        """The ModelConfig the metadata describes (float32: the weights are dequantized)."""
        hf_arch, _ = ARCHITECTURES[self.arch]
        hidden = int(self.arch_field("embedding_length", required=True))
        heads = int(self.arch_field("attention.head_count", required=True))
        embd = self.tensors.get("token_embd.weight")
        vocab = self.arch_field("vocab_size") or len(self.field("tokenizer.ggml.tokens") or ())
        if not vocab and embd is not None:
            vocab = embd.shape[0]
        rope_theta = float(self.arch_field("rope.freq_base", 10000.0))
        head_dim = int(self.arch_field("attention.key_length") or hidden // heads)
        max_pos = int(self.arch_field("context_length", required=True))
        eos = self.field("tokenizer.ggml.eos_token_id")
        cfg: dict[str, Any] = {
            "architectures": [hf_arch],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length", required=True)),
            "num_hidden_layers": int(self.arch_field("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "max_position_embeddings": max_pos,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": rope_theta,
            "rope_scaling": self._rope_scaling(rope_theta, head_dim, max_pos),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_output.bias" in self.tensors,
            "torch_dtype": "float32",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": None if eos is None else int(eos),
        }
        return ModelConfig.from_hf(cfg, file=str(self.path))

    def _rope_scaling(self, theta: float, head_dim: int, max_pos: int) -> dict[str, Any] | None:
        kind = self.arch_field("rope.scaling.type")
        factor = self.arch_field("rope.scaling.factor") or self.arch_field("rope.scale_linear")
        if kind is None and factor is not None and factor != 1.0:
            kind = "linear"
        if ROPE_FREQS in self.tensors and kind in (None, "none"):
            return self._llama3_scaling(theta, head_dim)
        if kind in (None, "none"):
            return None
        key = f"{self.arch}.rope.scaling.type"
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(factor or 1.0)}
        if kind == "yarn":
            out = {
                "rope_type": "yarn",
                "factor": float(factor or 1.0),
                "original_max_position_embeddings": int(
                    self.arch_field("rope.scaling.original_context_length") or max_pos
                ),
            }
            for gguf_key, hf_key in (
                ("yarn_beta_fast", "beta_fast"),
                ("yarn_beta_slow", "beta_slow"),
            ):
                value = self.arch_field(f"rope.scaling.{gguf_key}")
                if value:
                    out[hf_key] = float(value)
            return out
        raise ModelLoadError(str(self.path), key, f"unsupported RoPE scaling type {kind!r}")

    def _llama3_scaling(self, theta: float, head_dim: int) -> dict[str, Any]:
        """Llama 3's RoPE settings whose per-frequency divisors equal ``rope_freqs.weight``."""
        divisors = self._dequantize(self.tensors[ROPE_FREQS]).flatten()
        plain = rope_inv_freq(head_dim, theta, None)
        for factor in _LLAMA3_FACTORS:
            scaling = {"rope_type": "llama3", "factor": factor, **_LLAMA3_FIXED}
            want = plain / rope_inv_freq(head_dim, theta, scaling)
            if want.shape == divisors.shape and torch.allclose(want, divisors, rtol=1e-3):
                return scaling
        raise ModelLoadError(
            str(self.path),
            ROPE_FREQS,
            "per-frequency RoPE factors that match no Llama 3 setting (factor "
            f"{'/'.join(f'{f:g}' for f in _LLAMA3_FACTORS)}, low 1, high 4, context 8192)",
        )

    # ------------------------------------------------------------------ tensors
    def weights(self, config: ModelConfig) -> Iterator[tuple[Path, str, torch.Tensor]]:
        """(file, HF name, float32 tensor) for every tensor, one at a time, Q/K rows put back
        in HF's order where the converter permuted them; ``rope_freqs.weight`` is left out
        (read into ``config.rope_scaling``)."""
        _, permuted = ARCHITECTURES[self.arch]
        for t in self.tensors.values():
            if t.name == ROPE_FREQS:
                continue
            key = hf_name(t.name)
            tensor = self._dequantize(t)
            if permuted and key.endswith(("q_proj.weight", "q_proj.bias")):
                tensor = unpermute_rows(tensor, config.num_heads)
            elif permuted and key.endswith(("k_proj.weight", "k_proj.bias")):
                tensor = unpermute_rows(tensor, config.num_kv_heads)
            yield self.path, key, tensor

    def _dequantize(self, t: GGUFTensor) -> torch.Tensor:
        """``t`` as a float32 tensor of its shape, dequantized ``CHUNK_ROWS`` rows at a time."""
        from gguf.quants import dequantize

        out = torch.empty(t.shape, dtype=torch.float32)
        data = t.data
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        flat = out.numpy().reshape(rows.shape[0], -1)  # the same memory: filled in place
        try:
            for start in range(0, rows.shape[0], CHUNK_ROWS):
                part = dequantize(rows[start : start + CHUNK_ROWS], t.qtype)
                flat[start : start + part.shape[0]] = part
        except (ValueError, NotImplementedError, AssertionError) as exc:
            raise ModelLoadError(
                str(self.path), t.name, f"cannot dequantize {t.type_name}: {exc}"
            ) from exc
        return out

    def nbytes(self) -> int:
        """Bytes of the tensors as stored in the file."""
        return sum(int(t.data.nbytes) for t in self.tensors.values())


def open_gguf(
    name_or_path: str | Path, *, gguf_file: str | None = None, revision: str | None = None
) -> GGUFCheckpoint | None:
    """The GGUF checkpoint ``name_or_path`` names, or None when it names none: a packaged
    model's short name (:mod:`radixkv.model.packaged`), a ``*.gguf`` file, or a folder or Hub
    repo id (fetching only that file, at ``revision``) holding ``gguf_file``."""
    name = str(name_or_path)
    packaged = packaged_model_path(name) if gguf_file is None else None
    if packaged is not None:
        if revision is not None:
            raise ModelLoadError(name, None, "revision applies to Hugging Face repo ids only")
        return GGUFCheckpoint(packaged, name)
    if gguf_file is not None:
        source = resolve_model_folder(name_or_path, revision=revision, files=(gguf_file,))
        path = source.folder / gguf_file
        if not path.is_file():
            raise ModelLoadError(str(path), None, f"no GGUF file {gguf_file!r} in {name}")
        return GGUFCheckpoint(path, source.name)
    if is_gguf_file(name):
        if revision is not None:
            raise ModelLoadError(name, None, "revision applies to Hugging Face repo ids only")
        return GGUFCheckpoint(Path(name).expanduser())
    return None
