"""Wait for a Ray Serve application to be RUNNING, with a deadline and a reason when it is not.

``serve.run`` blocks until the application runs, however long that takes: a replica that can
never be scheduled (too few CPUs, a missing GPU) keeps it waiting forever, saying nothing to
the caller. :func:`wait_until_running` polls the application's status instead, reports
progress, fails at once when Ray gives up on a deployment (DEPLOY_FAILED: a replica's
constructor raised), and fails with Ray's own explanation (such as "Resources required for
each replica: {'CPU': 1.0}, total resources available: ...") when the deadline passes.

Ray's status objects are read through :func:`app_state` into plain :class:`AppState` values,
so the waiting logic is tested without Ray.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TIMEOUT_FLAG = "--ready-timeout"


class DeploymentNotReady(RuntimeError):
    """The application failed to deploy, or was not RUNNING before the deadline (or the
    cluster to deploy it on does not answer)."""


def check_reachable(address: str, *, timeout_s: float = 10.0) -> None:
    """Raise DeploymentNotReady unless something accepts connections at a ``host:port``
    address (a Ray cluster's GCS). ``ray.init`` retries an unreachable address for many
    minutes, so a mistyped ``--address`` would otherwise look like a hang. Other address forms
    ("auto", "ray://...") are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "://" in address:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise DeploymentNotReady(
            f"no Ray cluster answers at {address} (--address): {e.strerror or e}"
        ) from e


@dataclass(frozen=True, kw_only=True)
class DeploymentState:
    """One deployment of an application, as Ray reports it.

    Attributes:
        status: Ray's DeploymentStatus name (UPDATING, HEALTHY, UNHEALTHY, DEPLOY_FAILED, ...).
        message: Ray's explanation (empty when all is well).
        replicas: replica state name (RUNNING, STARTING, ...) -> how many replicas are in it.
    """

    status: str
    message: str = ""
    replicas: Mapping[str, int] = field(default_factory=dict)

    def describe(self, name: str) -> str:
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.replicas.items()))
        line = f"{name} {self.status}" + (f" ({counts})" if counts else "")
        return line + (f": {self.message}" if self.message else "")


@dataclass(frozen=True, kw_only=True)
class AppState:
    """An application's status (Ray's ApplicationStatus name), message and deployments."""

    status: str
    message: str = ""
    deployments: Mapping[str, DeploymentState] = field(default_factory=dict)

    def describe(self) -> str:
        """What is still in the way: the deployments not HEALTHY, or the app's own message."""
        parts = [
            d.describe(name)
            for name, d in sorted(self.deployments.items())
            if d.status != "HEALTHY"
        ]
        if self.message and not parts:
            parts.append(self.message)
        return f"{self.status}" + (f"; {'; '.join(parts)}" if parts else "")


def _name(x: Any) -> str:
    """An enum member's value ("RUNNING"), or the string itself."""
    return str(getattr(x, "value", x))


def app_state(serve_status: Any, app_name: str) -> AppState | None:
    """The AppState of ``app_name`` in a ``serve.status()`` result (None while Ray does not list
    it yet)."""
    app = serve_status.applications.get(app_name)
    if app is None:
        return None
    deployments = {
        name: DeploymentState(
            status=_name(d.status),
            message=d.message or "",
            replicas={_name(s): int(n) for s, n in (d.replica_states or {}).items()},
        )
        for name, d in (app.deployments or {}).items()
    }
    return AppState(status=_name(app.status), message=app.message or "", deployments=deployments)


def wait_until_running(
    get_state: Callable[[], AppState | None],
    *,
    app_name: str,
    timeout_s: float | None,
    poll_s: float = 0.5,
    progress_every_s: float = 30.0,
    on_progress: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Poll ``get_state`` until the application is RUNNING; returns the seconds it took.

    Raises DeploymentNotReady at once when it is DEPLOY_FAILED, and when ``timeout_s`` (None:
    no deadline) passes first; the message carries Ray's explanation of what is in the way.
    ``on_progress`` gets a line every ``progress_every_s`` while waiting.
    """
    start = clock()
    last_progress = start
    while True:
        state = get_state()
        waited = clock() - start
        if state is not None and state.status == "RUNNING":
            return waited
        what = state.describe() if state is not None else "not listed by Ray Serve yet"
        if state is not None and state.status == "DEPLOY_FAILED":
            raise DeploymentNotReady(f"application {app_name!r} failed to deploy: {what}")
        if timeout_s is not None and waited >= timeout_s:
            raise DeploymentNotReady(
                f"application {app_name!r} was not ready after {waited:.0f} s "
                f"({TIMEOUT_FLAG} {timeout_s:g}): {what}"
            )
        if on_progress is not None and clock() - last_progress >= progress_every_s:
            last_progress = clock()
            on_progress(f"waiting for {app_name!r} ({waited:.0f} s): {what}")
        sleep(poll_s)
