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
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixkv.engine.async_engine import AsyncEngine, QueueFull
from radixkv.engine.params import SamplingParams
from radixkv.server import protocol as P
from radixkv.server import render as R
from radixkv.server.auth import Authenticator, Principal
from radixkv.server.config import ServerConfig
from radixkv.server.driver import Submission, until_disconnect
from radixkv.server.errors import (
    APIError,
    api_error_handler,
    bad_request,
    http_exception_handler,
    unhandled_exception_handler,
)
from radixkv.server.metrics import ServerMetrics

log = logging.getLogger("radixkv.server")


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


class SSEResponse(StreamingResponse):
    """A stream that always notices a client disconnect (even while no token is flowing),
    always closes its iterator, and always runs ``cleanup`` exactly once."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: dict[str, str],
        cleanup: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            content, headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        )
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        listen = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, listen):
                t.cancel()
            results = await asyncio.gather(stream, listen, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self._cleanup()
        err = results[0]
        if isinstance(err, Exception) and not isinstance(err, OSError):
            log.error("stream failed: %r", err)


class ServerState:
    """Everything the routes share (``app.state.radixkv``)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.auth = Authenticator(config.api_keys, config.admin_key)
        self.last_stats: Any = None
        self.metrics = ServerMetrics(stats_fn=lambda: self.last_stats)
        core = engine.engine
        self.tokenizer = core.tokenizer
        self.max_context: int = core.max_context
        self.vocab_size: int = core.vocab_size
        self.model_name = config.model_name or str(getattr(core.model, "name", "radixkv"))
        self.created = int(time.time())
        self.in_flight = 0  # sequences admitted and not yet released
        self.publisher: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (set at startup)

    # ------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        """Bind the KV event publisher (if configured) and start listening to the cache.

        Called by the app's lifespan; a host that does not run ASGI lifespan events (some
        ingress wrappers) calls it itself, in the loop that will serve requests."""
        self.loop = asyncio.get_running_loop()
        if self.config.kv_events is not None and self.publisher is None:
            from radixkv.server.kv_events import KVEventPublisher

            device = getattr(self.engine.engine.kv_pool, "device", None)
            self.publisher = KVEventPublisher(
                self.config.kv_events,
                topic=self.config.kv_events_topic,
                replay_endpoint=self.config.kv_events_replay,
                medium="GPU" if getattr(device, "type", "cpu") == "cuda" else "CPU",
            )
            self.engine.engine.cache.add_listener(self.publisher.listener)

    async def shutdown(self, *, shutdown_engine: bool = False) -> None:
        """Stop publishing (flushing what is queued) and optionally shut the engine down."""
        if self.publisher is not None:
            with contextlib.suppress(ValueError):
                self.engine.engine.cache.remove_listener(self.publisher.listener)
            self.publisher.close()
            self.publisher = None
        if shutdown_engine:
            await self.engine.shutdown()

    # ------------------------------------------------------------ request preparation
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise bad_request("prompt encodes to no tokens", "prompt")
            return ids
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )
        return prompt

    def chat_ids(self, req: P.ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                req.template_messages(), add_generation_prompt=True
            )
        except ValueError as e:  # ChatTemplateError is a ValueError
            raise bad_request(f"chat template rejected the messages: {e}", "messages") from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise bad_request("messages render to no tokens", "messages")
        return ids

    def check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        total = len(ids) + max_tokens
        if total > self.max_context:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param,
                code="context_length_exceeded",
            )

    @staticmethod
    def sampling_params(
        req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                max_tokens=max_tokens,
                stop=tuple(P.stop_list(req.stop)),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                seed=req.seed,
            )
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None

    # ------------------------------------------------------------ running a request
    async def run(
        self,
        request: Request,
        principal: Principal,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        chat: bool,
    ) -> Response:
        seqs = len(prompts) * params.n
        if self.in_flight + seqs > self.config.max_queue:
            raise APIError(
                503,
                f"Server is at capacity ({self.in_flight} sequences in flight, max_queue="
                f"{self.config.max_queue}); retry later",
                code="queue_full",
                headers={"retry-after": "1"},
            )
        self.in_flight += seqs
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        namespace = principal.namespace(req.cache_salt)
        sub = Submission(self.engine, prompts, params, namespace=namespace, request_id=rid)
        released = False
        handed_off = False  # True once an SSEResponse owns the release

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await sub.close()
                self.in_flight -= seqs

        try:
            created = int(time.time())
            if req.stream:
                err = await _until(sub.wait_started(), request.receive)
                if err is not None:
                    raise _engine_error(err)
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                body = self._stream(
                    sub, rid, req.model, created, chat=chat, include_usage=include_usage
                )
                response: Response = SSEResponse(
                    body, headers=R.cache_headers(sub, rid), cleanup=release
                )
                handed_off = True  # the response owns the submission from here on
                return response
            err = await _until(sub.wait_finished(), request.receive)
            if err is not None:
                raise _engine_error(err)
            for i in range(len(sub.prompts)):
                R.take_deltas(sub, i, self.metrics)
            payload = (R.chat_response if chat else R.completion_response)(
                sub, rid, req.model, created
            )
            return Response(
                P.encode(payload), media_type="application/json", headers=R.cache_headers(sub, rid)
            )
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        finally:
            if not handed_off:
                await release()

    async def _stream(
        self,
        sub: Submission,
        rid: str,
        model: str,
        created: int,
        *,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        chunk = R.chat_chunk if chat else R.completion_chunk
        if chat:
            yield R.chat_role_chunk(rid, model, created, sub.params.n)
        for i in range(len(sub.prompts)):
            deltas = R.take_deltas(sub, i, self.metrics)
            if deltas:
                yield chunk(rid, model, created, deltas)
        while not sub.finished:
            i, item = await sub.next_event()
            if isinstance(item, BaseException):
                yield R.sse(_engine_error(item).body_struct())
                break
            deltas = R.take_deltas(sub, i, self.metrics)
            if deltas:
                yield chunk(rid, model, created, deltas)
        if include_usage:
            yield R.usage_chunk(sub, rid, model, created, chat)
        yield R.SSE_DONE


async def _until(work: Awaitable[Any], receive: Receive) -> Any:
    """Await ``work`` unless the client disconnects first (then cancel it, raise ClientGone)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.create_task(until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone
    return task.result()


def _engine_error(err: BaseException) -> APIError:
    if isinstance(err, QueueFull):
        return APIError(503, str(err), code="queue_full", headers={"retry-after": "1"})
    if isinstance(err, ValueError | TypeError):
        return bad_request(str(err))
    log.error("request failed in the engine: %r", err)
    return APIError(500, f"The engine failed while serving the request: {err}")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise APIError(
                    413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes"
                )
        except ValueError:
            raise bad_request("Invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
