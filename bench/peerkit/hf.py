"""transformers as a peer: a checkpoint folder (or radixkv-tiny's own weights) in a
``LlamaForCausalLM``-style model, greedy ``generate``, and bench_peers.py's three recipes."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .systems import System, Workload


@contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings silenced (generation-config notes, deprecations): the timed
    calls print nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def hf_model(
    folder: Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = "sdpa"
) -> Any:
    """The checkpoint in ``folder`` as transformers' model class, in eval mode (``None``:
    transformers' default attention)."""
    import transformers

    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with quiet():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    return model.eval()


def tiny_hf_model() -> Any:
    """radixkv-tiny's trained weights (the package's safetensors, in float32) loaded into
    transformers' ``LlamaForCausalLM``."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixkv.model.tiny import TINY_WEIGHTS, tiny_config

    c = tiny_config()
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids), attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    with quiet():
        model = LlamaForCausalLM(cfg).float().eval()
    state = {k: v.float() for k, v in load_file(str(TINY_WEIGHTS)).items()}
    model.load_state_dict(state, strict=True)
    return model


def hf_generate(
    model: Any,
    ids: torch.Tensor,
    new: int,
    cache: Any = None,
    *,
    attention_mask: torch.Tensor | None = None,
    hold_eos: bool = False,
    **kw: Any,
) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new`` tokens a row; only the new ids, ``[rows, new]``.
    EOS never stops it: by default it is no stop token (``eos_token_id=None``: the model may
    still pick it, as radixkv's ``ignore_eos``); with ``hold_eos`` it is never picked before
    ``new`` tokens (``min_new_tokens``). ``attention_mask`` defaults to every position;
    ``kw`` goes to ``generate`` (beams, prompt lookup, adapter names)."""
    stop: dict[str, Any] = {"min_new_tokens": new} if hold_eos else {"eos_token_id": None}
    with quiet():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if attention_mask is None else attention_mask,
            past_key_values=cache,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            **stop,
            **kw,
        )
    return out[:, ids.shape[1] :]


def transformers_systems(folder: Path, dtype: torch.dtype) -> list[System]:
    """transformers three ways on ``folder``: one batched ``generate``; the shared prefix
    prefilled once into a ``DynamicCache`` and a ``copy.deepcopy`` of it per request; and that
    cache repeated to the batch, one batched ``generate`` (the last two only where the
    workload shares a prefix)."""
    from transformers import DynamicCache

    model = hf_model(folder, dtype)
    name = str(dtype).removeprefix("torch.")

    @torch.inference_mode()
    def batched(w: Workload) -> list[list[int]]:
        return hf_generate(model, torch.tensor(w.prompts), w.new_tokens).tolist()

    def prefix_cache(w: Workload) -> Any:
        cache = DynamicCache(config=model.config)
        prefix = torch.tensor([w.prompts[0][: w.shared_prefix]])
        model(prefix, cache=cache, logits_to_keep=1)  # no logits for the prefix
        return cache

    @torch.inference_mode()
    def per_request(w: Workload) -> list[list[int]]:
        cache = prefix_cache(w)
        return [
            hf_generate(model, torch.tensor([p]), w.new_tokens, copy.deepcopy(cache))[0].tolist()
            for p in w.prompts
        ]

    @torch.inference_mode()
    def expanded(w: Workload) -> list[list[int]]:
        cache = prefix_cache(w)
        cache.batch_repeat_interleave(len(w.prompts))
        return hf_generate(model, torch.tensor(w.prompts), w.new_tokens, cache).tolist()

    sharing = lambda w: w.shared_prefix > 0  # noqa: E731
    return [
        System(f"transformers {name} batched", "transformers", name, batched,
               note="one batched generate"),
        System(f"transformers {name} prefix cache, per request", "transformers", name,
               per_request, sharing, note="prefix prefilled once; deepcopy per request"),
        System(f"transformers {name} prefix cache, batched", "transformers", name, expanded,
               sharing, note="prefix prefilled once; cache repeated to the batch"),
    ]  # fmt: skip
