"""Turns engine outputs into OpenAI payloads: whole responses, stream chunks and SSE frames.

Streamed text is computed from the engine's cumulative ``text`` minus what was already sent
(the engine never retracts text: it holds back a possible stop-string prefix), so coalesced or
skipped outputs cannot lose or duplicate characters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixkv.server import protocol as P
from radixkv.server.metrics import ServerMetrics
from radixkv.server.submission import Submission


@dataclass(frozen=True)
class Delta:
    index: int  # OpenAI choice index = prompt index * n + sample index
    text: str
    finish_reason: str | None  # set once, on the choice's last delta


def take_deltas(sub: Submission, prompt_index: int, metrics: ServerMetrics | None) -> list[Delta]:
    """New text and finishes of one prompt's samples since the last call; records metrics."""
    p = sub.prompts[prompt_index]
    out = p.latest
    if out is None:
        return []
    n = sub.params.n
    deltas: list[Delta] = []
    now = time.monotonic()
    for j, c in enumerate(out.outputs):
        state = p.choices[j]
        new_text = c.text[state.sent_chars :]
        state.sent_chars = len(c.text)
        state.completion_tokens = len(c.token_ids)
        finish = None
        if c.finish_reason is not None and state.finish_reason is None:
            finish = state.finish_reason = c.finish_reason
            if metrics is not None:
                m = out.metrics
                ttft = m.ttft
                if ttft is None and m.first_token_time is not None:
                    ttft = m.first_token_time - m.arrival_time
                metrics.observe_finished(
                    finish_reason=finish,
                    prompt_tokens=p.prompt_tokens if j == 0 else 0,
                    cached_tokens=p.cached_tokens if j == 0 else 0,
                    completion_tokens=state.completion_tokens,
                    ttft=ttft if j == 0 else None,
                    latency=now - m.arrival_time,
                )
        if new_text or finish is not None:
            deltas.append(Delta(prompt_index * n + j, new_text, finish))
    return deltas


def usage(sub: Submission) -> P.Usage:
    completion = sum(c.completion_tokens for p in sub.prompts for c in p.choices)
    return P.make_usage(sub.prompt_tokens, completion, sub.cached_tokens)


def cache_headers(sub: Submission, request_id: str) -> dict[str, str]:
    cached = sub.cached_tokens
    return {
        "x-cache-hit": "true" if cached > 0 else "false",
        "x-cached-tokens": str(cached),
        "x-request-id": request_id,
    }


def completion_response(
    sub: Submission, rid: str, model: str, created: int
) -> P.CompletionResponse:
    choices: list[P.CompletionChoice] = []
    for i, p in enumerate(sub.prompts):
        assert p.latest is not None
        for j, c in enumerate(p.latest.outputs):
            choices.append(P.CompletionChoice(i * sub.params.n + j, c.text, c.finish_reason))
    return P.CompletionResponse(rid, created, model, choices, usage(sub))


def chat_response(sub: Submission, rid: str, model: str, created: int) -> P.ChatCompletionResponse:
    p = sub.prompts[0]
    assert p.latest is not None
    choices = [
        P.ChatChoice(j, P.ChatResponseMessage(c.text), c.finish_reason)
        for j, c in enumerate(p.latest.outputs)
    ]
    return P.ChatCompletionResponse(rid, created, model, choices, usage(sub))


def sse(obj: object) -> bytes:
    return b"data: " + P.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = [P.CompletionChoice(d.index, d.text, d.finish_reason) for d in deltas]
    return sse(P.CompletionResponse(rid, created, model, choices, None))


def chat_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = [
        P.ChatChunkChoice(d.index, P.ChatDelta(content=d.text), d.finish_reason) for d in deltas
    ]
    return sse(P.ChatCompletionChunk(rid, created, model, choices))


def chat_role_chunk(rid: str, model: str, created: int, n: int) -> bytes:
    choices = [
        P.ChatChunkChoice(j, P.ChatDelta(role="assistant", content=""), None) for j in range(n)
    ]
    return sse(P.ChatCompletionChunk(rid, created, model, choices))


def usage_chunk(sub: Submission, rid: str, model: str, created: int, chat: bool) -> bytes:
    if chat:
        return sse(P.ChatCompletionChunk(rid, created, model, [], usage(sub)))
    return sse(P.CompletionResponse(rid, created, model, [], usage(sub)))
