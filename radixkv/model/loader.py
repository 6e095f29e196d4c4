"""load_model: radixkv-tiny (trained, packaged), radixkv-tiny-random, a local HF model folder,
a Hugging Face repo id (``org/name``, fetched into the Hub cache, see hub.py), or a GGUF file
(a path, a packaged model's short name, or a folder / repo id with ``gguf_file``: gguf.py).

A folder needs ``config.json``, weights as ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (any ``*.safetensors`` as a last resort), and ``tokenizer.json``.
``tokenizer_config.json`` (or ``chat_template.jinja`` / ``chat_template.json``) supplies the chat
template and the BOS/EOS strings; ``generation_config.json`` supplies EOS ids. Every problem
raises :class:`~radixkv.model.errors.ModelLoadError` naming the file and field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixkv.model.causal_lm import CausalLM
from radixkv.model.config import ModelConfig, parse_dtype
from radixkv.model.dtype import AUTO, auto_dtype
from radixkv.model.errors import ModelLoadError
from radixkv.model.families import family_of
from radixkv.model.gguf import open_gguf
from radixkv.model.gguf_tokenizer import gguf_tokenizer
from radixkv.model.hub import TOKENIZER_FILES, resolve_model_folder
from radixkv.model.tiny import (
    TINY_NAME,
    TINY_NAMES,
    build_tiny_model,
    build_tiny_random_model,
    tiny_config,
    tiny_tokenizer,
)
from radixkv.model.tokenizer import HFTokenizer, Tokenizer
from radixkv.name_table import import_target

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A multimodal checkpoint served as its text model (config.TEXT_OF_MULTIMODAL): its language
# model's names (Hub layout, then transformers 5's in-memory one) -> the text model's, and the
# prefixes of the parts that are skipped
TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."
)  # fmt: skip


@dataclass
class LoadedModel:
    """A model ready to serve. ``name`` is what it is served under: the name or repo id the user
    passed (``org/name`` for a Hub cache snapshot folder), a local folder's own name."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load_model(
    name_or_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    gguf_file: str | None = None,
) -> LoadedModel:
    """Load ``"radixkv-tiny"``, ``"radixkv-tiny-random"``, the HF folder at ``name_or_path`` or
    the Hugging Face repo ``name_or_path`` (``org/name`` at ``revision``) onto ``device``.

    ``dtype``: None = the checkpoint's (``torch_dtype`` in config.json; fp32 for the tiny
    models); ``"auto"`` = the checkpoint's unless that is slow on ``device`` (see
    :func:`~radixkv.model.dtype.auto_dtype`; the choice is logged); or an explicit dtype.
    ``tokenizer``: a folder or repo id to take the tokenizer files from instead of the model's
    (EOS ids still come from the model's generation_config.json / config.json).
    ``chat_template``: a template file, or the template itself, replacing the tokenizer's.
    GGUF checkpoints (gguf.py): a ``*.gguf`` path, a packaged model's short name
    (``"smollm2-135m-instruct"``), or a folder / repo id with ``gguf_file`` naming the file in it;
    their weights are dequantized to float32 (the checkpoint's dtype).
    """
    device = torch.device(device)
    auto = isinstance(dtype, str) and dtype == AUTO
    want = None if dtype is None or auto else parse_dtype(dtype, "load_model", "dtype")
    name = str(name_or_path)
    if name in TINY_NAMES:
        _no_revision(name, revision)
        build = build_tiny_model if name == TINY_NAME else build_tiny_random_model
        if auto:  # the tiny models are stored in float32
            want = _auto_dtype(torch.float32, device, name)
        model = build(device, want or torch.float32)
        tok = _override_tokenizer(tiny_tokenizer(), model.config, None, tokenizer, chat_template)
        return LoadedModel(model, model.config, tok, name)
    gguf = open_gguf(name_or_path, gguf_file=gguf_file, revision=revision)
    if gguf is None:
        source = resolve_model_folder(name_or_path, revision=revision)
        folder, served = source.folder, source.name
        cfg = read_model_config(folder)
    else:  # a GGUF file (gguf.py): config, weights and tokenizer from the one file
        folder, served, cfg = None, gguf.name, gguf.config
    if auto:
        want = _auto_dtype(cfg.dtype, device, served)
    if want is not None and want != cfg.dtype:
        cfg = _with_dtype(cfg, want)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, dtype=cfg.dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if gguf is None:
        assert folder is not None
        _load_weights(model, folder)
        tok: Tokenizer = _load_tokenizer(folder, cfg, eos_from=folder)
    else:
        _load_weights(model, gguf.path, gguf.weights(cfg))
        tok = gguf_tokenizer(gguf)
    model.eval()
    tok = _override_tokenizer(tok, cfg, folder, tokenizer, chat_template)
    return LoadedModel(model, cfg, tok, served)


