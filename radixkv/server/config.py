"""Server configuration (frozen, validated on construction)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from radixkv.server.reasoning import REASONING_PARSERS
from radixkv.server.tenant_limits import TenantLimitValues
from radixkv.server.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How ``build_app`` serves an engine.

    Attributes:
        model_name: the model id clients must send (and /v1/models lists); None = the engine's.
        api_keys: API key -> tenant name. None or empty: no auth, one anonymous tenant.
        api_keys_file: the JSON file the keys come from (read here when ``api_keys`` is None);
            re-read whenever it changes or on SIGHUP, so a revoked key stops working without a
            restart.
        admin_key: key for admin endpoints (POST /reset_prefix_cache); None disables them.
        max_queue: most sequences (each of a request's ``n`` samples counts) admitted and not yet
            finished; a request that would exceed it gets 503 and nothing is submitted.
        max_body_bytes: request bodies larger than this get 413.
        default_max_tokens: chat completions without max_tokens generate up to this many
            tokens (capped by the context that is left).
        kv_events: ZMQ endpoint to bind a KV event PUB socket on (e.g. tcp://127.0.0.1:5557).
        kv_events_replay: optional ZMQ endpoint for the replay ROUTER socket.
        kv_events_topic: topic frame of every KV event message.
        strict_api: reject unknown request fields with 400. Off (default), they are ignored and
            logged once per field name, as vLLM does, since real clients send fields a server
            may not know.
        metrics_require_key: GET /metrics and GET /health_generate need a configured key (a
            tenant's or the admin key). None (default): they do whenever API keys are
            configured (:attr:`metrics_key_required`). True needs keys or an admin key.
        tool_call_parser: how tool calls are read out of chat replies (``hermes``,
            ``llama3_json``, ``mistral``, ``pythonic`` or ``qwen3_coder``, server/tool_calls.py)
            for requests with ``tools``; None: replies stay text.
        reasoning_parser: how a thinking model's reasoning is read out of chat replies
            (``qwen3`` or ``deepseek_r1``, server/reasoning.py) into ``message.reasoning``;
            None: replies stay text. With it, a structured-output constraint on a reply whose
            prompt opens a reasoning block applies from the block's end on.
        responses_store_size: responses kept for ``previous_response_id`` and ``GET
            /v1/responses/{id}`` (in memory, all tenants together, least recently used dropped
            first; server/response_store.py); 0 keeps none.
        allow_runtime_lora_updating: serve vLLM's POST /v1/load_lora_adapter and
            /v1/unload_lora_adapter. Off by default (the routes do not exist): loading reads
            any folder the server process can read, named by whoever holds an API key.
        allowed_hosts: Host header names a server without API keys answers besides
            localhost, the loopback addresses and the address a request came in on; others
            get 400 (server/hosts.py: DNS rebinding). ``("*",)`` allows any Host.
        header_timeout_s: seconds a connection may take to send a request's headers (from
            when it opened or its previous response was sent); then it is closed. Applied by
            the HTTP server: ``radixkv serve`` and BackgroundServer (server/timeouts.py).
        body_timeout_s: seconds from a request's headers to the end of its body; a body still
            incomplete then is a 408 and the connection is closed.
        tenant_max_prompts: most sequences (prompts x ``n``) in one request of a tenant (API
            key); more is a 429 (server/tenant_limits.py).
        tenant_max_waiting: most sequences of one tenant waiting for their first output; a
            request that would exceed it is a 429.
        tenant_max_queued_tokens: most prompt tokens of one tenant's waiting sequences; a
            request that would exceed it is a 429.
            For each of the three, None (default): half of ``max_queue`` for the first two and
            no limit for the tokens when the API keys name two tenants or more, no limit with
            one tenant (no keys, or one key), so a single-user server never meets them
            (:meth:`tenant_limits`). How many of a tenant's sequences *run* at once is the
            engine's ``tenant_max_running``.
    """

    model_name: str | None = None
    api_keys: Mapping[str, str] | None = None
    api_keys_file: str | None = None
    admin_key: str | None = None
    max_queue: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    default_max_tokens: int = 512
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = "kv-events"
    strict_api: bool = False
    metrics_require_key: bool | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    responses_store_size: int = 1024
    allow_runtime_lora_updating: bool = False
    allowed_hosts: tuple[str, ...] = ()
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    tenant_max_prompts: int | None = None
    tenant_max_waiting: int | None = None
    tenant_max_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.model_name is not None and not self.model_name:
            raise ValueError("model_name must be non-empty when given")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay needs kv_events")
        if self.metrics_require_key and not (self.api_keys or self.api_keys_file or self.admin_key):
            raise ValueError("metrics_require_key needs API keys or an admin key to check")
        if isinstance(self.allowed_hosts, str) or not all(
            isinstance(h, str) and h.strip() for h in self.allowed_hosts
        ):
            raise ValueError(f"allowed_hosts must be a tuple of names, got {self.allowed_hosts!r}")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))  # a list, say
        for name in ("tenant_max_prompts", "tenant_max_waiting", "tenant_max_queued_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def tenant_limits(self, num_tenants: int) -> TenantLimitValues:
        """The per-tenant limits in force while the API keys name ``num_tenants`` tenants
        (the unset ones: half of ``max_queue`` for prompts and waiting sequences with two
        tenants or more, else none)."""
        shared = num_tenants >= 2
        half = max(1, self.max_queue // 2) if shared else None
        return TenantLimitValues(
            max_prompts=self.tenant_max_prompts if self.tenant_max_prompts is not None else half,
            max_waiting=self.tenant_max_waiting if self.tenant_max_waiting is not None else half,
            max_queued_tokens=self.tenant_max_queued_tokens,
        )

    @property
    def metrics_key_required(self) -> bool:
        """Whether GET /metrics and /health_generate need a key: ``metrics_require_key``, or
        when it is None, whether API keys are configured (a server with keys keeps its load
        and its engine's health to its tenants)."""
        if self.metrics_require_key is not None:
            return self.metrics_require_key
        return bool(self.api_keys or self.api_keys_file)
