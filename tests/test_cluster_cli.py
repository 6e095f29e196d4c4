"""``radixkv serve-ray`` argument handling (no Ray is started)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from radixkv.cluster.cli import add_arguments, config_from_args, main


def _parse(*argv: str) -> argparse.Namespace:
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_flags_map_onto_the_cluster_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-alice-123": "alice"}))
    cfg = config_from_args(
        _parse(
            "--replicas", "3", "--num-pages", "64", "--page-size", "8", "--router", "default",
            "--imbalance-abs", "7", "--api-keys", str(keys), "--replica-cpus", "0.5",
        )
    )  # fmt: skip
    assert cfg.replicas == 3 and cfg.router == "default" and cfg.page_size == 8
    assert cfg.engine_kwargs["num_pages"] == 64 and "kv_cache_memory" not in cfg.engine_kwargs
    assert cfg.router_kwargs["imbalance_abs"] == 7 and cfg.replica_num_cpus == 0.5
    assert cfg.server_kwargs["api_keys"] == {"key-alice-123": "alice"}


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
