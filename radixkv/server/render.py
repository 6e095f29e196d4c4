"""Turns engine outputs into OpenAI payloads: whole responses, stream chunks and SSE frames.

Streamed text is computed from the engine's cumulative ``text`` minus what was already sent
(the engine never retracts text: it holds back a possible stop-string prefix), so coalesced or
skipped outputs cannot lose or duplicate characters. Logprobs are sent the same way, by token
count: each chunk carries those of the tokens generated since the previous one (a token whose
text is still held back still has its logprob sent), so a stream's logprobs, concatenated, are
the non-streamed response's.

Logprob values are the engine's (``log_softmax`` of the raw logits, engine/logprobs.py), with
``-inf`` sent as -9999.0 (JSON has no infinity; vLLM does the same). A token's ``bytes`` are the
UTF-8 bytes of its decoded text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from radixkv.engine.outputs import Logprob
from radixkv.server import protocol as P
from radixkv.server.metrics import ServerMetrics
from radixkv.server.submission import ChoiceState, Submission
from radixkv.server.tool_calls import ToolCall, ToolCallStream, parse_tool_calls

_MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class LogprobFormat:
    """How a request wants its logprobs: ``num_top`` alternatives per token, tokens as
    ``"token_id:N"`` strings (vLLM's ``return_tokens_as_token_ids``) or as text."""

    num_top: int = 0
    as_token_ids: bool = False

    def token(self, token_id: int, lp: Logprob) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else lp.decoded_token


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and its top alternatives, ready for either API shape."""

    token: str
    logprob: float
    bytes: list[int]
    text_offset: int  # characters of the completion text before this token
    top: list[tuple[str, float, list[int]]]  # (token, logprob, bytes), most likely first


@dataclass(frozen=True)
class Delta:
    index: int  # OpenAI choice index = prompt index * n + sample index
    text: str
    finish_reason: str | None  # set once, on the choice's last delta
    logprobs: list[TokenLogprob] | None = field(default=None)  # None: not requested
    tool_calls: list[ToolCall] | None = None  # parsed out of the text (--tool-call-parser)


def with_tool_calls(deltas: list[Delta], streams: dict[int, ToolCallStream]) -> list[Delta]:
    """Stream deltas with each choice's text through its ToolCallStream (``streams`` by choice
    index): content held back while a call may be starting; with the finish, the rest and the
    calls, whose choice then finishes with "tool_calls"."""
    out = []
    for d in deltas:
        s = streams[d.index]
        text, calls, finish = s.feed(d.text), None, d.finish_reason
        if finish is not None:
            rest, found = s.finish()
            text += rest
            if found:
                calls, finish = found, "tool_calls"
        if text or finish is not None or d.logprobs or calls:
            out.append(replace(d, text=text, finish_reason=finish, tool_calls=calls))
    return out


def _value(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _token_logprobs(
    fmt: LogprobFormat,
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    state: ChoiceState,
) -> list[TokenLogprob]:
    """Logprobs of ``entries`` (for ``token_ids``), advancing the choice's text offset."""
    out = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[: fmt.num_top]
        top = [
            (fmt.token(t, lp), _value(lp.logprob), list(lp.decoded_token.encode(errors="replace")))
            for t, lp in ranked
        ]
        out.append(
            TokenLogprob(
                token=fmt.token(tok, chosen),
                logprob=_value(chosen.logprob),
                bytes=list(chosen.decoded_token.encode(errors="replace")),
                text_offset=state.logprob_chars,
                top=top,
            )
        )
        state.logprob_chars += len(chosen.decoded_token)
    return out


def take_deltas(
    sub: Submission,
    prompt_index: int,
    metrics: ServerMetrics | None,
    fmt: LogprobFormat | None = None,
) -> list[Delta]:
    """New text, logprobs and finishes of one prompt's samples since the last call; records
    metrics. ``fmt``: the request asked for logprobs."""
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
        logprobs = None
        if fmt is not None and c.logprobs is not None:
            start = state.sent_logprobs
            logprobs = _token_logprobs(fmt, c.token_ids[start:], c.logprobs[start:], state)
            state.sent_logprobs = len(c.logprobs)
        finish = None
        if c.finish_reason is not None and state.finish_reason is None:
            finish = state.finish_reason = c.finish_reason
            if metrics is not None:
                m = out.metrics
                ttft = m.ttft
                if ttft is None and m.first_token_time is not None:
                    ttft = m.first_token_time - m.arrival_time
                queue = None
                if m.first_scheduled_time is not None:
                    queue = m.first_scheduled_time - m.arrival_time
                metrics.observe_finished(
                    finish_reason=finish,
                    prompt_tokens=p.prompt_tokens if j == 0 else 0,
                    cached_tokens=p.cached_tokens if j == 0 else 0,
                    completion_tokens=state.completion_tokens,
                    ttft=ttft if j == 0 else None,
                    latency=now - m.arrival_time,
                    queue_time=queue if j == 0 else None,
                )
        if new_text or finish is not None or logprobs:
            deltas.append(Delta(prompt_index * n + j, new_text, finish, logprobs))
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


