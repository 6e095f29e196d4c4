"""Granite (GraniteForCausalLM): a Llama with four scalars (embedding, residual and attention
multipliers, logits scaling). test_model_hf_logits.py runs every paged path against
transformers for it; here the engine end to end, the config fields, and what is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _model_hf_builders import build_hf_model, save_hf_folder
from engine_helpers import FAMILY_CONFIGS, engine_greedy_equals_transformers

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = build_hf_model("granite", seed=40)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp("granite"))


def test_config_reads_the_scalars(granite: tuple[Any, Path]) -> None:
    _, folder = granite
    c = load_model(folder).config
    assert c.architecture == "GraniteForCausalLM"
    assert (c.embedding_multiplier, c.residual_multiplier) == (6.0, 0.5)
    assert (c.attention_multiplier, c.logits_scaling) == (0.07, 4.0)
    # the other families keep the neutral values (attention scale 1/sqrt(head_dim))
    llama = load_model(save_hf_folder(build_hf_model("llama"), folder.parent / "llama")).config
    assert llama.attention_multiplier is None and llama.logits_scaling == 1.0


@pytest.mark.parametrize("cfg", FAMILY_CONFIGS)
def test_engine_greedy_equals_transformers(granite: tuple[Any, Path], cfg: dict[str, Any]) -> None:
    hf, folder = granite
    engine_greedy_equals_transformers(hf, folder, cfg, GREEDY)


def test_bad_scalars_name_the_field(granite: tuple[Any, Path], tmp_path: Path) -> None:
    _, folder = granite
    for name, value in [("logits_scaling", 0), ("attention_multiplier", "x"),
                        ("embedding_multiplier", -2.0)]:  # fmt: skip
        dst = tmp_path / name
        shutil.copytree(folder, dst)
        cfg = json.loads((dst / "config.json").read_text())
        cfg[name] = value
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=rf"field '{name}': must be a positive number"):
            load_model(dst)


def test_weight_update_refuses_other_scalars(granite: tuple[Any, Path], tmp_path: Path) -> None:
    """Checkpoints with other scalars compute other KV: update_weights refuses them."""
    _, folder = granite
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["residual_multiplier"] = 0.25
    (other / "config.json").write_text(json.dumps(cfg))
    eng = Engine(load_model(folder), page_size=4, num_pages=100)
    with pytest.raises(ModelLoadError, match=r"field 'residual_multiplier': 0\.25 differs"):
        eng.update_weights(other)
    eng.check_invariants()
