"""Ray Serve deployments: engine replicas serving the server's app, and a routing ingress.

::

    HTTP -> Ray Serve proxy -> RadixKVIngress (reads the body, tokenizes, hashes pages)
         -> DeploymentHandle + RadixAffinityRouter (picks a replica by prefix)
         -> RadixKVReplica (AsyncEngine + radixkv.server's FastAPI app, unmodified)

:class:`RadixKVReplica` builds an :class:`~radixkv.engine.async_engine.AsyncEngine` and the
server's app (:func:`radixkv.server.app.build_app`) around it, runs the app's lifespan, and
serves forwarded requests with :func:`~radixkv.cluster.asgi_bridge.call_app`: every route,
error shape, header (``x-cached-tokens``...) and metric is the server's own. It also answers
``record_routing_stats()`` (a bounded summary of its trie for the router) and
``engine_stats()`` (the engine's own counters, for hit rates).

:class:`RadixKVIngress` is the HTTP entry point. It forwards each request to a replica through
a handle, retrying on another replica when the chosen one dies before answering: a
non-streamed request is retried whenever its replica dies (nothing reached the client yet); a
streamed one only until its first bytes were sent, after that the stream ends with an
OpenAI-shaped error event. Either way the client gets a clean answer, never a hang.
``POST /reset_prefix_cache`` is the exception to "one replica per request": the ingress checks
the admin key itself, resets every replica (``fanout.py``), makes its routers forget what they
held, and answers how many were reset and which failed. ``POST /update_weights_from_disk`` is
the other: every replica serves it with its own app (``RadixKVReplica.serve_on_replica``), so
the whole fleet moves to the new weights, and the answer is SGLang's plus which replicas
updated.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from radixkv.cluster._ray import import_serve

serve = import_serve()

from ray.exceptions import RayActorError, RayTaskError  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response, StreamingResponse  # noqa: E402

from radixkv.cluster.asgi_bridge import ForwardedRequest, Lifespan, call_app  # noqa: E402
from radixkv.cluster.fanout import RESET_PATH, WEIGHTS_PATH, reset_fleet, update_fleet  # noqa: E402
from radixkv.cluster.hinting import PromptHasher, load_tokenizer  # noqa: E402
from radixkv.cluster.summary import CacheSummary  # noqa: E402
from radixkv.engine.lora import parse_lora_modules  # noqa: E402
from radixkv.model.lora import adapter_digest  # noqa: E402
from radixkv.server.auth import request_authorization  # noqa: E402
from radixkv.server.errors import APIError  # noqa: E402

log = logging.getLogger("radixkv.cluster")

REPLICA_HEADER = "x-radixkv-replica"


@serve.deployment
class RadixKVReplica:
    """One engine + the server's app. Args are plain data (Ray pickles them per replica)."""

    async def __init__(
        self,
        model: str = "radixkv-tiny",
        engine_kwargs: dict[str, Any] | None = None,
        server_kwargs: dict[str, Any] | None = None,
        *,
        summary_max_hashes: int = 2048,
        torch_threads: int | None = 1,
    ) -> None:
        import torch

        from radixkv.engine.async_engine import AsyncEngine
        from radixkv.server.app import build_app
        from radixkv.server.config import ServerConfig

        if torch_threads is not None:
            # Several replicas share a machine's cores: one intra-op pool each, not one per core.
            torch.set_num_threads(torch_threads)
        self.engine = AsyncEngine(model, **(engine_kwargs or {}))
        self.summary = CacheSummary(self.engine.info().page_size, max_hashes=summary_max_hashes)
        await self.engine.add_cache_listener(self.summary.listener)
        self.app = build_app(self.engine, ServerConfig(**(server_kwargs or {})), owns_engine=True)
        self.lifespan = Lifespan(self.app)
        await self.lifespan.startup()
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self._header = [(REPLICA_HEADER.encode(), self.name.encode())]

    async def handle_http(
        self, request: ForwardedRequest, prefix_hashes: list[int] | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Serve one forwarded request with the server's app; yields its ASGI messages.
        (``prefix_hashes`` is the router's hint; the app recomputes what it needs.)"""
        async for msg in call_app(self.app, request, extra_headers=self._header):
            yield msg

    async def record_routing_stats(self) -> dict[str, Any]:
        """Bounded trie summary for RadixAffinityRouter (Ray calls this periodically)."""
        stats = await asyncio.wait_for(self.engine.stats(), timeout=10)
        queue_len = stats.num_running + stats.num_waiting
        return self.summary.snapshot(queue_len=queue_len, replica=self.name).to_stats()

    async def engine_stats(self, pin_replica: str | None = None) -> dict[str, Any]:
        """The engine's own counters (EngineStats as a dict) plus this replica's name.
        (``pin_replica`` is read by the router, which sends the call to that replica.)"""
        stats = msgspec.to_builtins(await self.engine.stats())
        stats["replica"] = self.name
        return stats

    async def reset_prefix_cache(self, pin_replica: str | None = None) -> dict[str, Any]:
        """Drop every unlocked cache entry; answer this replica's name, its summary version
        after the reset (older routing stats are stale) and the pages it still caches."""
        await self.engine.reset_prefix_cache()
        stats = await self.engine.stats()
        return {
            "replica": self.name,
            "version": self.summary.version,
            "cached_pages": stats.cached_pages,
        }

    async def serve_on_replica(
        self, request: ForwardedRequest, pin_replica: str | None = None
    ) -> dict[str, Any]:
        """Serve one request with this replica's app (a call fanned out to every replica,
        fanout.py); answer its HTTP ``status`` and ``body`` (text), this replica's name and its
        summary version after it (older routing stats are stale)."""
        status, parts = 500, []
        async for msg in call_app(self.app, request, extra_headers=self._header):
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            elif msg["type"] == "http.response.body":
                parts.append(msg.get("body", b""))
        return {
            "replica": self.name,
            "version": self.summary.version,
            "status": status,
            "body": b"".join(parts).decode("utf-8", "replace"),
        }

    async def __del__(self) -> None:
        await self.lifespan.shutdown()


def _is_replica_failure(e: BaseException) -> bool:
    """The replica (not the request) failed: it died, became unreachable, or shed load."""
    if isinstance(e, RayActorError | BackPressureError):
        return True
    return isinstance(e, RayTaskError) and isinstance(getattr(e, "cause", None), RayActorError)


def _sse_error(message: str) -> bytes:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {
        k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() != b"content-length"
    }


@serve.deployment
class RadixKVIngress:
    """HTTP entry: hash the prompt for the router, forward to a replica, relay the answer."""

    def __init__(
        self,
        replicas: Any,  # DeploymentHandle of RadixKVReplica
        model: str = "radixkv-tiny",
        page_size: int = 16,
        server_kwargs: dict[str, Any] | None = None,
        *,
        max_attempts: int = 3,
        tokenizer_source: dict[str, Any] | None = None,
        lora_modules: Any = None,  # the replicas' EngineConfig.lora_modules (routing hints)
    ) -> None:
        server_kwargs = server_kwargs or {}
        self.replicas = replicas
        self.hasher = PromptHasher(
            load_tokenizer(model, **(tokenizer_source or {})),
            page_size,
            api_keys=server_kwargs.get("api_keys"),
            admin_key=server_kwargs.get("admin_key"),
            keys_file=server_kwargs.get("api_keys_file"),
            lora_digests={
                name: adapter_digest(path) for name, path in parse_lora_modules(lora_modules)
            },
        )
        self.max_body_bytes = int(server_kwargs.get("max_body_bytes", 4 * 1024 * 1024))
        self.max_attempts = max_attempts
        # failure counters (ingress_stats): retries after a replica failed, streams cut
        # mid-way by a replica failure, requests answered 503 after every attempt failed
        self.failures = {"retries": 0, "streams_cut": 0, "unavailable": 0}

    async def ingress_stats(self) -> dict[str, int]:
        return dict(self.failures)

    async def router_state(self) -> list[dict[str, dict[str, int]]]:
        """The affinity routers' view of the fleet in this ingress (load, in-flight, ...)."""
        from radixkv.cluster.affinity import live_snapshots

        return live_snapshots()

    def _call(self, fwd: ForwardedRequest, hashes: list[int]) -> Any:
        return self.replicas.options(stream=True).handle_http.remote(fwd, prefix_hashes=hashes)

    async def __call__(self, request: Request) -> Response:
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes:
                break  # forwarded truncated past the limit: the replica's app answers 413
        body = b"".join(parts)
        path: str = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"  # the app's routes are relative to the prefix
        fwd = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.url.query.encode("latin-1"),
            headers=list(request.headers.raw),
            body=body,
            client=tuple(request.client) if request.client else None,  # type: ignore[arg-type]
        )
        if fwd.method == "POST" and fwd.path == RESET_PATH:
            return await self._reset_fleet(request.headers.get("authorization"))
        if fwd.method == "POST" and fwd.path == WEIGHTS_PATH:  # every replica checks the key
            status, report = await update_fleet(self.replicas, fwd)
            return Response(json.dumps(report).encode(), status, None, "application/json")
        hint = self.hasher.hint(fwd.path, request_authorization(request.headers), body)
        if hint.stream:
            return await self._streamed(fwd, hint.hashes)
        return await self._buffered(fwd, hint.hashes)

    async def _reset_fleet(self, authorization: str | None) -> Response:
        """Reset every engine replica's prefix cache, not just one the router would pick."""
        try:
            self.hasher.auth.require_admin(authorization)  # same key and answers as a replica
        except APIError as e:
            return e.response()
        status, report = await reset_fleet(self.replicas)
        headers = {"retry-after": "1"} if status == 503 else None
        return Response(json.dumps(report).encode(), status, headers, "application/json")

    async def _buffered(self, fwd: ForwardedRequest, hashes: list[int]) -> Response:
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            start: dict[str, Any] | None = None
            chunks: list[bytes] = []
            gen = self._call(fwd, hashes)
            try:
                async for msg in gen:
                    if msg["type"] == "http.response.start":
                        start = msg
                    else:
                        chunks.append(msg.get("body", b""))
            except Exception as e:
                if not _is_replica_failure(e):
                    raise
                last = e
                log.warning("replica failed (attempt %d): %r; retrying", attempt + 1, e)
                self.failures["retries"] += 1
                continue
            if start is None:  # cannot happen with call_app, which always answers
                return _unavailable(None, self.failures)
            return Response(b"".join(chunks), start["status"], headers=_headers(start["headers"]))
        return _unavailable(last, self.failures)

    async def _streamed(self, fwd: ForwardedRequest, hashes: list[int]) -> Response:
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            gen = self._call(fwd, hashes)
            try:
                start = await gen.__anext__()
            except StopAsyncIteration:
                return _unavailable(None, self.failures)
            except Exception as e:
                if not _is_replica_failure(e):
                    raise
                last = e
                log.warning("replica failed (attempt %d): %r; retrying", attempt + 1, e)
                self.failures["retries"] += 1
                continue
            return StreamingResponse(
                _relay(gen, self.failures), start["status"], headers=_headers(start["headers"])
            )
        return _unavailable(last, self.failures)


async def _relay(gen: Any, failures: dict[str, int]) -> AsyncIterator[bytes]:
    """Body chunks of a started stream; a replica lost mid-stream ends it with an error event."""
    done = False
    try:
        async for msg in gen:
            if msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body", False):
                    done = True
    except Exception as e:
        if not _is_replica_failure(e):
            raise
        log.warning("replica failed mid-stream: %r", e)
        failures["streams_cut"] += 1
        yield _sse_error(f"the replica serving this stream failed: {type(e).__name__}")
    finally:
        if not done:
            gen.cancel()  # the client left (or the replica failed): abort on the replica


def _unavailable(err: BaseException | None, failures: dict[str, int] | None = None) -> Response:
    if failures is not None:
        failures["unavailable"] += 1
    body = {
        "error": {
            "message": f"no replica could serve the request: {type(err).__name__ if err else 'none'}",
            "type": "server_error",
            "param": None,
            "code": "replica_unavailable",
        }
    }
    return Response(
        json.dumps(body).encode(),
        503,
        headers={"retry-after": "1"},
        media_type="application/json",
    )
