"""The OpenAI-compatible HTTP app: ``build_app(engine, config) -> FastAPI``.

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
GET /health, GET /metrics, POST /reset_prefix_cache (admin key).

The app drives an :class:`~radixkv.engine.async_engine.AsyncEngine` it is given; it does not
own it unless ``owns_engine=True`` (then the app's shutdown shuts the engine down). The same app
object can be mounted elsewhere (e.g. a Ray Serve ingress): everything it needs lives in
``app.state.radixkv``. KV events (``config.kv_events``) are published between the app's startup
and shutdown (ASGI lifespan).

Request contract: a request is authenticated first (401), then its body is read with a size
limit (413), decoded strictly (400), admitted against ``max_queue`` (503), and only then
submitted. Whatever happens afterwards (finish, error, client disconnect, server shutdown), its
engine requests are finished or aborted, so their locks and pages are released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from radixkv.engine.async_engine import AsyncEngine
from radixkv.server import protocol as P
from radixkv.server.config import ServerConfig
from radixkv.server.errors import (
    APIError,
    api_error_handler,
    bad_request,
    http_exception_handler,
    unhandled_exception_handler,
)
from radixkv.server.state import ServerState
from radixkv.server.transport import read_body

__all__ = ["ServerState", "build_app"]


def _decode(body: bytes, kind: type[P.R]) -> P.R:
    try:
        return P.decode_request(body, kind)
    except P.ProtocolError as e:
        raise bad_request(e.message, e.param) from None


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
        title="radixkv", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.radixkv = st
    app.add_exception_handler(APIError, _counting(st, api_error_handler))
    app.add_exception_handler(StarletteHTTPException, _counting(st, http_exception_handler))
    app.add_exception_handler(Exception, _counting(st, unhandled_exception_handler))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        req = _decode(await read_body(request, config.max_body_bytes), P.CompletionRequest)
        st.check_model(req.model)
        assert req.max_tokens is not None  # defaulted in the Struct
        prompts = [st.prompt_ids(p) for p in req.prompts()]
        for ids in prompts:
            st.check_length(ids, req.max_tokens, "prompt")
        params = st.sampling_params(req, req.max_tokens)
        return await st.run(request, principal, req, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        principal = st.auth.authenticate(request.headers.get("authorization"))
        req = _decode(await read_body(request, config.max_body_bytes), P.ChatCompletionRequest)
        st.check_model(req.model)
        ids = st.chat_ids(req)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, st.max_context - len(ids))
            if max_tokens < 1:
                st.check_length(ids, 1, "messages")
        st.check_length(ids, max_tokens, "messages")
        params = st.sampling_params(req, max_tokens)
        return await st.run(request, principal, req, [ids], params, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        body = P.ModelList([P.ModelCard(st.model_name, st.created)])
        return Response(P.encode(body), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(engine.stats(), timeout=10)
        except Exception as e:
            raise APIError(503, f"engine unavailable: {type(e).__name__}: {e}") from None
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        st.last_stats = await asyncio.wait_for(engine.stats(), timeout=10)
        return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        st.auth.require_admin(request.headers.get("authorization"))
        await engine.reset_prefix_cache()
        return Response(b'{"status":"ok"}', media_type="application/json")

    return app


def _counting(st: ServerState, handler: Callable[[Request, Exception], Awaitable[Response]]) -> Any:
    async def wrapped(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        st.metrics.http_errors.labels(status=str(response.status_code)).inc()
        return response

    return wrapped
