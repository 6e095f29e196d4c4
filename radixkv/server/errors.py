"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError`` (or one of the helpers below); the app's exception handlers turn it,
Starlette's HTTPException (404/405 from routing) and any unexpected exception into this shape, so a
client always gets JSON it can parse and the server keeps serving.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger("radixkv.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
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


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        path = request.url.path
        message = f"Not found: {request.method} {path}"
        bare = path.rstrip("/")
        if bare != path and any(getattr(r, "path", None) == bare for r in request.app.routes):
            message += f" (paths take no trailing slash: {bare})"
    elif status == 405:
        message = f"Method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(status, message, headers=dict(exc.headers or {})).response()


async def unhandled_exception_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, f"Internal server error: {type(exc).__name__}").response()
