"""``radixkv serve`` argument handling: flags -> engine + ServerConfig -> a working app."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from radixkv.server import add_serve_arguments, build_from_args, main
from radixkv.server.runner import BackgroundServer


def _parse(*argv: str) -> argparse.Namespace:
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults() -> None:
    a = _parse()
    assert (a.model, a.host, a.port, a.page_size, a.max_queue) == (
        "radixkv-tiny",
        "127.0.0.1",
        8000,
        16,
        1024,
    )
    assert a.api_keys is None and a.kv_events is None and not a.disable_prefix_cache


def test_flags_build_a_working_app(tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"cli-key-aaaa": "team-a"}))
    args = _parse(
        "--api-keys", str(keys), "--admin-key", "cli-admin-key", "--num-pages", "256",
        "--page-size", "8", "--served-model-name", "tiny-served", "--max-queue", "7",
    )  # fmt: skip
    app, config = build_from_args(args)
    assert config.max_queue == 7 and config.model_name == "tiny-served"
    st = app.state.radixkv
    assert st.engine.engine.page_size == 8 and st.engine.engine.pool.num_pages == 256
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"model": "tiny-served", "prompt": "hello " * 10, "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 401
        auth = {"Authorization": "Bearer cli-key-aaaa"}
        r = http.post("/v1/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["model"] == "tiny-served"
        admin = {"Authorization": "Bearer cli-admin-key"}
        assert http.post("/reset_prefix_cache", headers=admin).status_code == 200


def test_bad_flags(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="API keys"):
        build_from_args(_parse("--api-keys", str(bad)))
    with pytest.raises(ValueError, match="max_queue"):
        build_from_args(_parse("--max-queue", "0"))
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
