"""Operator calls aimed at every engine replica of a fleet, not at the one the router picks.

A request through the ingress reaches one replica. A few operations concern the whole fleet
(``POST /reset_prefix_cache``, ``POST /update_weights_from_disk``, per-replica stats), so they
are fanned out: the replicas are
listed by their Ray actor names (the Serve controller's record, not a router's possibly lagging
view) and one call is pinned to each (``pin_replica``, which both cluster routers honour).

Each call is made as a request of its own (:func:`as_own_request`): made from inside the
ingress, the calls would otherwise all carry the HTTP request's id, and Ray Serve's router
then delivers only one of them (the others wait forever).

Every answer names the replica that produced it. A call that raises (the replica died), times
out, or is answered by another replica (the pinned one was not, or no longer, among the
handle's candidates, so the router fell back to routing it normally) fails *for that replica*:
the others still count, and the report says which failed and why. A call answered by another
replica is first asked again a few times (a router's candidate list can lag under load), so
the methods fanned out must be idempotent (a reset, a weight load, a stats read are).

Importing this module needs no Ray (the listing and the fresh request ids import it when
called, and the fan-out works without it), so the fan-out and the report are testable with a
stand-in handle.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from radixkv.cluster.live import forget_prefixes

log = logging.getLogger("radixkv.cluster")

RESET_PATH = "/reset_prefix_cache"
WEIGHTS_PATH = "/update_weights_from_disk"  # SGLang's; every replica reads the checkpoint

T = TypeVar("T")

# A pinned call answered by another replica is asked again this many times in all, waiting
# PIN_RETRY_WAIT_S x the attempt number between (within the call's timeout)
PIN_ATTEMPTS = 4
PIN_RETRY_WAIT_S = 0.25


def replica_actor_names(app_name: str, deployment: str = "RadixKVReplica") -> list[str]:
    """Ray actor names (in namespace "serve") of an app's replicas of ``deployment``, sorted."""
    import ray

    tag = f"{app_name}#{deployment}#"
    names = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else str(entry)
        if name.startswith("SERVE_REPLICA::") and tag in name:
            names.append(name)
    return sorted(names)


def pin_id(actor_name: str) -> str:
    """The replica's unique id (what ``pin_replica`` and the routers' state use)."""
    return actor_name.rsplit("#", 1)[-1]


def as_own_request(make_call: Callable[[], T]) -> T:
    """Run ``make_call`` (which starts one handle call) as a Serve request of its own.

    Why: a handle call made while a replica serves a request inherits that request's internal
    id, and Ray Serve 2.60's router hands a chosen replica to the waiting call *with that id*
    (one index entry per id). Several calls waiting at once under one id (this fan-out, run by
    the ingress while it serves ``POST /reset_prefix_cache``) leave all but one unmatched:
    their routing tasks pick the pinned replica again and again without ever delivering the
    call, which then times out. A fresh internal id per call, set in a copy of the context so
    the caller's own request is untouched, keeps them apart (the user-facing request id, used
    in logs, is kept). Outside a Serve request (the driver) Ray makes a fresh id anyway.
    """
    return contextvars.copy_context().run(_with_fresh_request_id, make_call)


def _with_fresh_request_id(make_call: Callable[[], T]) -> T:
    from radixkv.cluster._ray import import_serve

    try:
        import_serve()
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id
    except ImportError:  # no Ray (a stand-in handle): there is no Serve request to leave
        return make_call()

    current = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(current, _internal_request_id=generate_request_id())
    serve_context._serve_request_context.set(fresh)
    return make_call()


@dataclass
class FanoutResult:
    """Who was called, who answered (actor name -> answer dict) and who failed (name -> why)."""

    replicas: list[str]
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


async def call_every_replica(
    handle: Any,
    method: str,
    names: Iterable[str],
    *,
    timeout_s: float = 30.0,
    **kwargs: Any,
) -> FanoutResult:
    """Call ``handle.<method>(pin_replica=..., **kwargs)`` once per replica in ``names``,
    concurrently, each as a request of its own (:func:`as_own_request`). The method must
    answer a dict whose ``"replica"`` is the replica's name."""
    result = FanoutResult(replicas=list(names))
    call = getattr(handle, method)

    async def one(name: str) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        for attempt in range(PIN_ATTEMPTS):
            response = as_own_request(lambda: call.remote(pin_replica=pin_id(name), **kwargs))

            async def wait(response: Any = response) -> Any:
                return await response

            left = deadline - asyncio.get_running_loop().time()
            try:
                got = await asyncio.wait_for(wait(), max(left, 0.001))
            except TimeoutError:
                response.cancel()
                result.failed[name] = f"no answer within {timeout_s:g} s"
                return
            except Exception as e:  # the replica died or the call failed there: this replica only
                result.failed[name] = f"{type(e).__name__}: {e}"[:300]
                return
            if isinstance(got, dict) and got.get("replica") == name:
                result.answers[name] = got
                result.failed.pop(name, None)
                return
            # Another replica answered: the router's candidate list lacked the pinned one for
            # a moment (under load Ray's default router refreshes it late) and it fell back to
            # routing normally. The fanned-out methods are idempotent, so ask again.
            other = got.get("replica") if isinstance(got, dict) else type(got).__name__
            result.failed[name] = (
                f"not reachable by pinning (answered by {other}, {attempt + 1} attempts)"
            )
            pause = PIN_RETRY_WAIT_S * (attempt + 1)
            if deadline - asyncio.get_running_loop().time() <= pause:
                return  # no time left to ask again: the miss stands
            await asyncio.sleep(pause)

    await asyncio.gather(*(one(n) for n in result.replicas))
    return result


