"""``radixkv serve-ray`` argument handling (no Ray is started)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from radixkv.cluster.cli import add_arguments, config_from_args, main
from radixkv.engine.config import EngineConfig, parse_bytes


def _parse(*argv: str) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_flags_map_onto_the_cluster_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-alice-123": "alice"}))
    cfg = config_from_args(
        _parse(
            "--replicas", "3", "--num-pages", "64", "--page-size", "8", "--router", "default",
            "--imbalance-abs", "7", "--api-keys", str(keys), "--replica-cpus", "0.5",
            "--strict-api", "--metrics-require-key",
        )
    )  # fmt: skip
    assert cfg.replicas == 3 and cfg.router == "default" and cfg.page_size == 8
    assert cfg.engine_kwargs["num_pages"] == 64 and "kv_cache_memory" not in cfg.engine_kwargs
    assert cfg.router_kwargs["imbalance_abs"] == 7 and cfg.replica_num_cpus == 0.5
    assert cfg.server_kwargs["api_keys"] == {"key-alice-123": "alice"}
    # the replicas' servers get what `radixkv serve` gets: the file to re-read, the API switches
    assert cfg.server_kwargs["api_keys_file"] == str(keys)
    assert cfg.server_kwargs["strict_api"] is True
    assert cfg.server_kwargs["metrics_require_key"] is True
    plain = config_from_args(_parse("--replicas", "2")).server_kwargs
    assert not {"api_keys", "api_keys_file", "strict_api", "metrics_require_key"} & plain.keys()


@pytest.mark.parametrize(
    "argv", [["--replicas", "0"], ["--imbalance-rel", "0.5"], ["--min-match-ratio", "2"]]
)
def test_bad_flags_exit_with_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_radixkv_cli_hands_serve_ray_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from radixkv.cli import main as radixkv_main

    with pytest.raises(SystemExit) as e:
        radixkv_main(["serve-ray", "--help"])
    assert e.value.code == 0
    assert "--replicas" in capsys.readouterr().out


def _non_default_engine_argv() -> tuple[list[str], EngineConfig]:
    """Flags setting every EngineConfig field to a value other than its default, generated from
    the fields (so a new field is covered without touching this test), and the config they mean."""
    argv: list[str] = []
    want: dict[str, object] = {}
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if meta["flag"] is not None:
            argv.append(meta["flag"])
            want[f.name] = not f.default
            continue
        if meta.get("nargs"):  # a list flag (lora_modules): one item
            argv += ["--" + f.name.replace("_", "-"), "name=/x"]
            want[f.name] = ["name=/x"]
            continue
        if meta["choices"]:
            value: object = next(c for c in meta["choices"] if c != f.default)
        elif meta["type"] is parse_bytes:
            value = (f.default or 0) + (1 << 20)
        elif (meta["type"] or type(f.default)) is int:
            value = (f.default or 0) + 3
        elif (meta["type"] or type(f.default)) is float:
            value = f.default + 0.5
        else:
            value = "cpu" if f.name == "device" else "x"
        argv += ["--" + f.name.replace("_", "-"), str(value)]
        want[f.name] = value
    return argv, EngineConfig(**want)  # type: ignore[arg-type]


def test_serve_and_serve_ray_expose_the_same_engine_flags() -> None:
    """Both command lines declare every EngineConfig field, with the same defaults and the same
    meaning, so they cannot drift; serve-ray ships what was asked to its replicas."""
    from radixkv.server import add_serve_arguments

    serve = add_serve_arguments(argparse.ArgumentParser())
    ray = add_arguments(argparse.ArgumentParser())
    assert EngineConfig.from_cli_args(serve.parse_args([])) == EngineConfig()
    assert EngineConfig.from_cli_args(ray.parse_args([])) == EngineConfig()
    argv, want = _non_default_engine_argv()
    assert EngineConfig.from_cli_args(serve.parse_args(argv)) == want
    ray_args = ray.parse_args([*argv, "--served-model-name", "tiny-fleet"])
    assert EngineConfig.from_cli_args(ray_args) == want
    cfg = config_from_args(ray_args)
    assert EngineConfig(**cfg.engine_kwargs) == want
    assert cfg.server_kwargs["model_name"] == "tiny-fleet"
