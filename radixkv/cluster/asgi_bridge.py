"""Run an ASGI app (the server's FastAPI app) on a request forwarded over a Ray handle.

Ray Serve's HTTP proxy hands a replica only the request's scope; the body arrives later, so a
request router in front of an ``@serve.ingress`` deployment never sees the prompt. radixkv's
cluster therefore puts a thin ingress in front (it reads the body and hashes the prompt for the
router) and forwards each request, body included, as a :class:`ForwardedRequest` to the engine
replica, which runs the server's unmodified app on it with :func:`call_app` and streams back
the ASGI messages it sends (``http.response.start``, then ``http.response.body`` chunks).

Disconnects: when the consumer of :func:`call_app` stops early (the client left, or Ray
cancelled the call), the app's next ``receive()`` returns ``http.disconnect``, which is how the
server's app notices a gone client and aborts its engine requests (releasing their pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("radixkv.cluster")

Message = dict[str, Any]
_DONE = object()
_CLEANUP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it (plain data, pickled by Ray)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode("latin-1"),
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": self.client,
            "server": ("127.0.0.1", 0),
            "state": {},
        }


def error_messages(status: int, message: str, code: str | None = None) -> list[Message]:
    """An OpenAI-shaped JSON error response as ASGI messages."""
    import json

    body = json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ).encode()
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        },
        {"type": "http.response.body", "body": body, "more_body": False},
    ]


async def call_app(
    app: Any, req: ForwardedRequest, *, extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> AsyncIterator[Message]:
    """Run ``app`` on ``req``; yield the response's ASGI messages (``extra_headers`` are added to
    the start message). Always ends with a final body message, even if the app crashed."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False
    extra = list(extra_headers)

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: Message) -> None:
        await out.put(msg)

    task = asyncio.ensure_future(app(req.scope(), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(_DONE))
    started = finished = False
    try:
        while not finished:
            msg = await out.get()
            if msg is _DONE:
                break
            kind = msg.get("type")
            if kind == "http.response.start":
                started = True
                msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            elif kind == "http.response.body":
                finished = not msg.get("more_body", False)
            else:
                continue
            yield msg
        if not finished:  # the app ended (or crashed) without completing its response
            err = task.exception() if task.done() and not task.cancelled() else None
            if err is not None:
                log.error("app failed: %r", err)
            if not started:
                for m in error_messages(500, f"internal error: {err!r}"):
                    yield m
            else:
                yield {"type": "http.response.body", "body": b"", "more_body": False}
    finally:
        gone.set()  # the app sees a disconnect if it is still running: it aborts and releases
        if not task.done():
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), _CLEANUP_TIMEOUT_S)
            if not task.done():
                task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved


class Lifespan:
    """Drive an ASGI app's lifespan (startup/shutdown) outside a web server."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._outbox: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[Any] | None = None

    async def startup(self) -> None:
        async def receive() -> Message:
            return await self._inbox.get()

        async def send(msg: Message) -> None:
            await self._outbox.put(msg)

        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self._app(scope, receive, send))
        await self._inbox.put({"type": "lifespan.startup"})
        msg = await self._outbox.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"app startup failed: {msg.get('message', msg)}")

    async def shutdown(self) -> None:
        if self._task is None:
            return
        task, self._task = self._task, None
        await self._inbox.put({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(self._outbox.get(), _CLEANUP_TIMEOUT_S)
        finally:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, _CLEANUP_TIMEOUT_S)
