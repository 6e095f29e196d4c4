"""HTTP plumbing: a size-limited read of a JSON body, disconnect-aware waiting, and an SSE
response that always notices a vanished client and always releases what the request holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixkv.server.errors import APIError, bad_request

log = logging.getLogger("radixkv.server")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (or while sending its request)."""


class SSEResponse(StreamingResponse):
    """A stream that always notices a client disconnect (even while no token is flowing),
    always closes its iterator, and always runs ``cleanup`` exactly once; ``on_client_gone``
    runs when the client left before the stream ended."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        headers: dict[str, str],
        cleanup: Callable[[], Awaitable[None]],
        on_client_gone: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(
            content, headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        )
        self._cleanup = cleanup
        self._on_client_gone = on_client_gone

    def with_body(
        self, rewrite: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
    ) -> SSEResponse:
        """The same stream in another wire format (another API's events): a response over
        ``rewrite(this body)`` that takes over this one's headers, cleanup and disconnect
        callback; this one must not be sent."""
        body: AsyncIterator[bytes] = self.body_iterator  # type: ignore[assignment]
        headers = {k: v for k, v in self.headers.items() if k.startswith("x-")}
        return SSEResponse(
            rewrite(body), headers=headers, cleanup=self._cleanup,
            on_client_gone=self._on_client_gone,
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.create_task(self.stream_response(send))
        listen = asyncio.create_task(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
            if stream not in done and self._on_client_gone is not None:
                self._on_client_gone()
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


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has disconnected (ASGI ``http.disconnect``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def wait_or_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
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


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type value is JSON's: ``application/json`` or ``application/*+json``,
    any parameters (``; charset=utf-8``) aside."""
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def require_json(request: Request) -> None:
    """415 unless the request says its body is JSON. Besides naming a client's mistake, this
    keeps web pages out: a browser sends a cross-site request without asking the server first
    only when its body is text/plain, a form, or has no type; JSON needs the server's consent,
    which this server never gives (it sends no CORS headers)."""
    value = request.headers.get("content-type")
    if not is_json_media_type(value):
        got = f"got {value[:100]!r}" if value else "the request has none"
        raise APIError(
            415,
            f"Content-Type must be application/json ({got})",
            param="content-type",
            code="unsupported_media_type",
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The JSON request body: 415 unless its Content-Type is JSON's (:func:`require_json`), 413
    as soon as it is known to exceed ``limit`` bytes. A client that disconnects while sending
    it raises ClientGone (a closed connection, not a server error); one too slow to send it
    gets 408 (server/timeouts.py)."""
    require_json(request)
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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"Request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)
