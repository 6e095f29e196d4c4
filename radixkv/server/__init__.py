"""OpenAI-compatible HTTP server for radixkv (``radixkv serve``).

``build_app(engine, config)`` gives the app (reusable elsewhere, e.g. behind Ray Serve);
``cli_entry(args)`` is what ``radixkv serve`` runs; ``add_serve_arguments(parser)`` declares its
flags. Imports are lazy so ``import radixkv.server`` stays cheap.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["BackgroundServer", "ServerConfig", "add_serve_arguments", "build_app", "cli_entry"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from radixkv.server.app import build_app

        return build_app
    if name == "ServerConfig":
        from radixkv.server.config import ServerConfig

        return ServerConfig
    if name == "BackgroundServer":
        from radixkv.server.runner import BackgroundServer

        return BackgroundServer
    raise AttributeError(f"module 'radixkv.server' has no attribute {name!r}")


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``radixkv serve`` flags on ``p`` (a subparser)."""
    p.add_argument("--model", default="radixkv-tiny", help="model name or local HF folder")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the model's name)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="JSON object mapping API key -> tenant name",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXKV_ADMIN_KEY"),
        help="key for admin endpoints such as /reset_prefix_cache (default: $RADIXKV_ADMIN_KEY)",
    )
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
    p.add_argument("--max-queue", type=int, default=1024, help="max sequences in flight before 503")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="0 disables chunking")
    p.add_argument(
        "--prefill-budget",
        choices=["tokens", "attention"],
        default="tokens",
        help="what the step budget counts: new tokens, or new tokens plus their attention to "
        "past ones (splits steps whose new tokens attend to long cached prefixes)",
    )
    p.add_argument(
        "--cascade",
        choices=["auto", "on", "off"],
        default="auto",
        help="shared-prefix (cascade) decode attention: when it pays, always, or never",
    )
    p.add_argument("--schedule-policy", choices=["lpm", "fcfs"], default="lpm")
    p.add_argument("--eviction-policy", default="lru")
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info")
    return p


def build_from_args(args: argparse.Namespace) -> Any:
    """(app, config) for parsed ``serve`` arguments; the app owns its engine."""
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.server.app import build_app
    from radixkv.server.auth import load_api_keys
    from radixkv.server.config import ServerConfig

    api_keys = load_api_keys(args.api_keys) if args.api_keys else None
    config = ServerConfig(
        model_name=args.served_model_name,
        api_keys=api_keys,
        admin_key=args.admin_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
    )
    engine = AsyncEngine(
        args.model,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory=args.kv_cache_memory,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_budget=args.prefill_budget,
        cascade=args.cascade,
        schedule_policy=args.schedule_policy,
        eviction_policy=args.eviction_policy,
        enable_prefix_cache=not args.disable_prefix_cache,
        attention_backend=args.attention_backend,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
    )
    return build_app(engine, config, owns_engine=True), config


def cli_entry(args: argparse.Namespace) -> int:
    """Run ``radixkv serve`` until interrupted (SIGINT/SIGTERM: graceful shutdown); returns the
    exit code. Raises ValueError on bad settings (before anything is loaded where possible)."""
    import uvicorn

    app, _ = build_from_args(args)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``radixkv serve`` / ``python -m radixkv.server``: parse flags, serve; bad settings exit 2."""
    parser = add_serve_arguments(argparse.ArgumentParser(prog="radixkv serve"))
    args = parser.parse_args(argv)
    try:
        return cli_entry(args)
    except ValueError as e:
        parser.error(str(e))  # prints usage + the message, exits 2
        raise AssertionError("unreachable") from e
