"""``radixkv serve``: its flags, and the app + config they build.

The engine flags are generated from :class:`~radixkv.engine.config.EngineConfig`'s fields
(``radixkv serve-ray`` declares the same ones the same way); the rest configure the HTTP
server (:class:`~radixkv.server.config.ServerConfig`) and uvicorn.
"""

from __future__ import annotations

import argparse
import os

from fastapi import FastAPI

from radixkv.engine.config import EngineConfig
from radixkv.server.config import ServerConfig


def add_server_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of :class:`ServerConfig` that ``radixkv serve`` and ``radixkv serve-ray`` share."""
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the model's name)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="JSON object mapping API key -> tenant name (radixkv serve re-reads it when it "
        "changes or on SIGHUP)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXKV_ADMIN_KEY"),
        help="key for admin endpoints such as /reset_prefix_cache (default: $RADIXKV_ADMIN_KEY)",
    )
    p.add_argument("--max-queue", type=int, default=1024, help="max sequences in flight before 503")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    return p


def server_config_from_args(
    args: argparse.Namespace,
    *,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
) -> ServerConfig:
    """The ServerConfig of the flags :func:`add_server_arguments` declared (plus KV events)."""
    from radixkv.server.auth import load_api_keys

    return ServerConfig(
        model_name=args.served_model_name,
        api_keys=load_api_keys(args.api_keys) if args.api_keys else None,
        api_keys_file=args.api_keys,
        admin_key=args.admin_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        strict_api=getattr(args, "strict_api", False),
        metrics_require_key=getattr(args, "metrics_require_key", False),
    )


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``radixkv serve`` flags on ``p`` (a subparser)."""
    p.add_argument("--model", default="radixkv-tiny", help="model name or local HF folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_server_arguments(p)
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557",
    )
    p.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="ZMQ ROUTER endpoint for replay",
    )
    p.add_argument(
        "--strict-api",
        action="store_true",
        help="reject unknown request fields with 400 (default: ignore them, warning once per "
        "field name)",
    )
    p.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="GET /metrics needs an API key or the admin key",
    )
    p.add_argument("--log-level", default="info")
    EngineConfig.add_cli_arguments(p)
    return p


def build_from_args(args: argparse.Namespace) -> tuple[FastAPI, ServerConfig]:
    """(app, config) for parsed ``serve`` arguments; the app owns its engine. Raises
    ValueError on bad settings (the configs are checked before the model is loaded)."""
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.server.app import build_app

    engine_config = EngineConfig.from_cli_args(args)
    config = server_config_from_args(
        args, kv_events=args.kv_events, kv_events_replay=args.kv_events_replay
    )
    engine = AsyncEngine(args.model, config=engine_config)
    return build_app(engine, config, owns_engine=True), config


def cli_entry(args: argparse.Namespace) -> int:
    """Run ``radixkv serve`` until interrupted (SIGINT/SIGTERM: graceful shutdown); returns the
    exit code. Raises ValueError on bad settings (before anything is loaded where possible)."""
    import uvicorn

    app, _ = build_from_args(args)
    install_sighup_reload(app)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def install_sighup_reload(app: FastAPI) -> bool:
    """SIGHUP makes the app re-read its API key file before the next request (key changes are
    also picked up without it, from the file's mtime). Main thread only; returns whether the
    handler was installed (not on platforms without SIGHUP, nor off the main thread)."""
    import signal
    import threading

    if not hasattr(signal, "SIGHUP") or threading.current_thread() is not threading.main_thread():
        return False
    auth = app.state.radixkv.auth
    signal.signal(signal.SIGHUP, lambda signum, frame: auth.request_reload())
    return True


def main(argv: list[str] | None = None) -> int:
    """``radixkv serve`` / ``python -m radixkv.server``: parse flags, serve; bad settings exit 2."""
    parser = add_serve_arguments(argparse.ArgumentParser(prog="radixkv serve"))
    args = parser.parse_args(argv)
    try:
        return cli_entry(args)
    except ValueError as e:
        parser.error(str(e))  # prints usage + the message, exits 2
        raise AssertionError("unreachable") from e
