"""The Cohere family (CohereForCausalLM, Cohere2ForCausalLM) end to end. test_model_hf_logits.py
runs every paged path of both against transformers at 1e-4, and test_model_window.py runs
Cohere 2 (windows, NoPE full layers) through the engine; here Command R's engine output against
transformers, its config fields, LoRA against PEFT on the parallel block, and errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, hf_config, save_hf_folder
from engine_helpers import FAMILY_CONFIGS, engine_greedy_equals_transformers, shared_prefix_prompts
from lora_helpers import make_peft_adapter, peft_logits, radixkv_adapter_logits

from radixkv.engine.params import SamplingParams
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model
from radixkv.model.lora import load_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def cohere(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build_hf_model("cohere", seed=80)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp("cohere"))


def _saved(kind: str, **overrides: Any) -> dict[str, Any]:
    arch = {"cohere": "CohereForCausalLM", "cohere2": "Cohere2ForCausalLM"}[kind]
    return hf_config(kind, **overrides).to_dict() | {"architectures": [arch]}


def test_config_reads_the_family() -> None:
    c = ModelConfig.from_hf(_saved("cohere", layer_norm_eps=3e-5))
    assert c.qk_norm and c.logits_scaling == 4.0 and c.rms_norm_eps == 3e-5
    assert c.tie_word_embeddings and c.nope_layers == () and c.layer_windows == ()
    c2 = ModelConfig.from_hf(_saved("cohere2", head_dim=8))
    assert c2.head_dim == 16  # hidden // heads, as transformers derives it
    assert c2.layer_windows == (7, 7, 7, 0) and c2.nope_layers == (3,)
    assert not c2.qk_norm and c2.logits_scaling == 2.0


@pytest.mark.parametrize("value", [0, -0.5, "0.0625", True])
def test_bad_logit_scale_names_the_field(value: Any) -> None:
    with pytest.raises(ModelLoadError, match="logit_scale"):
        ModelConfig.from_hf(_saved("cohere") | {"logit_scale": value})


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS)
def test_engine_greedy_equals_transformers(cohere: tuple[Any, Path], cfg: dict[str, Any]) -> None:
    hf, folder = cohere
    engine_greedy_equals_transformers(hf, folder, cfg, GREEDY)


@torch.no_grad()
def test_lora_matches_peft(cohere: tuple[Any, Path], tmp_path: Path) -> None:
    hf, folder = cohere
    lm = load_model(folder)
    ref = make_peft_adapter(hf, tmp_path / "a", seed=10)
    ids = shared_prefix_prompts(10, 1)[0][:40]
    got = radixkv_adapter_logits(lm, load_lora_adapter(tmp_path / "a", lm.config), ids)
    want = peft_logits(ref, ids)
    assert (got - want).abs().max().item() < 1e-4
    assert (want - peft_logits(hf, ids)).abs().max().item() > 0.1
