"""``radixkv serve`` argument handling: flags -> engine + ServerConfig -> a working app."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from radixkv.server import add_serve_arguments, build_from_args, main
from radixkv.server.background import BackgroundServer
from radixkv.server.cli import server_config_from_args


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
    assert (a.prefill_budget, a.cascade, a.chunked_prefill_size) == ("tokens", "auto", 2048)


def test_hardening_flags() -> None:
    """Issue 47's server flags: defaults, and what they set."""
    config = server_config_from_args(_parse())
    assert (config.header_timeout_s, config.body_timeout_s) == (30.0, 60.0)
    assert config.allowed_hosts == () and config.metrics_require_key is None
    assert not config.metrics_key_required  # no keys
    config = server_config_from_args(
        _parse(
            "--allowed-hosts", "models.internal, gpu-box", "--header-timeout", "5",
            "--body-timeout", "7.5", "--api-key", "cli-key-bbbb",
        )
    )  # fmt: skip
    assert config.allowed_hosts == ("models.internal", "gpu-box")
    assert (config.header_timeout_s, config.body_timeout_s) == (5.0, 7.5)
    assert config.metrics_key_required  # keys: on by default
    opened = server_config_from_args(
        _parse("--api-key", "cli-key-bbbb", "--no-metrics-require-key")
    )
    assert opened.metrics_require_key is False and not opened.metrics_key_required
    with pytest.raises(ValueError, match="body_timeout_s"):
        server_config_from_args(_parse("--body-timeout", "0"))


def test_scheduling_flags_reach_the_engine() -> None:
    args = _parse(
        "--num-pages", "64", "--prefill-budget", "attention", "--cascade", "off",
        "--chunked-prefill-size", "0", "--max-prefill-tokens", "300",
    )  # fmt: skip
    app, _ = build_from_args(args)
    eng = app.state.radixkv.engine.engine
    assert eng.config.prefill_budget == "attention" and eng.config.chunked_prefill_size == 0
    assert eng.cascade_planner.mode == "off"
    assert eng.scheduler.step_budget == 300  # chunking off: max_prefill_tokens bounds a step
    with pytest.raises(SystemExit):
        _parse("--cascade", "sometimes")


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


def test_main_reports_bad_settings(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["--api-keys", str(bad)])
    assert e.value.code == 2
    assert "API keys" in capsys.readouterr().err


def test_radixkv_serve_process(tmp_path) -> None:
    """The real command (as ``python -m radixkv serve``, SGLang's ``--model-path``): start, log
    the engine's startup summary through uvicorn's handler, answer, shut down gracefully on
    SIGINT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "radixkv",
        "serve",
        "--model-path",
        "radixkv-tiny",
        "--port",
        str(port),
        "--num-pages",
        "128",
        "--log-level",
        "info",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        body = {"model": "radixkv-tiny", "prompt": "hi", "max_tokens": 2}
        assert (
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code
            == 200
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=30)[0].decode()
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0].decode()
    assert proc.returncode == 0, out
    # the radixkv logger prints through uvicorn's default handler, like uvicorn's own lines
    summary = next(line for line in out.splitlines() if "radixkv engine:" in line)
    assert summary.startswith("INFO:")
    for part in ("model radixkv-tiny", "in float32", "attention torch (auto:", "128 pages x 16"):
        assert part in summary, (part, summary)
    assert "Uvicorn running on" in out
