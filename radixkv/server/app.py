"""The OpenAI-compatible HTTP app: ``build_app(engine, config) -> FastAPI``.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (OpenAI's
Responses API, server/responses.py; all three with SSE streaming), GET and DELETE
/v1/responses/{id} (stored responses, per tenant), POST /tokenize,
POST /detokenize, GET /v1/models, GET /health, GET /metrics, POST /reset_prefix_cache (admin
key), and with ``config.allow_runtime_lora_updating`` POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's); a request's ``model`` is the served model or a loaded LoRA
adapter's name. SGLang's native API (POST /generate, GET /get_model_info, /get_server_info,
/health_generate, POST /flush_cache) is served too (server/native.py), SGLang's POST
/v1/score (server/score.py) and Anthropic's POST /v1/messages (server/messages.py). GET
/openapi.json
describes the OpenAI-style routes
(server/openapi.py) and GET /docs renders it. Paths are exact: a trailing slash is 404 (no
redirect, whose Location would echo the request's Host header).

The app drives an :class:`~radixkv.engine.async_engine.AsyncEngine` it is given; it does not
own it unless ``owns_engine=True`` (then the app's shutdown shuts the engine down). The same app
object can be mounted elsewhere (e.g. a Ray Serve ingress): everything it needs lives in
``app.state.radixkv``. KV events (``config.kv_events``) are published between the app's startup
and shutdown (ASGI lifespan).

Request contract: on a server without API keys, a request whose Host is not the server's is
refused first (400, server/hosts.py); a request is authenticated (401), then its body, which
must be typed JSON (415), is read with a size limit (413) and a deadline (408,
server/timeouts.py), decoded (400, nesting at most ``protocol.MAX_JSON_DEPTH`` deep; unknown
fields are ignored unless ``config.strict_api``), admitted against its tenant's limits (429,
server/tenant_limits.py) and ``max_queue`` (503), and only then submitted. Errors raised before a route runs are answered in the route's own shape
(Anthropic's on /v1/messages, SGLang's on the native routes); an unexpected exception is a 500
logged once, and the keep-alive connection stays usable (errors.ContainErrors). Whatever happens afterwards (finish,
error, client disconnect, server shutdown), its engine requests are finished or aborted, so
their locks and pages are released. A client that disconnects while still sending its body is
a closed connection: nothing is logged as an error, and it is counted in
``radixkv_client_closed_requests_total{phase="body"}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from radixkv import __version__
from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import openapi as OA
from radixkv.server import protocol as P
from radixkv.server.config import ServerConfig
from radixkv.server.errors import (
    APIError,
    ContainErrors,
    ErrorShapes,
    http_error,
    unhandled_error,
)
from radixkv.server.hosts import HostCheck
from radixkv.server.messages import MESSAGES_PATHS, add_messages_routes, anthropic_error
from radixkv.server.native import add_native_routes
from radixkv.server.native_render import native_error
from radixkv.server.responses import DeletedResponse, ResponsesRequest
from radixkv.server.score import add_score_route
from radixkv.server.state import ServerState
from radixkv.server.timeouts import BodyDeadline
from radixkv.server.transport import ClientGone, read_body

__all__ = ["ServerState", "build_app"]

_OK = b'{"status":"ok"}'


def build_app(
    engine: AsyncEngine, config: ServerConfig | None = None, *, owns_engine: bool = False
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine``; see the module doc for the contract."""
    config = config or ServerConfig()
    st = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await st.startup()
        try:
            yield
        finally:
            await st.shutdown(shutdown_engine=owns_engine)

    app = FastAPI(
        title="radixkv",
        version=__version__,
        description="OpenAI-compatible API of a radixkv engine (prefix-cached inference).",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
        redirect_slashes=False,
    )
    app.state.radixkv = st
    shapes = ErrorShapes()  # filled in below, once the routes with their own shapes exist

    def respond(path: str, err: APIError) -> Response:
        st.metrics.count_http_error(err.status)
        return shapes.response(path, err)

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return respond(request.url.path, exc)

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return respond(request.url.path, http_error(request, exc))

    async def on_unhandled(request: Request, exc: Exception) -> Response:
        return respond(request.url.path, unhandled_error(request, exc))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(ClientGone, _client_gone(st))
    # the last resort (Starlette's, outermost), for an error in the middleware below itself
    app.add_exception_handler(Exception, on_unhandled)
    # outermost first: contain errors; refuse foreign Hosts; time out slow bodies
    app.add_middleware(BodyDeadline, timeout=config.body_timeout_s)
    app.add_middleware(
        HostCheck,
        allowed_hosts=config.allowed_hosts,
        active=lambda: not st.auth.enabled,
        reject=respond,
    )
    app.add_middleware(ContainErrors, handler=on_unhandled)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = OA.complete(
                doc,
                strict=config.strict_api,
                vocab_size=st.vocab_size,
                priorities=engine.info().schedule_policy == "priority",
            )
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.post(
        "/v1/completions",
        openapi_extra=OA.generation_route(
            "CompletionRequest", "CompletionResponse", "CompletionResponse", "Text completion"
        ),
    )
    async def completions(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        req = st.decode(await read_body(request, config.max_body_bytes), P.CompletionRequest)
        lora = st.check_model(req.model)
        max_tokens = req.engine_max_tokens()  # echo's max_tokens=0 runs one token
        prompts = [st.prompt_ids(p) for p in req.prompts()]
        for ids in prompts:
            st.check_length(ids, max_tokens, "prompt")
        st.check_prompt_logprobs_start(req, prompts)
        params = st.sampling_params(req, max_tokens)
        return await st.run(request, principal, req, prompts, params, chat=False, lora=lora)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=OA.generation_route(
            "ChatCompletionRequest",
            "ChatCompletionResponse",
            "ChatCompletionChunk",
            "Chat completion (messages rendered with the model's chat template)",
        ),
    )
    async def chat_completions(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        req = st.decode(await read_body(request, config.max_body_bytes), P.ChatCompletionRequest)
        return await st.run_chat(request, principal, req)

    @app.post("/v1/responses", openapi_extra=OA.responses_route())
    async def create_response(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        body = await read_body(request, config.max_body_bytes)
        return await st.respond(request, principal, st.decode(body, ResponsesRequest))

    @app.get(
        "/v1/responses/{response_id}",
        openapi_extra=OA.simple_route("A stored response", "ResponseObject", 401, 404),
    )
    async def get_response(request: Request, response_id: str) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        stored = st.responses.get(principal.tenant, response_id)
        if stored is None:
            raise _response_not_found(response_id)
        return Response(P.encode(stored.response), media_type="application/json")

    @app.delete(
        "/v1/responses/{response_id}",
        openapi_extra=OA.simple_route("Forget a stored response", "DeletedResponse", 401, 404),
    )
    async def delete_response(request: Request, response_id: str) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        if not st.responses.delete(principal.tenant, response_id):
            raise _response_not_found(response_id)
        return Response(P.encode(DeletedResponse(response_id)), media_type="application/json")

    @app.post(
        "/tokenize",
        openapi_extra=OA.json_route(
            "TokenizeRequest",
            "TokenizeResponse",
            "The token ids a prompt or chat messages become (vLLM's /tokenize)",
        ),
    )
    async def tokenize(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        req = st.decode(await read_body(request, config.max_body_bytes), P.TokenizeRequest)
        st.check_model(req.model)
        ids = st.prompt_ids(req.prompt) if req.prompt is not None else st.chat_ids(req)
        strs = [st.token_texts(t) for t in ids] if req.return_token_strs else None
        body = P.TokenizeResponse(len(ids), st.max_context, ids, strs)
        return Response(P.encode(body), media_type="application/json")

    @app.post(
        "/detokenize",
        openapi_extra=OA.json_route(
            "DetokenizeRequest", "DetokenizeResponse", "The text of token ids (vLLM's /detokenize)"
        ),
    )
    async def detokenize(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        req = st.decode(await read_body(request, config.max_body_bytes), P.DetokenizeRequest)
        st.check_model(req.model)
        text = st.tokenizer.decode(st.check_ids(req.tokens, "tokens"))
        return Response(P.encode(P.DetokenizeResponse(text)), media_type="application/json")

    @app.get(
        "/v1/models",
        openapi_extra=OA.simple_route(
            "The served model and its loaded LoRA adapters", "ModelList", 401
        ),
    )
    async def models(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        return Response(P.encode(st.model_list()), media_type="application/json")

    if config.allow_runtime_lora_updating:  # off: the routes do not exist (404)

        @app.post(
            "/v1/load_lora_adapter",
            openapi_extra=OA.text_route(
                "LoadLoRAAdapterRequest",
                "Load a PEFT LoRA adapter folder on the server's machine and serve it as the "
                "model lora_name (vLLM's; --allow-runtime-lora-updating)",
                "Success: LoRA adapter '<name>' added successfully.",
                400,
                401,
                413,
                500,
            ),
        )
        async def load_lora_adapter(request: Request) -> Response:
            st.auth.authenticate(request.headers.get("authorization"))
            body = await read_body(request, config.max_body_bytes)
            message = await st.load_lora(st.decode(body, P.LoadLoRAAdapterRequest))
            return Response(message, media_type="text/plain")

        @app.post(
            "/v1/unload_lora_adapter",
            openapi_extra=OA.text_route(
                "UnloadLoRAAdapterRequest",
                "Stop serving a LoRA adapter and drop its cached KV (vLLM's; "
                "--allow-runtime-lora-updating)",
                "Success: LoRA adapter '<name>' removed successfully.",
                400,
                401,
                404,
                413,
                500,
            ),
        )
        async def unload_lora_adapter(request: Request) -> Response:
            st.auth.authenticate(request.headers.get("authorization"))
            body = await read_body(request, config.max_body_bytes)
            message = await st.unload_lora(st.decode(body, P.UnloadLoRAAdapterRequest))
            return Response(message, media_type="text/plain")

    @app.get("/health", openapi_extra=OA.simple_route("Liveness of the engine loop", "Status", 503))
    async def health() -> Response:
        try:
            await asyncio.wait_for(engine.stats(), timeout=10)
        except Exception as e:
            raise APIError(503, f"engine unavailable: {type(e).__name__}: {e}") from None
        return Response(_OK, media_type="application/json")

    metrics_errors = (401,) if config.metrics_key_required else ()

    @app.get(
        "/metrics",
        openapi_extra=OA.simple_route(
            "Prometheus metrics", None, *metrics_errors, media=CONTENT_TYPE_LATEST.split(";")[0]
        ),
    )
    async def metrics(request: Request) -> Response:
        if config.metrics_key_required:
            st.auth.require_key(request.headers.get("authorization"), "/metrics")
        st.last_stats = await asyncio.wait_for(engine.stats(), timeout=10)
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post(
        "/reset_prefix_cache",
        openapi_extra=OA.simple_route(
            "Drop every unlocked prefix-cache entry (admin key)", "Status", 401, 403
        ),
    )
    async def reset_prefix_cache(request: Request) -> Response:
        st.auth.require_admin(request.headers.get("authorization"))
        await engine.reset_prefix_cache()
        return Response(_OK, media_type="application/json")

    before = len(app.routes)
    add_native_routes(app, st)  # SGLang's /generate, /get_model_info, ... (server/native.py)
    shapes.add((getattr(r, "path", "") for r in app.routes[before:]), native_error)
    add_score_route(app, st)  # SGLang's /v1/score (server/score.py)
    add_messages_routes(app, st)  # Anthropic's /v1/messages (server/messages.py)
    shapes.add(MESSAGES_PATHS, anthropic_error)
    return app


def _response_not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found",
        param="response_id",
        code="response_not_found",
    )


def _client_gone(st: ServerState) -> Any:
    """A client that went away while sending its request body: a closed connection. Nobody
    reads the answer; 499 (nginx's "client closed request") is what access logs show."""

    async def handler(request: Request, exc: Exception) -> Response:
        st.metrics.count_client_closed("body")
        return Response(status_code=499)

    return handler