def load_tokenizer(
    name_or_path: str | Path,
    *,
    revision: str | None = None,
    tokenizer: str | Path | None = None,
    chat_template: str | None = None,
    gguf_file: str | None = None,
) -> Tokenizer:
    """The tokenizer :func:`load_model` gives the same arguments, without reading (or, for a
    repo id, fetching) any weights (a GGUF file's are memory-mapped, not read)."""
    name = str(name_or_path)
    if name in TINY_NAMES:
        _no_revision(name, revision)
        cfg = tiny_config()
        return _override_tokenizer(tiny_tokenizer(), cfg, None, tokenizer, chat_template)
    gguf = open_gguf(name_or_path, gguf_file=gguf_file, revision=revision)
    if gguf is not None:  # the model's config is read only for a tokenizer override
        tok = gguf_tokenizer(gguf)
        if tokenizer is not None:
            return _override_tokenizer(tok, gguf.config, None, tokenizer, chat_template)
        return _override_tokenizer(tok, tiny_config(), None, None, chat_template)
    folder = resolve_model_folder(
        name_or_path, revision=revision, files=("config.json", *TOKENIZER_FILES)
    ).folder
    cfg = read_model_config(folder)
    tok = _load_tokenizer(folder, cfg, eos_from=folder)
    return _override_tokenizer(tok, cfg, folder, tokenizer, chat_template)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The CausalLM class of the family that computes ``cfg.architecture`` (its row in
    :data:`radixkv.model.families.MODEL_FAMILIES`)."""
    cls: type[CausalLM] = import_target(family_of(cfg.architecture).model)
    return cls


def _no_revision(name: str, revision: str | None) -> None:
    if revision is not None:
        raise ModelLoadError(name, None, "revision applies to Hugging Face repo ids only")


def read_model_config(folder: Path) -> ModelConfig:
    """The ModelConfig of the HF model folder ``folder`` (ModelLoadError naming the field)."""
    path = folder / "config.json"
    return ModelConfig.from_hf(_read_json(path, required=True), file=str(path))


def _override_tokenizer(
    tok: Tokenizer,
    cfg: ModelConfig,
    folder: Path | None,
    tokenizer: str | Path | None,
    chat_template: str | None,
) -> Tokenizer:
    """``tok``, or the tokenizer of the ``tokenizer`` folder / repo id (EOS ids still from the
    model ``folder``), with its chat template replaced by ``chat_template`` when given."""
    if tokenizer is not None:
        tok_folder = resolve_model_folder(tokenizer, files=TOKENIZER_FILES, what="tokenizer").folder
        tok = _load_tokenizer(tok_folder, cfg, eos_from=folder)
        if tok.vocab_size > cfg.vocab_size:
            log.warning(
                "tokenizer %s has %d tokens but the model only %d: prompts using the extra ids "
                "are rejected",
                tokenizer,
                tok.vocab_size,
                cfg.vocab_size,
            )
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def _auto_dtype(checkpoint: torch.dtype, device: torch.device, name: str) -> torch.dtype:
    """``dtype="auto"``'s answer for a checkpoint stored in ``checkpoint``, logged when it
    differs from the checkpoint's."""
    choice = auto_dtype(checkpoint, device)
    if choice.note:
        log.info("%s: %s", name, choice.note)
    return choice.dtype


