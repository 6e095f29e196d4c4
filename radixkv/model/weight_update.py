"""New weights for a loaded model, in place: read and checked first, then copied in.

What reinforcement-learning rollouts and online fine-tuning need: the trainer produces new
weights every few minutes, and the serving model takes them without a restart. Two steps, so
that a bad checkpoint changes nothing and the slow part (reading files) can run while the
engine keeps generating:

* :func:`stage_weights` reads a Hugging Face checkpoint folder (safetensors, the names the
  loader reads) or takes a mapping of parameter names to tensors, and checks everything before
  anything changes: each name is a parameter of the model, each shape matches, a folder's
  config.json describes the same computation (architecture, sizes, RoPE, norms, biases; the
  dtype may differ: values are cast to the model's) and holds every weight. Tensors are cast to
  the model's dtype here, so a staged checkpoint is a second copy of the new weights in memory
  (a mapping's tensors already of the model's dtype and device are not copied).
  A mapping may replace only some parameters (e.g. the layers a trainer changed).
* :func:`apply_weights` copies the staged values into the parameters (in place: every module,
  the runner and LoRA layers keep their tensors) and packs the linear layers' oneDNN copies
  again (radixkv/onednn.py), so no request pays for it.

``StagedWeights.digest()`` is an xxh3-128 of every new tensor's name and bytes: with the
model's fingerprint it names the new weights exactly (a storage tier keys pages by it).
What the engine must do around it (KV computed under the old weights is never reused) is
``Engine.update_weights``'s business.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.hub import resolve_model_folder
from radixkv.model.linear import pack_linears
from radixkv.model.loader import (
    IGNORED_SUFFIXES,
    checkpoint_tensors,
    missing_weights_error,
    read_model_config,
)

__all__ = ["COMPUTE_FIELDS", "StagedWeights", "apply_weights", "stage_weights"]

# ModelConfig fields that decide what the model computes: a checkpoint must agree on all of
# them (the dtype is cast, the context length and special token ids do not change any KV)
COMPUTE_FIELDS = (
    "architecture",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "mlp_bias",
    "qk_norm",
    "moe",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "sliding_window",
    "layer_types",
    "hidden_act",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "local_rope_theta",
    "partial_rotary_factor",
    "nope_layers",
)

WeightSource = str | Path | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class StagedWeights:
    """New values for some or all parameters of a model, checked against it.

    ``tensors``: parameter name -> value in the parameter's dtype and shape, on its device or
    the CPU (a tied ``lm_head.weight`` counts as its embedding). ``complete``: every parameter
    gets a new value. ``source``: the folder, or ``"tensors"``."""

    tensors: dict[str, torch.Tensor]
    complete: bool
    source: str

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def digest(self) -> bytes:
        """xxh3-128 over the names, shapes, dtypes and bytes, in name order: the exact identity
        of what this update changes (a pass over the values, on the CPU)."""
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
            h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().data)
        return h.digest()


def stage_weights(model: nn.Module, config: ModelConfig, source: WeightSource) -> StagedWeights:
    """Read and check ``source`` against ``model`` (module docstring). Raises ModelLoadError
    (a folder: naming the file and field or tensor) or ValueError / TypeError (a mapping:
    naming the tensor) and changes nothing on the model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if isinstance(source, str | Path):
        folder = resolve_model_folder(source, what="weights").folder
        tensors = _read_folder(folder, config, params)
        label = str(folder)
    else:
        tensors = _take_tensors(source, params)
        label = "tensors"
    # a parameter object may sit under two names (tied embeddings): count objects
    covered = {id(params[name]) for name in tensors}
    complete = covered >= {id(p) for p in params.values()}
    return StagedWeights(tensors, complete, label)


def apply_weights(model: nn.Module, staged: StagedWeights) -> None:
    """Copy ``staged`` (from :func:`stage_weights` on this model) into the parameters, then
    re-pack the linear layers' oneDNN copies. The parameters keep their storage."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, value in staged.tensors.items():
            params[name].copy_(value)
    for m in model.modules():
        drop = getattr(m, "drop_packed", None)
        if drop is not None:  # a weight made under inference_mode has no version counter
            drop()
    pack_linears(model)


def _check(name: str, value: Any, params: dict[str, nn.Parameter]) -> torch.Tensor:
    """``value`` for parameter ``name``, cast to its dtype, on its device if already there
    (no copy then: the caller must not change it until the update is applied), else on the
    CPU. ValueError/TypeError naming the tensor and the problem."""
    if name not in params:
        raise ValueError(f"{name!r} is not a parameter of the model")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name!r} must be a torch.Tensor, got {type(value).__name__}")
    target = params[name]
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(
            f"{name!r} has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
        )
    if not value.is_floating_point():
        raise TypeError(f"{name!r} must be a floating-point tensor, got {value.dtype}")
    device = value.device if value.device == target.device else torch.device("cpu")
    return value.detach().to(device=device, dtype=target.dtype)


def _take_tensors(
    source: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    params: dict[str, nn.Parameter],
) -> dict[str, torch.Tensor]:
    items = source.items() if isinstance(source, Mapping) else source
    out: dict[str, torch.Tensor] = {}
    try:
        pairs = list(items)
    except TypeError:
        raise TypeError(
            "weights must be a checkpoint folder, a mapping of parameter names to tensors or "
            f"an iterable of (name, tensor) pairs, got {type(source).__name__}"
        ) from None
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"weights: item {i} must be a (name, tensor) pair, got {pair!r:.60}")
        name, value = pair
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name in out:
            raise ValueError(f"weights: {name!r} is given twice")
        try:
            out[name] = _check(name, value, params)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"weights: {exc}") from None
    if not out:
        raise ValueError("weights: no tensors given")
    return out


def _read_folder(
    folder: Path, config: ModelConfig, params: dict[str, nn.Parameter]
) -> dict[str, torch.Tensor]:
    new = read_model_config(folder)
    for f in COMPUTE_FIELDS:
        if getattr(new, f) != getattr(config, f):
            raise ModelLoadError(
                str(folder / "config.json"),
                f,
                f"{getattr(new, f)!r} differs from the running model's {getattr(config, f)!r}",
            )
    out: dict[str, torch.Tensor] = {}
    for path, key, value in checkpoint_tensors(folder, config):
        try:
            out[key] = _check(key, value, params)
        except (ValueError, TypeError) as exc:
            raise ModelLoadError(str(path), key, str(exc)) from None
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(params) - set(out) - tied)
    if missing:
        raise missing_weights_error(folder, missing)
    return out
