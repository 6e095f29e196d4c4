"""Read timeouts for half-sent requests: a client that opens a connection and sends its headers
or its body slowly, or never finishes, must not hold a connection (and its buffers) forever.

- Headers: :func:`header_timeout_protocol` is uvicorn's HTTP protocol with a deadline from the
  moment a connection is ready for a request (opened, or the previous response sent) until
  that request's headers are complete; past it the connection is closed (with a 408 when part
  of a request had arrived). uvicorn has no such limit of its own (its keep-alive timeout only
  runs while no byte arrives), and an ASGI app never sees a request before its headers end, so
  this lives in the protocol: ``radixkv serve`` and :class:`~radixkv.server.background.
  BackgroundServer` run with it.
- Body: :class:`BodyDeadline` is ASGI middleware giving the body until ``timeout`` seconds after
  the request's headers arrived; a body still incomplete then ends the request with 408
  (:class:`BodyTimeout`, an APIError, so each route answers it in its own error shape) and the
  connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixkv.server.errors import APIError

_TIMEOUT_TEXT = b"Request headers not received in time\n"
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT)
)


class BodyTimeout(APIError):
    """The request body did not arrive within the body timeout (408; the connection closes)."""

    def __init__(self, timeout: float) -> None:
        super().__init__(
            408,
            f"Request body not received within {timeout:g} s",
            code="request_timeout",
            headers={"connection": "close"},
        )


class BodyDeadline:
    """ASGI middleware: the app's reads of the request body raise :class:`BodyTimeout` once
    ``timeout`` seconds have passed since the request arrived. Reads after the whole body has
    come (a streaming route listening for the client's disconnect) have no deadline."""

    def __init__(self, app: ASGIApp, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout(self.timeout) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


class _HeaderDeadline:
    """Mixed into a uvicorn HTTP protocol (h11 or httptools): the header deadline (module doc).

    Between requests the deadline is armed; it closes the connection only if no request is in
    progress when it fires (``cycle`` is uvicorn's current request/response cycle), so a
    request that takes long to answer is never cut by it."""

    header_timeout: float
    _header_timer: asyncio.TimerHandle | None = None
    _bytes_since_armed = False
    # uvicorn's protocol attributes this mixin reads
    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._bytes_since_armed = False
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline)

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is in progress: its headers came in time
        if self._bytes_since_armed:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        self._bytes_since_armed = True
        super().data_received(data)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        self._arm_header_deadline()  # first: uvicorn may start a pipelined request in there
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def header_timeout_protocol(timeout: float, base: type[asyncio.Protocol] | None = None) -> type:
    """uvicorn's HTTP protocol class (``base``, default uvicorn's choice: httptools when
    installed, else h11) with the header deadline of ``timeout`` seconds; pass it to uvicorn as
    ``http=``."""
    if timeout <= 0:
        raise ValueError(f"header timeout must be > 0, got {timeout}")
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(
        f"HeaderTimeout{base.__name__}", (_HeaderDeadline, base), {"header_timeout": timeout}
    )
