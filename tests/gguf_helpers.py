"""Synthetic GGUF files for the GGUF tests, written with the ``gguf`` package's GGUFWriter.

A random transformers model (``_model_hf_builders``) is written under llama.cpp's tensor
names, with its Q/K rows permuted as llama.cpp's converter does for the Llama architecture, and
its 2-D weights stored in the tensor type under test: quantized by ``gguf.quants.quantize``
where the package can, else (the K-quants, which it only dequantizes) as random blocks with
small scales. The reference is transformers' own GGUF path on the same file, which dequantizes
with its own code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _model_hf_builders import CHATML, train_byte_level_bpe

# HF names -> llama.cpp's (written out here rather than taken from radixkv: the test's own table)
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# bytes per 256-value block of the K-quants, where their fp16 scales sit in it (llama.cpp's
# block_qN_K layouts) and the scale a block gets
K_BLOCKS = {
    "Q2_K": (84, (80, 82), 1e-3),  # scales[16], qs[64], d, dmin
    "Q3_K": (110, (108,), 5e-4),  # hmask[32], qs[64], scales[12], d
    "Q4_K": (144, (0, 2), 1e-4),
    "Q5_K": (176, (0, 2), 5e-5),
    "Q6_K": (210, (208,), 2e-5),
}


def gguf_name(hf: str) -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{BLOCK[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order (rotate-half pairs made adjacent)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def random_k_blocks(qtype: str, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random K-quant blocks for a ``[rows, cols]`` weight: random payload, small scales."""
    nbytes, scale_at, scale = K_BLOCKS[qtype]
    rows, cols = shape
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, nbytes), dtype=np.uint8)
    for at in scale_at:
        d = (scale * (0.5 + rng.random(blocks.shape[0]))).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * nbytes)


def byte_level_vocab(pre_split: Any = None) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE trained on the test corpus; the
    three ChatML specials are CONTROL tokens 0-2."""
    tok = train_byte_level_bpe(pre_split)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if i < 3 else 1 for i in range(len(tokens))]
    return tokens, merges, types


def write_gguf(
    path: Path,
    hf: Any,
    kind: str,
    qtypes: tuple[str, ...],
    *,
    pre: str = "gpt2",
    tokenizer: tuple[list[str], list[str], list[int]] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write the transformers model ``hf`` of family ``kind`` as a GGUF at ``path``, its 2-D
    weights in the types ``qtypes`` in turn (norms and biases in F32, as llama.cpp keeps
    them)."""
    import gguf
    from gguf.quants import quantize

    cfg = hf.config
    arch = ARCH[kind]
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    for key, value in (metadata or {}).items():
        getattr(w, f"add_{key}")(value)
    tokens, merges, types = tokenizer or byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    matrices = 0
    for i, (name, p) in enumerate(hf.state_dict().items()):
        if tied and name == "lm_head.weight":
            continue
        a = p.detach().float().numpy()
        qtype = qtypes[matrices % len(qtypes)] if a.ndim == 2 else "F32"
        matrices += a.ndim == 2
        qt = gguf.GGMLQuantizationType[qtype]
        if kind == "llama" and name.endswith("q_proj.weight"):
            a = permute(a, cfg.num_attention_heads)
        elif kind == "llama" and name.endswith("k_proj.weight"):
            a = permute(a, cfg.num_key_value_heads)
        if a.ndim == 1:
            w.add_tensor(gguf_name(name), a)
        elif qtype in K_BLOCKS:
            w.add_tensor(gguf_name(name), random_k_blocks(qtype, a.shape, i), raw_dtype=qt)
        elif qtype in ("F32", "F16"):
            w.add_tensor(gguf_name(name), quantize(a, qt))
        else:
            w.add_tensor(gguf_name(name), quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: Path) -> Any:
    """transformers' model from the GGUF file (its own dequantization), fp32, eval mode."""
    import warnings

    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()
