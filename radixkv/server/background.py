"""Run an ASGI app on uvicorn in a background thread (tests, notebooks, embedding).

``with BackgroundServer(app) as srv: srv.url`` binds 127.0.0.1 on a free port *before* starting
(so the port is known and cannot be taken in between), starts uvicorn in its own thread and event
loop, waits until it serves, and on exit asks it to shut down gracefully (which runs the app's
lifespan shutdown) and joins the thread. Connections that take longer than ``header_timeout``
seconds to send a request's headers are closed (server/timeouts.py); by default a radixkv app's
``ServerConfig.header_timeout_s``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class BackgroundServer:
    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        startup_timeout: float = 30.0,
        header_timeout: float | None = None,
    ) -> None:
        from radixkv.server.timeouts import header_timeout_protocol

        if header_timeout is None:
            state = getattr(getattr(app, "state", None), "radixkv", None)
            header_timeout = state.config.header_timeout_s if state is not None else 30.0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_level=log_level,
            lifespan="on",
            timeout_graceful_shutdown=5,
            http=header_timeout_protocol(header_timeout),
        )
        self.server = uvicorn.Server(config)
        self._startup_timeout = startup_timeout
        self._thread = threading.Thread(target=self._run, name="radixkv-uvicorn", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as e:
            self._error = e

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server failed to start: {self._error!r}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
