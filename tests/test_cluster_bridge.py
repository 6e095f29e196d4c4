"""The ASGI bridge a Ray replica uses to run the server's app on forwarded requests (no Ray)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from radixkv.cluster.asgi_bridge import ForwardedRequest, Lifespan, call_app
from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.app import build_app
from radixkv.server.config import ServerConfig


def _req(body: dict[str, Any], path: str = "/v1/completions") -> ForwardedRequest:
    return ForwardedRequest(
        method="POST",
        path=path,
        headers=[(b"content-type", b"application/json")],
        body=json.dumps(body).encode(),
    )


async def _collect(app: Any, req: ForwardedRequest) -> tuple[dict[str, Any], bytes]:
    start: dict[str, Any] = {}
    body = b""
    async for msg in call_app(app, req, extra_headers=[(b"x-radixkv-replica", b"r1")]):
        if msg["type"] == "http.response.start":
            start = msg
        else:
            body += msg["body"]
    return start, body


def test_bridge_serves_the_server_app_and_releases_on_disconnect() -> None:
    async def main() -> None:
        engine = AsyncEngine("radixkv-tiny", num_pages=128)
        app = build_app(engine, ServerConfig(), owns_engine=True)
        life = Lifespan(app)
        await life.startup()
        prompt = "shared prefix " * 8
        body = {"model": "radixkv-tiny", "prompt": prompt, "max_tokens": 3}
        start, raw = await _collect(app, _req(body))
        assert start["status"] == 200
        headers = dict(start["headers"])
        assert headers[b"x-radixkv-replica"] == b"r1" and headers[b"x-cache-hit"] == b"false"
        assert json.loads(raw)["usage"]["completion_tokens"] == 3
        start, raw = await _collect(app, _req(body))
        assert int(dict(start["headers"])[b"x-cached-tokens"]) > 0

        # errors keep the server's shapes
        start, raw = await _collect(app, _req({"model": "radixkv-tiny", "prompt": ""}))
        assert start["status"] == 400 and "error" in json.loads(raw)

        # a stream abandoned after its first chunk: the app sees a disconnect and aborts
        stream = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
        gen = call_app(app, _req(stream))
        first = await gen.__anext__()
        assert first["type"] == "http.response.start" and first["status"] == 200
        await gen.__anext__()
        await gen.aclose()
        for _ in range(500):
            stats = await engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.num_running == 0 and stats.num_waiting == 0
        await engine.check_invariants()
        core = engine.engine
        assert all(n.lock_ref == 0 for n in core.cache.iter_nodes() if n.parent is not None)
        assert core.pool.num_free + core.cache.num_cached_pages == core.pool.num_pages
        assert stats.finish_reasons.get("abort", 0) >= 1
        await life.shutdown()

    asyncio.run(main())


def test_bridge_turns_a_crashing_app_into_a_500() -> None:
    async def crash(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise RuntimeError("boom")

    async def half(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})

    async def main() -> None:
        msgs = [m async for m in call_app(crash, _req({}))]
        assert msgs[0]["status"] == 500 and not msgs[-1]["more_body"]
        msgs = [m async for m in call_app(half, _req({}))]
        assert [m["type"] for m in msgs][-1] == "http.response.body"
        assert msgs[-1]["more_body"] is False  # always terminated

    asyncio.run(main())
