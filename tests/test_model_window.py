"""Sliding-window attention end to end: configs read as transformers reads them (which layers
have a window, from Mistral's, Qwen's and Qwen-MoE's fields), contexts no longer capped at
the window, and the engine's greedy output equal to transformers' on prompts and outputs far
longer than the window, with the cache off and on, chunked, preempted, and with cascade decode
(whose shared-prefix levels the windowed layers must not read). test_model_hf_logits.py runs
every paged path of the two windowed kinds (mistral_swa, qwen2_swa) against transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from _model_hf_builders import WINDOWED, build_hf_model, hf_config, save_hf_folder
from engine_helpers import (
    FAMILY_CONFIGS,
    engine_greedy_equals_transformers,
)

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.model.config import ModelConfig
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)  # outputs cross the window too


def _arch(kind: str) -> str:
    from _model_hf_builders import _classes

    return _classes(kind)[1].__name__


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("mistral", {"sliding_window": 12}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 9, "max_window_layers": 0}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 2,
                       "num_hidden_layers": 4}),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 6}),
        ("mixtral", {"sliding_window": 10}),
        ("ministral", {"sliding_window": 10, "head_dim": 16,
                       "layer_types": ["full_attention", "sliding_attention"]}),
        ("smollm3", {"use_sliding_window": True, "sliding_window": 6, "num_hidden_layers": 4}),
        ("smollm3", {"use_sliding_window": False, "sliding_window": 6}),
        ("olmo3", {"sliding_window": 5}),
        ("cohere2", {"sliding_window": 5, "num_hidden_layers": 5}),
        ("olmo3", {"layer_types": ["full_attention", "sliding_attention"] * 2}),
        ("llama", {}),
    ],
)  # fmt: skip
def test_layer_windows_as_transformers_reads_them(kind: str, overrides: dict[str, Any]) -> None:
    """Which layers have which window, from the config transformers saves (its own
    ``layer_types`` included) and from the same config without ``layer_types`` (older files
    on the Hub): each equals the windows transformers' modules use for that config."""
    hf = build_hf_model(kind, **overrides)
    saved = hf.config.to_dict() | {"architectures": [_arch(kind)]}
    assert ModelConfig.from_hf(saved).layer_windows == _module_windows(kind, hf)
    saved.pop("layer_types", None)
    given = {k: v for k, v in overrides.items() if k != "layer_types"}
    derived = build_hf_model(kind, **given) if "layer_types" in overrides else hf
    assert ModelConfig.from_hf(saved).layer_windows == _module_windows(kind, derived)


def _module_windows(kind: str, hf: Any) -> tuple[int, ...]:
    """The window each attention module of ``hf`` passes to its kernel (Mistral's and
    Mixtral's read the config's; Qwen2-MoE's have the attribute only when windowed)."""
    every = hf.config.sliding_window if kind in ("mistral", "mixtral") else None
    want = [getattr(layer.self_attn, "sliding_window", every) or 0 for layer in hf.model.layers]
    return tuple(want) if any(want) else ()


def test_context_is_not_capped_at_the_window() -> None:
    d = hf_config("mistral", sliding_window=12, max_position_embeddings=4096).to_dict()
    c = ModelConfig.from_hf(d | {"architectures": ["MistralForCausalLM"]})
    assert c.max_position_embeddings == 4096 and c.sliding_window == 12
    assert c.layer_windows == (12, 12)


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": "4k"}, "sliding_window"),
        ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]},
         "layer_types"),
        ({"use_sliding_window": True, "sliding_window": 8,
          "layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
        ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": -1},
         "max_window_layers"),
    ],
)  # fmt: skip
def test_bad_window_fields_name_the_field(fields: dict[str, Any], where: str) -> None:
    d = hf_config("qwen2").to_dict() | {"architectures": ["Qwen2ForCausalLM"]}
    d.pop("layer_types", None)
    d.update(fields)
    if "use_sliding_window" not in fields:
        d["architectures"] = ["MistralForCausalLM"]
    with pytest.raises(ModelLoadError, match=where):
        ModelConfig.from_hf(d)


def test_model_config_validates_windows() -> None:
    base: dict[str, Any] = dict(
        architecture="MistralForCausalLM", vocab_size=10, hidden_size=8, intermediate_size=8,
        num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, max_position_embeddings=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match="need a sliding_window"):
        ModelConfig(**base, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        ModelConfig(**base | {"num_layers": 3}, sliding_window=4,
                    layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        ModelConfig(**base, sliding_window=-3)
    c = ModelConfig(**base, sliding_window=4, layer_types=("full_attention", "sliding_attention"))
    assert c.layer_windows == (0, 4)
    assert ModelConfig(**base, sliding_window=4).layer_windows == ()  # no sliding layer


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = build_hf_model(request.param, seed=50)
    return hf, save_hf_folder(hf, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("window_kv", ["hybrid", "full"])
@pytest.mark.parametrize("cfg", FAMILY_CONFIGS)
def test_engine_greedy_equals_transformers(
    windowed: Any, cfg: dict[str, Any], window_kv: str
) -> None:
    """Each config with the windowed layers' K/V in window slots (hybrid) and kept for every
    token (full)."""
    hf, folder = windowed
    eng = engine_greedy_equals_transformers(hf, folder, cfg | {"window_kv": window_kv}, GREEDY)
    assert eng.model.config.layer_windows  # the windows reached the engine
    assert isinstance(eng.kv_pool, HybridKVPool) == (window_kv == "hybrid")
    if cfg.get("cascade") == "on":
        cascade = eng.runner._cascade
        if all(eng.model.config.layer_windows):  # every layer windowed: cascade never pays
            assert cascade is None and eng.stats().cascade_steps == 0
        else:
            assert cascade is not None and eng.stats().cascade_steps > 0
            # full: the windowed layers go around the shared-prefix levels; hybrid: the
            # cascade wraps the full layers' backend only
            assert (eng.runner._cascade_inner._banded is not None) == (window_kv == "full")


def test_config_json_without_layer_types_loads(windowed: Any, tmp_path: Path) -> None:
    """A checkpoint whose config.json predates ``layer_types`` gets the windows transformers
    derives for it (the same ones, but for Ministral, whose default windows every layer)."""
    hf, folder = windowed
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("layer_types", None)
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    derived = type(hf.config)(**{k: v for k, v in cfg.items() if k != "architectures"})
    # (Mistral's config has no layer_types: its window is every layer's)
    types = getattr(derived, "layer_types", None) or ["sliding_attention"] * len(hf.model.layers)
    want = tuple(derived.sliding_window if t == "sliding_attention" else 0 for t in types)
    assert load_model(tmp_path).config.layer_windows == want


def test_startup_log_names_the_windows(windowed: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, folder = windowed
    with caplog.at_level(logging.INFO, logger="radixkv.engine.engine"):
        eng = Engine(load_model(folder), page_size=4, num_pages=64)
    windows = eng.model.config.layer_windows
    w = max(windows)
    assert f"sliding window {w} on {sum(1 for x in windows if x)} of them" in caplog.text
