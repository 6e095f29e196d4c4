"""vLLM / SGLang spellings accepted as aliases (Python keywords and flags), `python -m radixkv`,
`radixkv --version`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import pytest

import radixkv
from radixkv.cli import main as radixkv_main
from radixkv.cluster.cli import add_arguments as add_serve_ray_arguments
from radixkv.engine.config import EngineConfig, canonical_options
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.server import add_serve_arguments, build_from_args
from radixkv.server.background import BackgroundServer

MODEL = "radixkv-tiny-random"


def _serve(*argv: str) -> argparse.Namespace:
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", "radixkv-tiny", *argv]
    )


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(MODEL, num_pages=128)


def test_generate_and_stream_take_sampling_params(engine: Engine) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=5, seed=7, ignore_eos=True)
    a = engine.generate("def f(x):", params, use_tqdm=False)
    b = engine.generate("def f(x):", sampling_params=params, use_tqdm=False)
    assert a[0].token_ids == b[0].token_ids and len(a[0].token_ids) == 5
    streamed = list(engine.stream("def f(x):", sampling_params=params))
    assert streamed[-1].token_ids == a[0].token_ids
    with pytest.raises(TypeError, match="params and sampling_params"):
        engine.generate("x", params, sampling_params=params)
    with pytest.raises(TypeError, match="params and sampling_params"):
        next(engine.stream("x", params, sampling_params=params))
    engine.check_invariants()


def test_keyword_aliases() -> None:
    assert canonical_options({"enable_prefix_caching": False}) == {"enable_prefix_cache": False}
    assert canonical_options({"context_length": 9, "page_size": 4}) == {
        "max_model_len": 9,
        "page_size": 4,
    }
    with pytest.raises(TypeError, match="enable_prefix_caching is another name"):
        Engine(MODEL, enable_prefix_caching=False, enable_prefix_cache=False)
    eng = Engine(MODEL, enable_prefix_caching=False, context_length=64, num_pages=16)
    assert eng.config.enable_prefix_cache is False and eng.max_context == 64
    prompt, params = list(range(40, 80)), SamplingParams(max_tokens=2)
    eng.generate(prompt, params, use_tqdm=False)
    assert eng.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0  # cache off
    on = Engine(MODEL, num_pages=16)
    on.generate(prompt, params, use_tqdm=False)
    assert on.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 32
    with pytest.raises(ValueError, match="exceeds the model's context length 64"):
        eng.generate([1] * 60, SamplingParams(max_tokens=5), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len 20000 exceeds the model's context length"):
        Engine(MODEL, max_model_len=20000, num_pages=16)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=0)


def test_chunked_prefill_minus_one_is_off() -> None:
    cfg = EngineConfig(chunked_prefill_size=-1, max_prefill_tokens=300)
    assert cfg.chunk_size is None and cfg.step_prefill_budget == 300
    assert EngineConfig(chunked_prefill_size=0).chunk_size is None
    assert EngineConfig(chunked_prefill_size=64).chunk_size == 64
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=-2)
    args = _serve("--chunked-prefill-size", "-1", "--max-prefill-tokens", "300")
    eng = Engine(MODEL, config=EngineConfig.from_cli_args(args), num_pages=64)
    assert eng.scheduler.chunk_size is None and eng.scheduler.step_budget == 300
    out = eng.generate(list(range(32, 132)) * 4, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].finish_reason == "length"
    eng.check_invariants()


@pytest.mark.parametrize("make", [add_serve_arguments, add_serve_ray_arguments])
def test_flag_aliases(make: object) -> None:
    parser = make(argparse.ArgumentParser())  # type: ignore[operator]
    a = parser.parse_args(
        ["--model-path", "org/m", "--disable-radix-cache", "--context-length", "512"]
    )
    b = parser.parse_args(["--model", "org/m", "--disable-prefix-cache", "--max-model-len", "512"])
    assert a.model == b.model == "org/m"
    assert EngineConfig.from_cli_args(a) == EngineConfig.from_cli_args(b)
    cfg = EngineConfig.from_cli_args(a)
    assert cfg.enable_prefix_cache is False and cfg.max_model_len == 512
    help_text = parser.format_help()
    for flag in ("--model-path", "--disable-radix-cache", "--context-length", "--api-key "):
        assert flag in help_text


def test_serve_ray_ships_the_model_source_to_the_ingress() -> None:
    from radixkv.cluster.cli import config_from_args

    parser = add_serve_ray_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model-path", "org/m", "--revision", "v2", "--tokenizer", "org/tok"]
    )
    cfg = config_from_args(args)
    assert cfg.model == "org/m" and cfg.engine_kwargs["revision"] == "v2"
    assert cfg.tokenizer_source == {"revision": "v2", "tokenizer": "org/tok"}


def test_eviction_policy_has_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert _serve("--eviction-policy", "lfu").eviction_policy == "lfu"
    with pytest.raises(SystemExit) as e:
        _serve("--eviction-policy", "fifo")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'fifo'" in err and "'lru'" in err


def test_single_api_key(tmp_path: Path) -> None:
    app, config = build_from_args(_serve("--api-key", "one-key-123", "--num-pages", "64"))
    assert config.api_keys == {"one-key-123": "default"}
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "radixkv-tiny", "prompt": "hello", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        bad = {"Authorization": "Bearer other-key-456"}
        assert http.post("/v1/completions", json=body, headers=bad).status_code == 401
        good = {"Authorization": "Bearer one-key-123"}
        assert http.post("/v1/completions", json=body, headers=good).status_code == 200
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"file-key-1234": "team"}))
    with pytest.raises(ValueError, match="--api-key and --api-keys"):
        build_from_args(_serve("--api-key", "one-key-123", "--api-keys", str(keys)))
    with pytest.raises(ValueError, match="at least 8 characters"):
        build_from_args(_serve("--api-key", "short"))


def test_api_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixkv.server.cli import server_config_from_args

    monkeypatch.setenv("RADIXKV_API_KEY", "env-key-1234")
    assert server_config_from_args(_serve()).api_keys == {"env-key-1234": "default"}
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"file-key-1234": "team"}))
    # an explicit --api-keys file wins over the environment's single key
    assert server_config_from_args(_serve("--api-keys", str(keys))).api_keys == {
        "file-key-1234": "team"
    }
    monkeypatch.delenv("RADIXKV_API_KEY")
    assert server_config_from_args(_serve()).api_keys is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        radixkv_main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixkv {radixkv.__version__}"
