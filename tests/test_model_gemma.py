"""The Gemma family (Gemma, Gemma 2, Gemma 3's text model) end to end. test_model_hf_logits.py
runs every paged path of the three against transformers at 1e-4; here the engine's greedy
output equals transformers' (cache off and on, chunked, preempted, page 16 with cascade: on
Gemma 3 the windowed layers go around the shared-prefix levels, on Gemma 2 the soft-capped
scores keep cascade off), bf16 against transformers' bf16, configs in both layouts, LoRA
against PEFT, weight updates, and what is refused."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, hf_config, hf_greedy, hf_logits, save_hf_folder
from engine_helpers import (
    FAMILY_CONFIGS,
    engine_greedy_equals_transformers,
    run_checked,
    shared_prefix_prompts,
)
from lora_helpers import make_peft_adapter, peft_logits, radixkv_adapter_logits

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.gemma import GemmaForCausalLM
from radixkv.model.loader import load_model
from radixkv.model.lora import load_lora_adapter
from radixkv.model.runner import ModelRunner, SeqInput

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
KINDS = ["gemma", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = build_hf_model(request.param, seed=60)
    return request.param, hf, save_hf_folder(hf, tmp_path_factory.mktemp(request.param))


def _saved(kind: str, **overrides: Any) -> dict[str, Any]:
    cfg = hf_config(kind, **overrides)
    arch = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}[kind]  # fmt: skip
    return cfg.to_dict() | {"architectures": [arch]}


def test_config_reads_the_family(pair: Any) -> None:
    kind, hf, folder = pair
    c = load_model(folder).config
    assert isinstance(load_model(folder).model, GemmaForCausalLM)
    assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings
    if kind == "gemma":
        assert c.layer_windows == () and c.attention_multiplier is None
    else:
        assert c.attention_multiplier == pytest.approx(hf.config.query_pre_attn_scalar**-0.5)
        want = [hf.config.sliding_window if t == "sliding_attention" else 0
                for t in hf.config.layer_types]  # fmt: skip
        assert list(c.layer_windows) == want and any(want) and not all(want)
    if kind == "gemma2":
        assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (3.0, 4.0)
    if kind == "gemma3":
        assert c.qk_norm and c.local_rope_theta == 1000.0 and c.rope_theta == 50000.0
        assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_gemma3_classic_config_layout() -> None:
    """Gemma 3's config.json as the Hub holds it (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern, no layer_types) reads as the newer layout."""
    new = ModelConfig.from_hf(_saved("gemma3"))
    old = _saved("gemma3")
    for key in ("rope_parameters", "layer_types"):
        old.pop(key)
    old |= {"rope_theta": 50000.0, "rope_local_base_freq": 1000.0, "sliding_window_pattern": 3,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    assert ModelConfig.from_hf(old) == new
    # transformers' defaults: 1e6 / 1e4 bases, every 6th layer full
    bare = _saved("gemma3", num_hidden_layers=7)
    for key in ("rope_parameters", "layer_types", "sliding_window_pattern"):
        bare.pop(key, None)
    c = ModelConfig.from_hf(bare)
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert [w == 0 for w in c.layer_windows] == [False] * 5 + [True, False]


@pytest.mark.parametrize(
    ("kind", "change", "where"),
    [
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("gemma", {"hidden_act": "silu"}, "hidden_act"),
        ("gemma2", {"query_pre_attn_scalar": -4}, "query_pre_attn_scalar"),
        ("gemma2", {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        ("gemma2", {"sliding_window": None}, "sliding_window"),
        ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                        "sliding_attention": {"rope_type": "linear",
                                                              "factor": 2.0}}},
         "sliding_attention.rope_type"),
        ("gemma3", {"layer_types": ["sliding_attention"]}, "layer_types"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(kind: str, change: dict[str, Any], where: str) -> None:
    d = _saved(kind) | change
    with pytest.raises(ModelLoadError, match=where):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("window_kv", ["auto", "full"])
@pytest.mark.parametrize("cfg", FAMILY_CONFIGS)
def test_engine_greedy_equals_transformers(pair: Any, cfg: dict[str, Any], window_kv: str) -> None:
    """Each config, with the windowed layers' K/V in window slots (auto: hybrid for Gemma 2
    and 3, which have windows) and kept for every token (full)."""
    kind, hf, folder = pair
    eng = engine_greedy_equals_transformers(hf, folder, cfg | {"window_kv": window_kv}, GREEDY)
    hybrid = isinstance(eng.kv_pool, HybridKVPool)
    assert hybrid == (window_kv == "auto" and kind != "gemma")
    if cfg.get("cascade") == "on":
        cascade = eng.runner._cascade
        if kind == "gemma2":  # soft-capped scores: cascade never planned
            assert cascade is None and eng.stats().cascade_steps == 0
        else:
            assert cascade is not None and eng.stats().cascade_steps > 0
            # hybrid: the cascade wraps the full layers only, and the windowed layers read
            # their windows from their own backend; full: the windowed layers go around it
            banded = eng.runner._cascade_inner._banded is not None
            assert banded == (kind == "gemma3" and not hybrid)
            assert (cascade is not eng.runner._cascade_inner) == hybrid


def test_bf16_against_transformers_bf16(pair: Any) -> None:
    """In bf16, radixkv is as close to the fp32 logits as transformers' bf16 is, and as close
    to transformers' bf16 as that is to fp32 (the same roundings of the embedding scale, norms
    and soft caps; radixkv caps in fp32)."""
    kind, hf, folder = pair
    ids = shared_prefix_prompts(3, 1)[0][:40]
    exact = hf_logits(hf, ids)
    ref = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)  # (the fixture stays fp32)
    lm = load_model(folder, dtype="bfloat16")
    c = lm.config
    kv = KVPool(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
    got = ModelRunner(lm.model, kv, backend="torch").forward(
        [SeqInput(ids, list(range(12)), 0)], all_logits=True
    )
    rounding = (ref - exact).abs().mean().item()
    assert rounding > 0  # bf16 did round
    assert (got - exact).abs().mean().item() <= 1.25 * rounding, kind
    assert (got - ref).abs().mean().item() <= 1.25 * rounding, kind


@torch.no_grad()
def test_lora_matches_peft(pair: Any, tmp_path: Path) -> None:
    kind, hf, folder = pair
    lm = load_model(folder)
    ref = make_peft_adapter(hf, tmp_path / "a", seed=7)
    ids = shared_prefix_prompts(4, 1)[0][:30]
    got = radixkv_adapter_logits(lm, load_lora_adapter(tmp_path / "a", lm.config), ids)
    want = peft_logits(ref, ids)
    # fp32 rounding of logits up to ~20 (sqrt(hidden)-scaled embeddings, large LoRA deltas)
    assert (got - want).abs().max().item() < 2e-5 * want.abs().max().item(), kind
    assert (want - peft_logits(hf, ids)).abs().max().item() > 0.1  # the adapter matters


def test_weight_update_swaps_the_model(pair: Any, tmp_path: Path) -> None:
    kind, _, folder = pair
    new_hf = build_hf_model(kind, seed=61)
    new = save_hf_folder(new_hf, tmp_path / "new")
    eng = Engine(load_model(folder), page_size=4, num_pages=300)
    prompts = shared_prefix_prompts(5, 4)
    eng.generate(prompts, GREEDY, use_tqdm=False)
    eng.update_weights(new)
    after = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    assert after == [hf_greedy(new_hf, p, GREEDY.max_tokens) for p in prompts]
    eng.check_invariants()
    if kind == "gemma2":  # a checkpoint with other soft caps computes something else
        cfg = json.loads((new / "config.json").read_text())
        cfg["attn_logit_softcapping"] = 7.0
        (new / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            eng.update_weights(new)


def _multimodal(tmp: Path) -> tuple[Any, Path]:
    """A random transformers Gemma3ForConditionalGeneration (a one-layer SigLIP tower), saved
    as transformers saves it (the Hub's ``language_model.model.*`` names)."""
    import transformers

    torch.manual_seed(62)
    text = hf_config("gemma3")
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4,
        image_token_index=300, boi_token_index=301, eoi_token_index=302,
    )  # fmt: skip
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the text model's weights as build_hf_model sets them
        for name, p in hf.named_parameters():
            if "language_model" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape) if "norm" in name
                        else torch.randn(p.shape) / math.sqrt(p.shape[-1]))  # fmt: skip
    return hf, save_hf_folder(hf, tmp)


def test_multimodal_gemma3_serves_its_text_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration checkpoint (gemma-3-4b-it and larger) loads as its
    text model: vision weights skipped, language-model names mapped, logits and greedy output
    as transformers' multimodal model on text."""
    hf, folder = _multimodal(tmp_path / "mm")
    lm = load_model(folder)
    assert lm.config.architecture == "Gemma3ForCausalLM" and lm.config.layer_windows
    ids = shared_prefix_prompts(6, 1)[0][:50]
    c = lm.config
    kv = KVPool(c.num_layers, 32, 4, c.num_kv_heads, c.head_dim, c.dtype, "cpu")
    got = ModelRunner(lm.model, kv, backend="torch").forward(
        [SeqInput(ids, list(range(13)), 0)], all_logits=True
    )
    want = hf_logits(hf, ids)
    assert (got - want).abs().max().item() < 1e-4
    eng = Engine(lm, page_size=4, num_pages=200)
    prompts = shared_prefix_prompts(7, 4)
    outs = run_checked(eng, prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def test_multimodal_gemma3_config_as_on_the_hub() -> None:
    """The Hub's gemma-3-4b-it config.json lists only a few text fields: the rest are
    transformers' Gemma3TextConfig defaults; errors name the field inside text_config."""
    hub = {
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
        "model_type": "gemma3", "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
    }  # fmt: skip
    c = ModelConfig.from_hf(hub)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers) == (
        "Gemma3ForCausalLM", 262_208, 2560, 34,
    )  # fmt: skip
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.dtype) == (8, 4, 256, torch.bfloat16)
    assert c.eos_token_ids == (1, 106) and c.tie_word_embeddings
    assert c.rope_theta == 1e6 and c.local_rope_theta == 1e4
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c.attention_multiplier == pytest.approx(256**-0.5)
    assert c.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(34))
    with pytest.raises(ModelLoadError, match=r"'text_config\.hidden_size'"):
        ModelConfig.from_hf(hub | {"text_config": hub["text_config"] | {"hidden_size": -1}})
    with pytest.raises(ModelLoadError, match="'text_config'"):
        ModelConfig.from_hf({k: v for k, v in hub.items() if k != "text_config"})