def _with_sampled(t: TokenLogprob) -> dict[str, float]:
    """The legacy shape's top_logprobs entry: the top alternatives plus the sampled token (so
    up to k + 1 entries, as OpenAI and vLLM do), most likely first."""
    entries = {tok: lp for tok, lp, _ in t.top}
    entries.setdefault(t.token, t.logprob)
    return dict(sorted(entries.items(), key=lambda kv: -kv[1]))


def completion_logprobs(tokens: list[TokenLogprob] | None) -> P.CompletionLogprobs | None:
    if tokens is None:
        return None
    return P.CompletionLogprobs(
        tokens=[t.token for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[_with_sampled(t) for t in tokens],
        text_offset=[t.text_offset for t in tokens],
    )


def chat_logprobs(tokens: list[TokenLogprob] | None) -> P.ChatLogprobs | None:
    if tokens is None:
        return None
    return P.ChatLogprobs(
        content=[
            P.ChatTokenLogprob(
                token=t.token,
                logprob=t.logprob,
                bytes=t.bytes,
                top_logprobs=[P.TopLogprob(tok, lp, b) for tok, lp, b in t.top],
            )
            for t in tokens
        ]
    )


def _all_deltas(sub: Submission, fmt: LogprobFormat | None) -> list[Delta]:
    """Each choice's whole output as one Delta (a finished, non-streamed submission)."""
    deltas = []
    for i, p in enumerate(sub.prompts):
        assert p.latest is not None
        for j, c in enumerate(p.latest.outputs):
            logprobs = None
            if fmt is not None and c.logprobs is not None:
                logprobs = _token_logprobs(fmt, c.token_ids, c.logprobs, ChoiceState())
            deltas.append(Delta(i * sub.params.n + j, c.text, c.finish_reason, logprobs))
    return deltas


def completion_response(
    sub: Submission, rid: str, model: str, created: int, fmt: LogprobFormat | None = None
) -> P.CompletionResponse:
    choices = [
        P.CompletionChoice(d.index, d.text, d.finish_reason, completion_logprobs(d.logprobs))
        for d in _all_deltas(sub, fmt)
    ]
    return P.CompletionResponse(rid, created, model, choices, usage(sub))


def _tool_calls_out(calls: list[ToolCall]) -> list[P.ToolCallOut]:
    return [P.ToolCallOut(c.id, P.FunctionCall(c.name, c.arguments)) for c in calls]


def chat_response(
    sub: Submission,
    rid: str,
    model: str,
    created: int,
    fmt: LogprobFormat | None = None,
    tool_parser: str | None = None,
) -> P.ChatCompletionResponse:
    """The whole chat response; with ``tool_parser`` each reply's tool calls are read out of
    its text (server/tool_calls.py) and its choice finishes with "tool_calls"."""
    choices = []
    for d in _all_deltas(sub, fmt):
        message, finish = P.ChatResponseMessage(d.text), d.finish_reason
        if tool_parser is not None:
            content, calls = parse_tool_calls(d.text, tool_parser)
            if calls:
                message = P.ChatResponseMessage(content, tool_calls=_tool_calls_out(calls))
                finish = "tool_calls"
        choices.append(P.ChatChoice(d.index, message, finish, chat_logprobs(d.logprobs)))
    return P.ChatCompletionResponse(rid, created, model, choices, usage(sub))


def sse(obj: object) -> bytes:
    return b"data: " + P.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = [
        P.CompletionChoice(d.index, d.text, d.finish_reason, completion_logprobs(d.logprobs))
        for d in deltas
    ]
    return sse(P.CompletionResponse(rid, created, model, choices, None))


def chat_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = []
    for d in deltas:
        delta = P.ChatDelta(content=d.text)
        if d.tool_calls:
            calls = [
                P.ToolCallDelta(k, c.id, P.FunctionCall(c.name, c.arguments))
                for k, c in enumerate(d.tool_calls)
            ]
            delta = P.ChatDelta(content=d.text or None, tool_calls=calls)
        choices.append(
            P.ChatChunkChoice(d.index, delta, d.finish_reason, chat_logprobs(d.logprobs))
        )
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
