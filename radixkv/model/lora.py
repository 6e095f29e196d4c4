"""LoRA adapters: read a PEFT adapter folder, and add many adapters' deltas to one batch.

An adapter (a PEFT ``LoraConfig`` saved with ``save_pretrained``: ``adapter_config.json`` and
``adapter_model.safetensors``) adds ``scale * B @ A`` to some of the model's linear layers
(``q/k/v/o_proj``, ``gate/up/down_proj``). The base weights are never changed: a batch mixes
rows of the base model and of several adapters, and each linear layer adds, per adapter in the
batch, ``(x[rows] @ A^T) @ (scale * B)^T`` to its output rows: two thin matmuls a group, each a
:class:`~radixkv.model.linear.Linear` of its own, so a CPU runs them through oneDNN with packed
weights as it does the model's (PyTorch's BLAS takes several times as long there for these
shapes); grouping the rows beats gathering per-row factors. The scale (``lora_alpha / r``, or
``/ sqrt(r)`` with rsLoRA, per module with ``alpha_pattern``) is folded into B when loading.

:class:`LoRASet` owns the adapters of one model: it gives each a slot (0 is the base model),
puts a :class:`LoRALayer` on every linear layer an adapter touches (the layer calls it after its
own matmul; layers no adapter touches do nothing), and takes each step's rows per slot. What is
refused, at load, with an error naming the file and the problem: DoRA, adapters on the
embeddings or the LM head, ``modules_to_save``, LoRA biases, pickled ``adapter_model.bin``,
modules or layers the model does not have (a mixture-of-experts layer's experts and router
among them: on such models adapters reach the attention projections and the dense layers),
and factor shapes that do not fit it.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.hub import folder_display_name, resolve_model_folder
from radixkv.model.linear import Linear

__all__ = [
    "LoRAAdapter",
    "LoRALayer",
    "LoRASet",
    "adapter_digest",
    "load_lora_adapter",
    "save_random_adapter",
]

# module name in a decoder layer -> its parent module there
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# Phi-3's fused projections (what its PEFT adapters target) -> parent and the modules they are
# split into at load (radixkv/model/loader.py unfuse): a fused LoRA's B splits the same way,
# each part sharing the fused A (B A's rows are those parts' deltas, exactly)
FUSED = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what is read (or fetched)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass
class LoRAAdapter:
    """One adapter's factors, ready to add: ``factors[(layer, module)] = (a, b)``, Linear layers
    with weights ``A [r, in]`` and ``scale * B [out, r]`` in the model's dtype and device.
    ``digest`` names its content (:func:`adapter_digest`: its two files): two loads of the same
    files have the same digest, anything that could change the KV it computes changes it."""

    name: str
    path: str
    rank: int  # the largest rank among its modules
    factors: dict[tuple[int, str], tuple[Linear, Linear]]
    digest: str
    modules: tuple[str, ...] = field(default=())  # the module names it adapts, sorted

    @property
    def num_parameters(self) -> int:
        return sum(a.weight.numel() + b.weight.numel() for a, b in self.factors.values())


def load_lora_adapter(
    path: str | Path,
    config: ModelConfig,
    *,
    name: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoRAAdapter:
    """Read the PEFT adapter folder ``path`` for a model with ``config``: a local folder, or a
    Hugging Face repo id whose adapter files are fetched through the Hub cache (as vLLM's
    ``--lora-modules`` takes them; model/hub.py). Raises :class:`ModelLoadError` naming the
    file and the problem (module docstring)."""
    folder = resolve_model_folder(path, files=ADAPTER_FILES, what="LoRA adapter").folder
    cfg_path = folder / "adapter_config.json"
    cfg, cfg_raw = _read_adapter_config(cfg_path)
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        problem = "file is missing"
        if (folder / "adapter_model.bin").is_file():
            problem += " (adapter_model.bin is a pickle, not loaded: save with safetensors)"
        raise ModelLoadError(str(weights_path), None, problem)
    raw = weights_path.read_bytes()
    tensors = _read_tensors(weights_path, raw)

    alpha = cfg["lora_alpha"]
    rslora = bool(cfg.get("use_rslora", False))
    alpha_pattern: dict[str, Any] = cfg.get("alpha_pattern") or {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    fused: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    # the module name alpha_pattern sees: the checkpoint's (qkv_proj for Phi-3's q/k/v parts)
    named: dict[tuple[int, str], str] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ModelLoadError(str(weights_path), key, _unsupported_key(key))
        layer, parent, module, ab = int(m[1]), m[2], m[3], m[4]
        if "expert" in module:  # PEFT's LoRA on a transformers MoE's fused expert weights
            raise ModelLoadError(str(weights_path), key, _unsupported_key(f".{module}."))
        if module in FUSED and FUSED[module][0] == parent:
            fused.setdefault((layer, module), {})[ab] = t
            continue
        if TARGETS.get(module) != parent:
            raise ModelLoadError(
                str(weights_path), key, f"LoRA on {parent}.{module} is not supported "
                f"(supported: {', '.join(TARGETS)})"
            )  # fmt: skip
        if layer >= config.num_layers:
            raise ModelLoadError(
                str(weights_path), key, f"layer {layer} does not exist: the model has "
                f"{config.num_layers} layers"
            )  # fmt: skip
        if parent == "mlp" and config.moe is not None and config.moe.is_sparse(layer):
            raise ModelLoadError(
                str(weights_path), key, f"layer {layer} is a mixture-of-experts layer: it has "
                f"no {module} (LoRA on experts is not supported; attention projections are)"
            )  # fmt: skip
        pairs.setdefault((layer, module), {})[ab] = t
    for (layer, module), ab in sorted(fused.items()):
        parts = FUSED[module][1]
        sizes = [_shape(config, m)[1] for m in parts]
        b = ab.get("B")
        if "A" not in ab or b is None or b.dim() != 2 or b.shape[0] != sum(sizes):
            raise ModelLoadError(
                str(weights_path), f"model.layers.{layer}.{FUSED[module][0]}.{module}",
                f"a fused LoRA needs lora_A and a lora_B of {sum(sizes)} rows ({' + '.join(parts)})",
            )  # fmt: skip
        for m, b_part in zip(parts, b.split(sizes), strict=True):
            if (layer, m) in pairs:
                raise ModelLoadError(
                    str(weights_path), f"model.layers.{layer}.{TARGETS[m]}.{m}",
                    f"given both on its own and inside {module}",
                )  # fmt: skip
            pairs[(layer, m)] = {"A": ab["A"], "B": b_part}
            named[(layer, m)] = f"model.layers.{layer}.{FUSED[module][0]}.{module}"
    if not pairs:
        raise ModelLoadError(str(weights_path), None, "no LoRA weights in the file")

    factors: dict[tuple[int, str], tuple[Linear, Linear]] = {}
    digest = _digest(raw, cfg_raw)
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{TARGETS[module]}.{module}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ModelLoadError(str(weights_path), f"{where}.{missing}.weight", "missing")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = _shape(config, module)
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or tuple(a.shape) != (r, fan_in) or r < 1:
            raise ModelLoadError(
                str(weights_path), f"{where}.lora_A.weight",
                f"shape {tuple(a.shape)} does not fit the model: expected (r, {fan_in})",
            )  # fmt: skip
        if tuple(b.shape) != (fan_out, r):
            raise ModelLoadError(
                str(weights_path), f"{where}.lora_B.weight",
                f"shape {tuple(b.shape)} does not fit the model: expected ({fan_out}, {r})",
            )  # fmt: skip
        a_mod = _pattern_value(alpha_pattern, named.get((layer, module), where), alpha)
        scale = a_mod / math.sqrt(r) if rslora else a_mod / r
        factors[(layer, module)] = (
            _weight_linear(a.to(device=device, dtype=dtype)),
            _weight_linear((b.to(torch.float32) * scale).to(device=device, dtype=dtype)),
        )
        rank = max(rank, r)
    return LoRAAdapter(
        name=name if name is not None else folder_display_name(folder),
        path=str(path),
        rank=rank,
        factors=factors,
        digest=digest,
        modules=tuple(sorted({m for _, m in factors})),
    )


def save_random_adapter(
    config: ModelConfig,
    folder: str | Path,
    *,
    seed: int = 0,
    rank: int = 8,
    modules: Sequence[str] = tuple(TARGETS),
    scale: float = 1.0,
) -> Path:
    """Write a random LoRA adapter for a model with ``config`` into ``folder`` in PEFT's layout
    (for tests, demos and benchmarks: it changes outputs, it has learned nothing). Its deltas
    are about ``scale`` times as large as a random layer's output (MLP modules only on the
    layers that have them: a mixture-of-experts layer has experts instead). Returns the
    folder."""
    from safetensors.torch import save_file

    unknown = sorted(set(modules) - set(TARGETS))
    if unknown:
        raise ValueError(f"save_random_adapter: unknown modules {unknown}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        sparse = config.moe is not None and config.moe.is_sparse(layer)
        for m in modules:
            if sparse and TARGETS[m] == "mlp":
                continue
            fan_in, fan_out = _shape(config, m)
            key = f"base_model.model.model.layers.{layer}.{TARGETS[m]}.{m}"
            a = torch.randn(rank, fan_in, generator=gen) / math.sqrt(fan_in)
            b = torch.randn(fan_out, rank, generator=gen) * (scale / math.sqrt(rank))
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(modules)}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def _weight_linear(weight: torch.Tensor) -> Linear:
    """A bias-free Linear holding ``weight [out, in]`` (its device and dtype), packed for
    oneDNN where that applies."""
    lin = Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                 dtype=weight.dtype)  # fmt: skip
    with torch.no_grad():
        lin.weight.copy_(weight)
    lin.requires_grad_(False)
    lin.pack()
    return lin


def adapter_digest(path: str | Path) -> str:
    """The content digest of an adapter (a folder or Hub repo id, as :func:`load_lora_adapter`
    takes it) without loading it or knowing the model: what the engine's cache namespace of its
    requests is keyed by, so a router can hash prompts the way the engine will cache them."""
    folder = resolve_model_folder(path, files=ADAPTER_FILES, what="LoRA adapter").folder
    weights, config = (folder / f for f in ("adapter_model.safetensors", "adapter_config.json"))
    for f in (weights, config):
        if not f.is_file():
            raise ModelLoadError(str(f), None, "file is missing")
    return _digest(weights.read_bytes(), config.read_bytes())


def _digest(weights: bytes, config: bytes) -> str:
    """Both files' bytes: the weights and everything that scales them (alpha, rsLoRA, patterns),
    so equal digests mean equal deltas (a changed comment in the config only costs sharing)."""
    h = xxhash.xxh3_128(weights)
    h.update(len(weights).to_bytes(8, "little"))
    h.update(config)
    return h.hexdigest()


def _read_adapter_config(path: Path) -> tuple[dict[str, Any], bytes]:
    """The checked config, and the file's bytes (part of the adapter's digest)."""
    if not path.is_file():
        raise ModelLoadError(str(path), None, "file is missing (not a PEFT adapter folder?)")
    raw = path.read_bytes()
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(str(path), None, f"malformed JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(str(path), None, "expected a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ModelLoadError(str(path), "peft_type", f"{peft_type!r} adapters are not supported")
    if cfg.get("use_dora"):
        raise ModelLoadError(str(path), "use_dora", "DoRA adapters are not supported")
    if cfg.get("modules_to_save"):
        raise ModelLoadError(
            str(path), "modules_to_save",
            "adapters that replace whole modules are not supported",
        )  # fmt: skip
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(str(path), "bias", "LoRA biases are not supported")
    if cfg.get("fan_in_fan_out"):
        raise ModelLoadError(str(path), "fan_in_fan_out", "only nn.Linear layouts are supported")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ModelLoadError(str(path), "lora_alpha", f"must be a positive number, got {alpha!r}")
    cfg["lora_alpha"] = alpha
    pattern = cfg.get("alpha_pattern")
    if pattern is not None and not isinstance(pattern, dict):
        raise ModelLoadError(str(path), "alpha_pattern", "must be an object")
    return cfg, raw


def _read_tensors(path: Path, raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(raw)
    except (SafetensorError, ValueError, OSError) as exc:
        raise ModelLoadError(str(path), None, f"cannot read safetensors: {exc}") from exc


def _unsupported_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA adapters are not supported"
    if "lora_embedding" in key or "embed_tokens" in key:
        return "LoRA on the embeddings is not supported"
    if "lm_head" in key:
        return "LoRA on the LM head is not supported"
    if key.endswith(".bias"):
        return "LoRA biases are not supported"
    if ".experts." in key or ".block_sparse_moe." in key or ".shared_expert" in key:
        return "LoRA on a mixture-of-experts layer's experts or router is not supported"
    return "not a LoRA factor of a decoder layer's linear layer"


def _shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder layer's linear layer."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``alpha_pattern``: the first key that matches the module's name at its end."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


@dataclass
class _Stack:
    """Every adapter's factors of one layer side by side: ``a`` holds the A's stacked
    ``[C, in]``, ``b`` the scaled B's ``[out, C]``; column ``j`` belongs to ``col_slot[j]``."""

    a: Linear
    b: Linear
    col_slot: torch.Tensor  # [C] int64, on the weights' device
    layout: tuple[tuple[int, int], ...]  # (slot, rank) in column order: the masks' cache key


