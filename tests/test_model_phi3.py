"""Phi-3 / Phi-4 (Phi3ForCausalLM) end to end. test_model_hf_logits.py runs every paged path of
the test Phi-3 (fused projections, 3/4 of each head rotated, LongRoPE) against transformers at
1e-4; here the engine's greedy output equals transformers', the context is capped at the
LongRoPE model's original one, configs and errors, LoRA adapters on the fused projections
against PEFT, and weight updates through the fused checkpoint names."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, hf_config, hf_greedy, save_hf_folder
from engine_helpers import (
    FAMILY_CONFIGS,
    engine_greedy_equals_transformers,
    shared_prefix_prompts,
)
from lora_helpers import make_peft_adapter, peft_logits, radixkv_adapter_logits

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model
from radixkv.model.lora import load_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build_hf_model("phi3", seed=70)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp("phi3"))


def _saved(**overrides: Any) -> dict[str, Any]:
    return hf_config("phi3", **overrides).to_dict() | {"architectures": ["Phi3ForCausalLM"]}


def test_config_reads_phi3(phi3: tuple[Any, Path], caplog: pytest.LogCaptureFixture) -> None:
    """LongRoPE: short factors, transformers' attention factor, the context capped at the
    original one (logged with the reason); 3/4 of each head rotated."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, folder = phi3
    with caplog.at_level(logging.INFO, logger="radixkv.model.config"):
        c = load_model(folder).config
    assert "longrope served up to its original context, 256 tokens" in caplog.text
    assert c.max_position_embeddings == 256 and c.rotary_dim == 12
    inv, factor = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu")
    assert c.rope_scaling is not None
    assert c.rope_scaling["attention_factor"] == pytest.approx(factor)
    assert factor == pytest.approx(math.sqrt(1 + math.log(2048 / 256) / math.log(256)))
    from radixkv.model.layers import rope_inv_freq

    torch.testing.assert_close(rope_inv_freq(12, c.rope_theta, c.rope_scaling), inv)


def test_plain_phi3_and_its_window() -> None:
    """Phi-4's config (no rope scaling, full rotary): the whole context; Phi-3-mini-4k's
    sliding_window windows every layer, as transformers' mask does."""
    plain = _saved(rope_scaling=None, partial_rotary_factor=1.0, max_position_embeddings=4096)
    c = ModelConfig.from_hf(plain)
    assert (c.max_position_embeddings, c.rotary_dim, c.rope_scaling) == (4096, 16, None)
    assert c.layer_windows == ()
    c = ModelConfig.from_hf(plain | {"sliding_window": 47})
    assert c.layer_windows == (47, 47)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"partial_rotary_factor": 1.5, "rope_scaling": None}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.1, "rope_scaling": None}, "leaves 1 of 16 dims"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 5,
                           "long_factor": [1.0] * 6}}, "short_factor"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6,
                           "long_factor": [1.0] * 6}, "original_max_position_embeddings": None},
         "original_max_position_embeddings"),
    ],
)  # fmt: skip
def test_config_errors(change: dict[str, Any], where: str) -> None:
    d = _saved()
    d.pop("rope_parameters", None)
    d |= change
    if "rope_scaling" not in change:
        d["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0] * 6,
                             "long_factor": [1.0] * 6}  # fmt: skip
    with pytest.raises(ValueError, match=where):
        ModelConfig.from_hf(d)


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS)
def test_engine_greedy_equals_transformers(phi3: tuple[Any, Path], cfg: dict[str, Any]) -> None:
    hf, folder = phi3
    engine_greedy_equals_transformers(hf, folder, cfg, GREEDY)


def test_prompts_past_the_capped_context_are_refused(phi3: tuple[Any, Path]) -> None:
    _, folder = phi3
    with pytest.raises(ValueError, match="LongRoPE models are served up to their original"):
        Engine(load_model(folder), page_size=4, num_pages=200, max_model_len=512)
    eng = Engine(load_model(folder), page_size=4, num_pages=200)
    with pytest.raises(ValueError, match="256"):
        eng.add_request(list(range(3, 260)), GREEDY)
    assert not eng.has_unfinished()


@torch.no_grad()
@pytest.mark.parametrize(
    "modules", [["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"], ["qkv_proj", "gate_up_proj"]]
)
def test_lora_on_fused_projections_matches_peft(
    phi3: tuple[Any, Path], tmp_path: Path, modules: list[str]
) -> None:
    """PEFT adapters of Phi-3 target its fused modules: their B splits like the weights."""
    hf, folder = phi3
    lm = load_model(folder)
    ref = make_peft_adapter(hf, tmp_path / "a", seed=8, target_modules=modules)
    adapter = load_lora_adapter(tmp_path / "a", lm.config)
    if "qkv_proj" in modules:
        assert {(0, "q_proj"), (0, "k_proj"), (0, "v_proj")} <= set(adapter.factors)
    ids = shared_prefix_prompts(8, 1)[0][:40]
    got = radixkv_adapter_logits(lm, adapter, ids)
    want = peft_logits(ref, ids)
    assert (got - want).abs().max().item() < 1e-4
    assert (want - peft_logits(hf, ids)).abs().max().item() > 0.1


@torch.no_grad()
def test_lora_alpha_pattern_names_the_fused_modules(phi3: tuple[Any, Path], tmp_path: Path) -> None:
    """PEFT's alpha_pattern names a fused module (qkv_proj, gate_up_proj) as the checkpoint
    does: its scale applies to every part split from it, and only there."""
    hf, folder = phi3
    lm = load_model(folder)
    pattern = {"layers.0.self_attn.qkv_proj": 64, "gate_up_proj": 4}
    ref = make_peft_adapter(
        hf, tmp_path / "a", seed=9, target_modules=["qkv_proj", "gate_up_proj", "o_proj"],
        alpha_pattern=pattern,
    )  # fmt: skip
    adapter = load_lora_adapter(tmp_path / "a", lm.config)
    ids = shared_prefix_prompts(8, 1)[0][:40]
    got = radixkv_adapter_logits(lm, adapter, ids)
    assert (got - peft_logits(ref, ids)).abs().max().item() < 1e-4
    plain = make_peft_adapter(
        hf, tmp_path / "b", seed=9, target_modules=["qkv_proj", "gate_up_proj", "o_proj"]
    )
    assert (got - peft_logits(plain, ids)).abs().max().item() > 1e-2  # the pattern mattered


def test_lora_fused_shape_errors(phi3: tuple[Any, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf, folder = phi3
    c = load_model(folder).config
    make_peft_adapter(hf, tmp_path / "a", seed=9, target_modules=["qkv_proj"])
    path = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(path)
    key = "base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"
    tensors[key] = tensors[key][:-1]
    save_file(tensors, path)
    with pytest.raises(ModelLoadError, match=r"lora_B of 128 rows \(q_proj \+ k_proj \+ v_proj\)"):
        load_lora_adapter(tmp_path / "a", c)


def test_weight_update_through_fused_names(phi3: tuple[Any, Path], tmp_path: Path) -> None:
    _, folder = phi3
    new_hf = build_hf_model("phi3", seed=71)
    new = save_hf_folder(new_hf, tmp_path / "new")
    eng = Engine(load_model(folder), page_size=4, num_pages=300)
    prompts = shared_prefix_prompts(9, 4)
    eng.generate(prompts, GREEDY, use_tqdm=False)
    eng.update_weights(new)
    after = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    assert after == [hf_greedy(new_hf, p, GREEDY.max_tokens) for p in prompts]
    eng.check_invariants()
