"""The random checkpoint every peer runs: a Llama (or another transformers architecture) built
with transformers from a seed, saved as a Hugging Face folder in float32 (safetensors and a
Llama-style byte-fallback tokenizer.json), cached under a tag that names its shape."""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MODEL: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEED = 17
FIRST_ID = 3  # ids 0-2 are <unk>, <s>, </s>: prompts use the rest


@dataclass(frozen=True)
class Checkpoint:
    """A random checkpoint every peer runs: transformers' config and model classes (names in
    ``transformers``) with the config's fields, and the tag its files are cached under."""

    tag: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    # (module, class) of llama.cpp's converter for this architecture when that class would read
    # the vocabulary as its family's own tokenizer (Qwen's GPT-2 BPE, recognised by a hash of
    # known pre-tokenizers): it is made to read ours, the Llama-style one, as LlamaModel does
    vocab_as_llama: tuple[str, str] | None = None


LLAMA = Checkpoint(f"llama-h512-l4-v32000-s{SEED}", "LlamaConfig", "LlamaForCausalLM", MODEL)


def checkpoint(cache: Path, ckpt: Checkpoint = LLAMA) -> Path:
    """The checkpoint folder under ``cache`` (built when missing), named by its tag: the other
    peer scripts share it."""
    return build_checkpoint(cache / ckpt.tag, ckpt)


def build_checkpoint(folder: Path, ckpt: Checkpoint = LLAMA) -> Path:
    """The random model saved as a HF folder (fp32 safetensors + tokenizer files); reused when
    ``folder`` already holds it."""
    marker = folder / "radixkv_bench.json"
    if marker.is_file() and json.loads(marker.read_text()).get("tag") == ckpt.tag:
        return folder
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = getattr(transformers, ckpt.config_class)(**ckpt.config)
    model = getattr(transformers, ckpt.model_class)(cfg).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # unit-variance outputs for unit-variance inputs: logits spread, few ties
                # (weights [out, in], or an MoE's experts stacked [E, out, in]: by fan-in)
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder, ckpt.config["vocab_size"])
    marker.write_text(json.dumps({"tag": ckpt.tag, "config": ckpt.config}))
    return folder


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A Llama-style tokenizer.json (BPE with byte fallback, "▁" for spaces) of exactly
    ``vocab_size`` tokens: specials, the 256 byte tokens, then single characters. The benchmark
    feeds token ids, so only its shape matters: llama.cpp's converter reads it as a Llama vocab."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["▁"]
    chars = [chr(c) for c in range(33, 127)]
    for lo, hi in ((0x4E00, 0xA000), (0x3400, 0x4DC0), (0xAC00, 0xD7A4)):
        chars.extend(chr(c) for c in range(lo, hi))
    tokens += chars[: vocab_size - len(tokens)]
    assert len(tokens) == vocab_size
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
            }
        )
    )


def random_ids(rng: random.Random, n: int, vocab: int = MODEL["vocab_size"]) -> list[int]:
    """``n`` token ids drawn by ``rng`` from the ids prompts use (``FIRST_ID`` on)."""
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]