class LoRALayer:
    """The adapters' factors for one linear layer, and the step's rows per slot (shared by all
    layers through their :class:`LoRASet`). Called by :class:`~radixkv.model.linear.Linear`
    after its matmul; adds to the output in place.

    One adapter in the batch: its rows' ``b(a(x))``, two thin products. Several: the products
    of each group cost about as much as the layer's own matmul in fixed per-call time (measured
    on a CPU: 4 groups of 8 rows, rank 16, a 512 x 3072 layer: 630 us, the layer 640 us), so
    the layer multiplies every row by all adapters' A's stacked, zeroes the columns that are
    not the row's adapter's, and multiplies by the B's stacked (225 us there): two products
    whatever the number of adapters, exact (the zeroed terms add nothing). That computes every
    row's product with every loaded adapter, so it is used while at most half the stacked
    columns belong to adapters absent from the batch."""

    __slots__ = ("_stack", "factors", "owner")

    def __init__(self, owner: LoRASet) -> None:
        self.owner = owner
        self.factors: dict[int, tuple[Linear, Linear]] = {}  # slot -> (A, scale * B)
        self._stack: _Stack | None = None  # built when first needed; reset when factors change

    def changed(self) -> None:
        self._stack = None

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y [T, out] += b(a(x))`` for each row with an adapter on this layer (``x [T, in]``)."""
        present = [(slot, rows) for slot, rows in self.owner.groups if slot in self.factors]
        if not present:
            return
        if len(present) > 1:
            cols = sum(self.factors[slot][0].out_features for slot, _ in present)
            stack = self._stack or self._build_stack()
            if 2 * cols >= stack.col_slot.numel():
                h = stack.a(x)  # [T, C]
                h.mul_(self.owner.mask(stack, h.dtype))
                y.add_(stack.b(h))
                return
        for slot, rows in present:
            a, b = self.factors[slot]
            if type(rows) is slice:  # one run of rows: views, no gather
                y[rows].add_(b(a(x[rows])))
            else:  # (the engine's batches are grouped by adapter: they never come here)
                # index_put_ rather than index_add_: on a CPU the latter has been measured
                # taking tens of milliseconds now and then for a few hundred rows
                y.index_put_((rows,), b(a(x.index_select(0, rows))), accumulate=True)

    def _build_stack(self) -> _Stack:
        slots = sorted(self.factors)
        a_w = torch.cat([self.factors[s][0].weight for s in slots])  # [C, in]
        b_w = torch.cat([self.factors[s][1].weight for s in slots], dim=1)  # [out, C]
        ranks = [self.factors[s][0].out_features for s in slots]
        col = torch.repeat_interleave(torch.tensor(slots), torch.tensor(ranks))
        self._stack = _Stack(
            _weight_linear(a_w), _weight_linear(b_w), col.to(a_w.device),
            tuple(zip(slots, ranks)),
        )  # fmt: skip
        return self._stack


class LoRASet:
    """The adapters loaded into one model, each in a slot (0 is the base model: no delta).

    ``add`` and ``remove`` change which layers have factors; ``set_rows`` says which rows of the
    next forward belong to which slot (:class:`~radixkv.model.runner.ModelRunner` calls it for
    every batch). A model without adapters has no :class:`LoRALayer` at all. One set per model
    (:meth:`of`): engines sharing a loaded model share its slots, and the rows of a forward
    are kept per thread, so forwards in two threads do not see each other's."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.adapters: dict[int, LoRAAdapter] = {}
        self._next_slot = 1
        self._rows = threading.local()  # .groups: this thread's next forward's (slot, rows)

    @classmethod
    def of(cls, model: CausalLM) -> LoRASet:
        """The model's set (made on first use)."""
        found = model.__dict__.get("_radixkv_loras")
        if found is None:
            found = model.__dict__["_radixkv_loras"] = cls(model)
        return found

    @property
    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        return getattr(self._rows, "groups", _NO_GROUPS)

    def add(self, adapter: LoRAAdapter) -> int:
        """Attach ``adapter``; returns its slot."""
        slot = self._next_slot
        self._next_slot += 1
        layers = self.model.model.layers
        for (layer, module), f in adapter.factors.items():
            lin = getattr(getattr(layers[layer], TARGETS[module]), module)
            assert isinstance(lin, Linear)
            if not isinstance(lin.lora, LoRALayer):
                lin.lora = LoRALayer(self)
            lin.lora.factors[slot] = f
            lin.lora.changed()
        self.adapters[slot] = adapter
        return slot

    def remove(self, slot: int) -> None:
        """Detach the adapter in ``slot`` (layers left without factors lose their LoRALayer)."""
        adapter = self.adapters.pop(slot)
        layers = self.model.model.layers
        for layer, module in adapter.factors:
            lin = getattr(getattr(layers[layer], TARGETS[module]), module)
            if isinstance(lin.lora, LoRALayer):
                lin.lora.factors.pop(slot, None)
                lin.lora.changed()
                if not lin.lora.factors:
                    lin.lora = None

    def set_rows(self, slots: Sequence[int], lengths: Sequence[int], device: torch.device) -> None:
        """Rows of the next forward per slot: sequence ``i`` has ``lengths[i]`` consecutive rows
        and the adapter in ``slots[i]``. A slot whose rows form one run gets a slice."""
        runs: dict[int, list[tuple[int, int]]] = {}
        start = 0
        for slot, n in zip(slots, lengths):
            if slot:
                r = runs.setdefault(slot, [])
                if r and r[-1][1] == start:
                    r[-1] = (r[-1][0], start + n)
                else:
                    r.append((start, start + n))
            start += n
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, r in runs.items():
            if len(r) == 1:
                groups.append((slot, slice(*r[0])))
            else:
                idx = [i for a, b in r for i in range(a, b)]
                groups.append((slot, torch.tensor(idx, dtype=torch.int64).to(device)))
        step = self._rows
        step.groups = groups
        step.slots, step.lengths, step.device = slots, lengths, device
        step.row_slots = None  # [T], made by the first mask the step needs
        step.masks = {}

    def mask(self, stack: _Stack, dtype: torch.dtype) -> torch.Tensor:
        """``[T, C]``: 1 where column ``j`` of ``stack`` belongs to row ``i``'s adapter, else 0;
        made once per step and column layout (the layers an adapter set covers share it)."""
        step = self._rows
        key = (stack.layout, dtype)
        m = step.masks.get(key)
        if m is None:
            if step.row_slots is None:
                per_row = [s for s, n in zip(step.slots, step.lengths) for _ in range(n)]
                step.row_slots = torch.tensor(per_row, dtype=torch.int64).to(step.device)
            m = step.masks[key] = (step.row_slots[:, None] == stack.col_slot[None, :]).to(dtype)
        return m


_NO_GROUPS: list[tuple[int, slice | torch.Tensor]] = []
