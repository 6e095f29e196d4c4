"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError`` (or one of the helpers below); the app's exception handlers turn it,
Starlette's HTTPException (404/405 from routing) and any unexpected exception into this shape (or
the path's own, :class:`ErrorShapes`), so a client always gets JSON it can parse and the server
keeps serving; :class:`ContainErrors` keeps the connection open after an unexpected error.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("radixkv.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class APIError(Exception):
    """An error to return to the client with ``status`` and an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body_struct(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def body(self) -> bytes:
        return msgspec.json.encode(self.body_struct())

    def response(self) -> Response:
        return Response(
            self.body(),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str = "Invalid or missing API key") -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's routing errors (404, 405) as APIErrors with a message naming the path. A
    405's ``Allow`` lists every method of every route on the path (Starlette names the first
    route's only: GET and DELETE on /v1/responses/{id} are two routes)."""
    status = exc.status_code
    headers = dict(exc.headers or {})
    if status == 404:
        path = request.url.path
        message = f"Not found: {request.method} {path}"
        bare = path.rstrip("/")
        if bare != path and any(getattr(r, "path", None) == bare for r in request.app.routes):
            message += f" (paths take no trailing slash: {bare})"
    elif status == 405:
        message = f"Method {request.method} not allowed on {request.url.path}"
        allowed = set()
        for route in request.app.routes:
            if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE:
                allowed |= route.methods or set()
        if allowed:
            headers["Allow"] = ", ".join(sorted(allowed))
    else:
        message = str(exc.detail)
    return APIError(status, message, headers=headers)


def unhandled_error(request: Request, exc: Exception) -> APIError:
    """A bug: logged with its traceback (once), answered as a 500 naming only its type."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}")


ErrorRenderer = Callable[[APIError], Response]


class ErrorShapes:
    """Which error body each path answers with: OpenAI's unless a path was given another
    (Anthropic's on /v1/messages, SGLang's on the native routes), so that an error raised
    outside a route (a bad Host, a 404, a 500) reads as the route's own errors do."""

    def __init__(self) -> None:
        self._by_path: dict[str, ErrorRenderer] = {}

    def add(self, paths: Iterable[str], render: ErrorRenderer) -> None:
        for path in paths:
            self._by_path[path] = render

    def response(self, path: str, err: APIError) -> Response:
        return self._by_path.get(path, APIError.response)(err)


class ContainErrors:
    """ASGI middleware: an exception that escapes a route before its response started is
    answered (``handler``) and goes no further. Starlette's own last-resort handler re-raises
    it after answering, so the ASGI server logs a second traceback and drops the keep-alive
    connection, and the client's next pooled request fails; here the connection stays usable.
    An exception after the response started still propagates (the stream is cut)."""

    def __init__(
        self, app: ASGIApp, handler: Callable[[Request, Exception], Awaitable[Response]]
    ) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            response = await self.handler(Request(scope, receive), exc)
            await response(scope, receive, send)