def read_chat_template(value: str | Path) -> str:
    """A chat template override: the text of the file ``value`` names, or ``value`` itself when
    it is a template (contains ``{{`` or ``{%``). ModelLoadError otherwise."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # a template longer than a file name can be (ENAMETOOLONG)
        is_file = False
    if is_file:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(str(path), None, f"cannot read the chat template: {exc}") from exc
    text = str(value)
    if "{{" in text or "{%" in text:
        return text
    raise ModelLoadError(
        text, None, "chat_template: no such file (and not a template: no '{{' or '{%' in it)"
    )


def _with_dtype(cfg: ModelConfig, dtype: torch.dtype) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, dtype=dtype)


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(str(path), None, "file is missing")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            str(path), None, f"malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ModelLoadError(str(path), None, f"not UTF-8 text: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(str(path), None, f"expected a JSON object, got {type(data).__name__}")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the HF model folder ``folder``: the index's shards, else
    ``model.safetensors``, else every ``*.safetensors`` (ModelLoadError when there are none)."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(str(index_path), "weight_map", "missing or not a non-empty object")
        files: list[Path] = []
        for tensor, shard in weight_map.items():
            if not isinstance(shard, str):
                raise ModelLoadError(str(index_path), f"weight_map.{tensor}", "not a file name")
            path = folder / shard
            if not path.is_file():
                raise ModelLoadError(
                    str(index_path), f"weight_map.{tensor}", f"shard file {shard!r} is missing"
                )
            if path not in files:
                files.append(path)
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            str(folder / "model.safetensors"), None, "no *.safetensors weights in the folder"
        )
    return files


def unfuse(key: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor under the model's names: Phi-3's fused projections split into the
    modules radixkv has (``qkv_proj`` rows: q, then k, then v; ``gate_up_proj``: gate, then
    up), GraniteMoE's stacked experts into Mixtral's per-expert ``w1``/``w3``/``w2`` and its
    router into ``gate``, anything else as it is."""
    if key.endswith(".self_attn.qkv_proj.weight"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if tensor.shape[0] == q + 2 * kv:
            stem = key.removesuffix("qkv_proj.weight")
            parts = tensor.split([q, kv, kv])
            return [(f"{stem}{n}_proj.weight", p) for n, p in zip("qkv", parts, strict=True)]
    if key.endswith(".block_sparse_moe.router.layer.weight"):  # GraniteMoE's router
        return [(key.removesuffix("router.layer.weight") + "gate.weight", tensor)]
    if key.endswith(".block_sparse_moe.input_linear.weight") and tensor.dim() == 3:
        stem = key.removesuffix("input_linear.weight")  # [E, 2I, H]: gate rows, then up
        return [
            (f"{stem}experts.{e}.{name}.weight", part)
            for e in range(tensor.shape[0])
            for name, part in zip(("w1", "w3"), tensor[e].chunk(2), strict=True)
        ]
    if key.endswith(".block_sparse_moe.output_linear.weight") and tensor.dim() == 3:
        stem = key.removesuffix("output_linear.weight")  # [E, H, I]
        return [(f"{stem}experts.{e}.w2.weight", tensor[e]) for e in range(tensor.shape[0])]
    if key.endswith(".mlp.gate_up_proj.weight") and tensor.shape[0] % 2 == 0:
        stem = key.removesuffix("gate_up_proj.weight")
        gate, up = tensor.chunk(2)
        return [(f"{stem}gate_proj.weight", gate), (f"{stem}up_proj.weight", up)]
    return [(key, tensor)]


def checkpoint_tensors(
    folder: Path, config: ModelConfig
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, name, tensor) for every tensor of the HF folder's safetensors files, in file
    order, but those the model recomputes (``IGNORED_SUFFIXES``); a multimodal checkpoint's
    language model under the text model's names, its vision parts left out; fused projections
    split (:func:`unfuse`, by ``config``'s shapes). ModelLoadError naming the file (and tensor)
    when one cannot be read."""
    from safetensors import SafetensorError, safe_open

    for path in weight_files(folder):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(str(path), None, f"cannot read safetensors: {exc}") from exc
        with handle as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if key.endswith(IGNORED_SUFFIXES) or key.startswith(VISION_PREFIXES):
                    continue
                try:
                    tensor = f.get_tensor(key)
                except (SafetensorError, OSError) as exc:
                    raise ModelLoadError(str(path), key, f"cannot read: {exc}") from exc
                for old, new in TEXT_MODEL_PREFIXES:
                    if key.startswith(old):
                        key = new + key.removeprefix(old)
                        break
                for name, part in unfuse(key, tensor, config):
                    yield path, name, part


def missing_weights_error(folder: Path, missing: list[str]) -> ModelLoadError:
    """The error for a checkpoint without the weights ``missing`` (sorted, not empty)."""
    index = folder / "model.safetensors.index.json"
    where = index if index.is_file() else weight_files(folder)[0]
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return ModelLoadError(str(where), missing[0], f"missing weight{more}")


def _load_weights(
    model: CausalLM,
    folder: Path,
    tensors: Iterator[tuple[Path, str, torch.Tensor]] | None = None,
) -> None:
    """Copy ``tensors`` (default: the HF folder's, :func:`checkpoint_tensors`) into ``model``;
    ``folder``: the folder or file named when a weight is missing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    if tensors is None:
        tensors = checkpoint_tensors(folder, model.config)
    for path, key, tensor in tensors:
        if key not in params:
            raise ModelLoadError(
                str(path), key, f"unexpected tensor for {model.config.architecture}"
            )
        target = params[key]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(
                str(path),
                key,
                f"shape {tuple(tensor.shape)} does not match the expected "
                f"{tuple(target.shape)} from {'its metadata' if path.suffix == '.gguf' else 'config.json'}",
            )
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        seen.add(key)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(params) - seen - tied)
    if missing and folder.is_file():  # a single-file checkpoint (GGUF)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(str(folder), missing[0], f"missing weight{more}")
    if missing:
        raise missing_weights_error(folder, missing)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_tokenizer(folder: Path, cfg: ModelConfig, *, eos_from: Path | None) -> HFTokenizer:
    """The tokenizer in ``folder``. EOS ids: ``eos_token_id`` of generation_config.json in the
    model's folder ``eos_from`` (None: a built-in model, no such file), else config.json's, else
    the tokenizer's EOS token."""
    from tokenizers import Tokenizer as RawTokenizer

    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise ModelLoadError(str(tok_path), None, "file is missing")
    try:
        raw = RawTokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on parse errors
        raise ModelLoadError(str(tok_path), None, f"cannot parse tokenizer: {exc}") from exc
    tc_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tc_path, required=False)
    template = _chat_template(folder, tok_cfg, tc_path)
    bos, eos = _token_str(tok_cfg.get("bos_token")), _token_str(tok_cfg.get("eos_token"))
    gen_path = None if eos_from is None else eos_from / "generation_config.json"
    gen = {} if gen_path is None else _read_json(gen_path, required=False)
    eos_ids: list[int] = []
    if "eos_token_id" in gen:
        assert gen_path is not None
        eos_ids = _ids(gen["eos_token_id"], gen_path, "eos_token_id")
    elif cfg.eos_token_ids:
        eos_ids = list(cfg.eos_token_ids)
    elif eos is not None and raw.token_to_id(eos) is not None:
        eos_ids = [int(raw.token_to_id(eos))]
    return HFTokenizer(
        raw, eos_token_ids=eos_ids, chat_template=template, bos_token=bos, eos_token=eos
    )


def _ids(value: Any, path: Path, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(
            str(path), field, f"expected a token id or a list of them, got {value!r}"
        )
    return [int(v) for v in values]


def _chat_template(folder: Path, tok_cfg: dict[str, Any], tc_path: Path) -> str | None:
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    json_path = folder / "chat_template.json"  # {"chat_template": "..."} (newer transformers)
    if json_path.is_file():
        template = _read_json(json_path, required=True).get("chat_template")
        if not isinstance(template, str):
            raise ModelLoadError(str(json_path), "chat_template", "must be a string")
        return template
    template = tok_cfg.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        if isinstance(chosen, str):
            return chosen
    raise ModelLoadError(
        str(tc_path), "chat_template", "must be a string or a list of named templates"
    )
