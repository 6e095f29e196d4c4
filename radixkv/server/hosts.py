"""The Host header check that keeps a keyless server from being driven by web pages.

A server without API keys answers anyone who reaches it. On localhost that would be only this
machine's programs, but for DNS rebinding: a web page on ``evil.example`` has its name re-resolved
to 127.0.0.1, and the browser, which still sees one origin, lets the page send requests to the
local server and read the answers. Such requests carry ``Host: evil.example``. So, while the
server has no keys, a request is served only if its Host names the address it came in on
(the connection's local address), a loopback name (``localhost``, ``127.0.0.1``, ``::1``), or
a name of ``allowed_hosts`` (``radixkv serve --allowed-hosts``; ``*`` allows any); others get
400. With keys the check is off: a page cannot guess a key. (A request without a Host header,
HTTP/1.0, is served: browsers always send one.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from radixkv.server.errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(value: str) -> str:
    """The name part of a Host header value (or of an ``--allowed-hosts`` entry): lower case,
    without the port, the brackets of an IPv6 address, or a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        end = value.find("]")
        return value[1:end] if end > 0 else value
    if value.count(":") == 1:  # name:port (an unbracketed IPv6 address has several colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


class HostCheck:
    """ASGI middleware: the module doc's check. ``active()`` says whether it applies now (the
    server has no keys); ``reject(path, error)`` is the response to a refused request (the
    path's own error shape)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_hosts: Iterable[str],
        active: Callable[[], bool],
        reject: Callable[[str, APIError], Response],
    ) -> None:
        self.app = app
        names = {host_name(h) for h in allowed_hosts}
        self.any_host = "*" in names
        self.allowed = frozenset(names | LOOPBACK_NAMES)
        self.active = active
        self.reject = reject

    def allows(self, host: str | None, server: tuple[str, int | None] | None) -> bool:
        """Whether a request with this Host header, arriving on ``server`` (its connection's
        local address), is served."""
        if host is None or self.any_host:
            return True
        name = host_name(host)
        return name in self.allowed or (server is not None and name == host_name(server[0]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.active():
            host = Headers(scope=scope).get("host")
            if host is not None and not self.allows(host, scope.get("server")):
                err = APIError(
                    400,
                    f"Host {host[:100]!r} is not this server's name: a server without API keys "
                    "answers requests for localhost, its own address, or a name given with "
                    "--allowed-hosts (this guards against DNS rebinding)",
                    param="host",
                    code="invalid_host",
                )
                await self.reject(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
