"""A minimal server of your own that embeds radixkv's AsyncEngine (not radixkv's OpenAI server).

It shows the embedding API: one AsyncEngine per process, ``async for out in engine.generate(...)``
per request, ``namespace=`` to keep users' cached prefixes apart, ``num_cached_tokens`` to see
the prefix cache working, and that leaving the loop early (a client gone) aborts the request.

    python examples/custom_server.py --port 8001
    curl -s localhost:8001/generate -H 'content-type: application/json' \
         -d '{"prompt": "Hello there", "max_tokens": 8}'
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from radixkv import AsyncEngine, SamplingParams


class GenerateRequest(BaseModel):
    prompt: str
    max_tokens: int = Field(32, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    user: str | None = None  # requests of different users never share cached prefixes


def create_app(model: str = "radixkv-tiny", **engine_kwargs: Any) -> FastAPI:
    engine = AsyncEngine(model, **engine_kwargs)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = FastAPI(lifespan=lifespan)

    def submit(req: GenerateRequest) -> AsyncIterator[Any]:
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature)
        return engine.generate(req.prompt, params, namespace=req.user)

    @app.post("/generate")
    async def generate(req: GenerateRequest) -> dict[str, Any]:
        out = None
        try:
            async for o in submit(req):
                out = o  # the last output is the finished one
        except ValueError as e:  # bad input (empty prompt, too long, ...) raises at submission
            raise HTTPException(400, str(e)) from None
        assert out is not None
        return {
            "text": out.text,
            "finish_reason": out.finish_reason,
            "num_cached_tokens": out.num_cached_tokens,
            "ttft": out.metrics.ttft,
        }

    @app.post("/generate_stream")
    async def generate_stream(req: GenerateRequest) -> StreamingResponse:
        outputs = submit(req)
        try:
            first = await anext(outputs)  # surfaces bad input as a 400 before streaming starts
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

        async def lines() -> AsyncIterator[str]:
            out = first
            try:
                while True:
                    yield (
                        json.dumps({"delta": out.outputs[0].delta_text, "finished": out.finished})
                        + "\n"
                    )
                    if out.finished:
                        return
                    out = await anext(outputs)
            finally:
                await outputs.aclose()  # a client that left: the engine aborts the request

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="radixkv-tiny")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    uvicorn.run(create_app(args.model), host="127.0.0.1", port=args.port)
