"""load_model: radixkv-tiny (trained, packaged), radixkv-tiny-random, or a local HF model folder.

A folder needs ``config.json``, weights as ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (any ``*.safetensors`` as a last resort), and ``tokenizer.json``.
``tokenizer_config.json`` (or ``chat_template.jinja``) supplies the chat template and the BOS/EOS
strings; ``generation_config.json`` supplies EOS ids. Every problem raises
:class:`~radixkv.model.errors.ModelLoadError` naming the file and field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixkv.model.config import ModelConfig, parse_dtype
from radixkv.model.errors import ModelLoadError
from radixkv.model.llama import LlamaForCausalLM
from radixkv.model.tiny import (
    TINY_NAME,
    TINY_RANDOM_NAME,
    build_tiny_model,
    build_tiny_random_model,
    tiny_tokenizer,
)
from radixkv.model.tokenizer import HFTokenizer, Tokenizer

# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str


def load_model(
    name_or_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load ``"radixkv-tiny"``, ``"radixkv-tiny-random"`` or the HF folder at ``name_or_path`` onto ``device``.

    ``dtype`` defaults to the checkpoint's (``torch_dtype`` in config.json), fp32 for the tiny model.
    """
    device = torch.device(device)
    want = None if dtype is None else parse_dtype(dtype, "load_model", "dtype")
    if str(name_or_path) in (TINY_NAME, TINY_RANDOM_NAME):
        build = build_tiny_model if str(name_or_path) == TINY_NAME else build_tiny_random_model
        model = build(device, want or torch.float32)
        return LoadedModel(model, model.config, tiny_tokenizer(), str(name_or_path))
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise ModelLoadError(
            str(folder), None, f"not a model folder (and not {TINY_NAME!r}); no such directory"
        )
    config_path = folder / "config.json"
    cfg = ModelConfig.from_hf(_read_json(config_path, required=True), file=str(config_path))
    if want is not None and want != cfg.dtype:
        cfg = _with_dtype(cfg, want)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, dtype=cfg.dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_weights(model, folder)
    model.eval()
    tokenizer = _load_tokenizer(folder, cfg)
    return LoadedModel(model, cfg, tokenizer, folder.name)


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


def _weight_files(folder: Path) -> list[Path]:
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


def _load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    from safetensors import SafetensorError, safe_open

    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    files = _weight_files(folder)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(str(path), None, f"cannot read safetensors: {exc}") from exc
        with handle as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                if key not in params:
                    raise ModelLoadError(
                        str(path), key, f"unexpected tensor for {model.config.architecture}"
                    )
                tensor = f.get_tensor(key)
                target = params[key]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(
                        str(path),
                        key,
                        f"shape {tuple(tensor.shape)} does not match the expected "
                        f"{tuple(target.shape)} from config.json",
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                seen.add(key)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(params) - seen - tied)
    if missing:
        where = (
            folder / "model.safetensors.index.json"
            if (folder / "model.safetensors.index.json").is_file()
            else files[0]
        )
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(str(where), missing[0], f"missing weight{more}")


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_tokenizer(folder: Path, cfg: ModelConfig) -> HFTokenizer:
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
    gen_path = folder / "generation_config.json"
    gen = _read_json(gen_path, required=False)
    eos_ids: list[int] = []
    if "eos_token_id" in gen:
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
