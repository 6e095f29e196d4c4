"""Helpers for the model tests: tiny random Hugging Face checkpoints written to a folder.

transformers is the independent reference; these helpers build a model with it, give it weights
large enough that greedy decoding is not degenerate, save it (safetensors), and write a trained
byte-level BPE tokenizer.json, a tokenizer_config.json with a ChatML template and a
generation_config.json next to it.
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
EOS_ID = 2  # "<|im_end|>" in the trained tokenizer below
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching lets requests that share a system prompt skip recomputing it.",
    "Pages of keys and values are shared between requests; a radix tree finds them.",
    "héllo wörld, naïve café — 東京 ✓",
] * 20

SMALL: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": EOS_ID,
}


# The mixture-of-experts families, each exercising its own options: Mixtral (every layer
# sparse, weights always renormalized), Qwen2-MoE (a shared expert, only every 2nd layer
# sparse), Qwen3-MoE (renormalized top-k, layer 1 kept dense by mlp_only_layers), GraniteMoE
# (experts fused in the checkpoint, router over the top-k logits, Granite's scalars).
MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "qwen2_moe": {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 80, "decoder_sparse_step": 2, "norm_topk_prob": False,
    },
    "granitemoe": {
        "num_local_experts": 5, "num_experts_per_tok": 2, "pad_token_id": 0,
        "embedding_multiplier": 6.0, "residual_multiplier": 0.5, "attention_multiplier": 0.07,
        "logits_scaling": 4.0,
    },
    "qwen3_moe": {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 40,
        "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 32,
    },
}  # fmt: skip


# Sliding-window variants, windows far shorter than the tests' prompts: Mistral (every layer),
# Qwen2 (layers from max_window_layers on: layer 1 here, layer 0 full)
WINDOWED: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral_swa": ("mistral", {"sliding_window": 12}),
    "qwen2_swa": ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1}),
    "ministral_swa": ("ministral", {"sliding_window": 10, "head_dim": 16,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
    "smollm3_swa": ("smollm3", {"use_sliding_window": True, "sliding_window": 8}),
    "olmo3_swa": ("olmo3", {}),  # windowed as built (three layers of four)
    "cohere2_swa": ("cohere2", {}),  # likewise, its full layer without RoPE
}  # fmt: skip


# The Gemma family: head_dim away from hidden/heads, windows shorter than the tests' prompts
# (Gemma 2: every other layer; Gemma 3: layers 0-1 of 3 windowed, q/k norms, two RoPE bases
# and a linear scaling on the full layers); Gemma 2's soft caps low enough to bite
GEMMA: dict[str, dict[str, Any]] = {
    "gemma": {"head_dim": 24},
    "gemma2": {"head_dim": 24, "sliding_window": 10, "query_pre_attn_scalar": 20,
               "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0},
    "gemma3": {"head_dim": 24, "sliding_window": 11, "num_hidden_layers": 3,
               "query_pre_attn_scalar": 30, "sliding_window_pattern": 3,
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "rope_theta": 50000.0},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 1000.0}}},
}  # fmt: skip


def _classes(kind: str) -> tuple[Any, Any]:
    import transformers

    kind = WINDOWED[kind][0] if kind in WINDOWED else kind

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "ministral": (transformers.MinistralConfig, transformers.MinistralForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM),
        "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM),
        "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[kind]


def hf_config(kind: str, **overrides: Any) -> Any:
    if kind in WINDOWED:
        base, window = WINDOWED[kind]
        return hf_config(base, **{**window, **overrides})
    kw = dict(SMALL)
    if kind == "qwen3":
        kw["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    if kind == "mistral":
        kw["sliding_window"] = None
    kw.update(MOE.get(kind, {}))
    kw.update(GEMMA.get(kind, {}))
    if kind == "olmo3":  # 3 of 4 layers windowed; YaRN on the full layer only
        kw.update(num_hidden_layers=4, sliding_window=9, pad_token_id=0,
                  rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                      "rope_theta": 20000.0,
                                                      "original_max_position_embeddings": 256},
                                   "sliding_attention": {"rope_type": "default",
                                                         "rope_theta": 5000.0}})  # fmt: skip
    if kind == "olmo2":
        kw.update(pad_token_id=0)
    if kind == "cohere":  # Command R+'s per-head q/k LayerNorms
        kw.update(use_qk_norm=True, logit_scale=0.25, pad_token_id=0)
    if kind == "cohere2":  # 3 of 4 layers windowed (with RoPE), the 4th full without
        kw.update(num_hidden_layers=4, sliding_window=7, logit_scale=0.5, pad_token_id=0)
    if kind == "smollm3":  # layer 1 of 2 without RoPE (SmolLM3-3B: every 4th)
        kw.update(no_rope_layer_interval=2, pad_token_id=0)
    if kind == "phi3":  # Phi-4-mini's shape of RoPE: longrope, 3/4 of each head rotated
        half = 6  # dim pairs rotated: 0.75 of a 16-dim head is 12 dims
        kw.update(partial_rotary_factor=0.75, max_position_embeddings=2048, pad_token_id=0,
                  original_max_position_embeddings=256,
                  rope_scaling={"rope_type": "longrope",
                                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                "long_factor": [2.0 + 0.3 * i for i in range(half)]})  # fmt: skip
    if kind == "granite":  # its scalars away from 1, as in granite-3.x (12, 0.22, 1/128, 16)
        kw.update(embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.07,
                  logits_scaling=4.0)  # fmt: skip
    kw.update(overrides)
    return _classes(kind)[0](**kw)


@torch.no_grad()
def build_hf_model(kind: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers causal LM of the given family, in fp32, eval mode."""
    cfg = hf_config(kind, **overrides)
    torch.manual_seed(seed)
    model = _classes(kind)[1](cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif p.dim() == 1:  # biases (Qwen2 q/k/v)
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:  # weights [out, in], or experts stacked [E, out, in]: scaled by fan-in
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model


def train_byte_level_bpe(pre_tokenizer: Any = None) -> Any:
    """A 300-token byte-level BPE trained on CORPUS, the three ChatML specials as ids 0-2;
    ``pre_tokenizer`` replaces the plain ByteLevel split (the GGUF tests' pre-tokenizers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def write_tokenizer_files(folder: Path, *, eos_in_generation_config: Any = EOS_ID) -> None:
    tok = train_byte_level_bpe()
    assert tok.token_to_id("<|im_end|>") == EOS_ID
    tok.save(str(folder / "tokenizer.json"))
    tok_cfg = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    gen = {"eos_token_id": eos_in_generation_config, "bos_token_id": 1}
    (folder / "generation_config.json").write_text(json.dumps(gen))


def save_hf_folder(model: Any, folder: Path, **save_kw: Any) -> Path:
    """save_pretrained (safetensors) plus the tokenizer files; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation chatter
        model.save_pretrained(folder, safe_serialization=True, **save_kw)
    write_tokenizer_files(folder)
    return folder


@torch.no_grad()
def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), vocab]`` of a full forward pass of the transformers model."""
    return model(torch.tensor([ids])).logits[0].float()


# hf_greedy's results per model, by (prompt, tokens, dtype): the engine tests compare many
# configurations of one model on the same prompts. Models are not changed in place after their
# first generate (a dtype change is part of the key).
_GREEDY: weakref.WeakKeyDictionary[Any, dict[Any, list[int]]] = weakref.WeakKeyDictionary()


def hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    memo = _GREEDY.setdefault(model, {})
    key = (tuple(ids), max_new_tokens, next(model.parameters()).dtype)
    if key not in memo:
        memo[key] = _hf_greedy(model, ids, max_new_tokens)
    return list(memo[key])


@torch.no_grad()
def _hf_greedy(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def write_hub_snapshot(
    cache_dir: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Put the files of the folder ``source`` into a Hugging Face Hub cache at ``cache_dir`` the
    way huggingface_hub lays one out (``models--org--name/blobs/<hash>``, ``snapshots/<commit>/``
    holding relative symlinks to the blobs, ``refs/<ref>`` holding the commit); returns the
    snapshot folder. ``commit`` is a 40-hex-digit commit id."""
    import hashlib
    import os

    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return snapshot