async def reset_fleet(handle: Any, *, timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """Reset the prefix cache of every replica of ``handle``'s deployment, make the affinity
    routers in this process forget what the reset replicas held, and report
    (:func:`reset_report`). Call from the process holding ``handle`` (the ingress)."""
    app, deployment = handle.app_name, handle.deployment_name
    names = await asyncio.to_thread(replica_actor_names, app, deployment)  # a blocking GCS call
    result = await call_every_replica(handle, "reset_prefix_cache", names, timeout_s=timeout_s)
    forget_prefixes(reset_versions(result))
    if result.failed:
        log.warning("prefix cache reset failed on %s", result.failed)
    return reset_report(result)


def reset_versions(result: FanoutResult) -> dict[str, int]:
    """Replica id -> its cache summary's version right after the reset (for the routers)."""
    return {pin_id(n): int(a.get("version", 0)) for n, a in result.answers.items()}


def reset_report(result: FanoutResult) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) answering a fleet-wide reset.

    200 ``{"status": "ok", ...}`` when every listed replica was reset; otherwise 503 with
    ``"status"`` "partial" (some were reset) or "failed" (none, or no replica was found), the
    same counts, and an OpenAI-shaped ``"error"``. Either way the body lists ``replicas`` (how
    many were called), ``reset`` (how many were reset), ``reset_replicas`` and ``failed``.
    """
    reset = sorted(result.answers)
    failed = [{"replica": n, "error": why} for n, why in sorted(result.failed.items())]
    body: dict[str, Any] = {
        "status": "ok",
        "replicas": len(result.replicas),
        "reset": len(reset),
        "reset_replicas": reset,
        "failed": failed,
    }
    if reset and not failed:
        return 200, body
    body["status"] = "partial" if reset else "failed"
    message = (
        f"prefix cache reset on {len(reset)} of {len(result.replicas)} replicas"
        + (f"; failed: {', '.join(pin_id(f['replica']) for f in failed)}" if failed else "")
        if result.replicas
        else "no engine replica found to reset"
    )
    body["error"] = {
        "message": message,
        "type": "server_error",
        "param": None,
        "code": "replica_unavailable",
    }
    return 503, body


async def update_fleet(
    handle: Any, request: Any, *, timeout_s: float = 600.0
) -> tuple[int, dict[str, Any]]:
    """Serve ``request`` (a forwarded ``POST /update_weights_from_disk``) on every replica of
    ``handle``'s deployment, each with its own app (admin key, checks and answer as on one
    server), make the affinity routers in this process forget what the updated replicas held
    (their caches were emptied), and report (:func:`update_report`)."""
    app, deployment = handle.app_name, handle.deployment_name
    names = await asyncio.to_thread(replica_actor_names, app, deployment)
    result = await call_every_replica(
        handle, "serve_on_replica", names, timeout_s=timeout_s, request=request
    )
    updated = {n: a for n, a in result.answers.items() if a.get("status") == 200}
    forget_prefixes(reset_versions(dataclasses.replace(result, answers=updated)))
    status, body = update_report(result)
    if status != 200:
        log.warning("weight update failed on %s", body.get("failed"))
    return status, body


def update_report(result: FanoutResult) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) answering a fleet-wide weight update.

    Each replica's answer holds its app's ``status`` and JSON ``body``. Every replica updated:
    200 with SGLang's fields (``success``, ``message``, ``num_paused_requests`` summed).
    No replica updated and every one that answered gave the same refusal (a bad checkpoint or
    body, no admin key), even with others unreachable: that status and the first refusal's body;
    nothing changed anywhere, and retrying the same request cannot help. Anything else (some
    updated, some not): 503 with ``success`` false, as the fleet now serves mixed weights (retry
    the update); none answered at all: 503 too. The body also lists ``replicas``, ``updated``,
    ``updated_replicas`` and ``failed`` (replica and error)."""
    updated = sorted(n for n, a in result.answers.items() if a.get("status") == 200)
    refusals = {n: a for n, a in result.answers.items() if a.get("status") != 200}
    failed = [{"replica": n, "error": why} for n, why in sorted(result.failed.items())]
    failed += [
        {"replica": n, "error": str(a.get("body"))[:300]} for n, a in sorted(refusals.items())
    ]
    failed.sort(key=lambda f: f["replica"])
    fleet = {
        "replicas": len(result.replicas),
        "updated": len(updated),
        "updated_replicas": updated,
        "failed": failed,
    }
    bodies = {n: _json(a.get("body")) for n, a in result.answers.items()}
    if updated and not failed:
        paused = sum(int(b.get("num_paused_requests", 0)) for b in bodies.values())
        message = f"weights updated on {len(updated)} replicas: " + str(
            bodies[updated[0]].get("message", "")
        )
        return 200, {"success": True, "message": message, "num_paused_requests": paused, **fleet}
    statuses = {a.get("status") for a in refusals.values()}
    if refusals and not updated and len(statuses) == 1:
        first = min(refusals)
        return int(refusals[first]["status"]), {**bodies[first], **fleet}
    message = (
        f"weights updated on {len(updated)} of {len(result.replicas)} replicas: the fleet "
        "serves mixed weights until the update succeeds everywhere"
        if result.replicas
        else "no engine replica found to update"
    )
    return 503, {"success": False, "message": message, "num_paused_requests": 0, **fleet}


def _json(body: Any) -> dict[str, Any]:
    """A replica's JSON answer as a dict ({} when it is not one)."""
    try:
        value = json.loads(body) if isinstance(body, str | bytes) else body
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
