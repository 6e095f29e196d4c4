"""Turns engine outputs into OpenAI payloads: whole responses, stream chunks and SSE frames.

Streamed text is computed from the engine's cumulative ``text`` minus what was already sent
(the engine never retracts text: it holds back a possible stop-string prefix), so coalesced or
skipped outputs cannot lose or duplicate characters. Logprobs are sent the same way, by token
count: each chunk carries those of the tokens generated since the previous one (a token whose
text is still held back still has its logprob sent), so a stream's logprobs, concatenated, are
the non-streamed response's.

With echo (``/v1/completions``), each choice starts with its prompt: the prompt's text and,
when logprobs were asked for, its tokens' logprobs (the engine's ``prompt_logprobs``; the first
token has none, nor have those before ``prompt_logprobs_start``: null), then the completion's;
``text_offset`` runs on across both. A stream sends the prompt in the choice's first chunk,
held back until the engine has the prompt's logprobs when they are needed (outputs before the
prefill completes do not carry them).

Logprob values are the engine's (``log_softmax`` of the raw logits, engine/logprobs.py), with
``-inf`` sent as -9999.0 (JSON has no infinity; vLLM does the same). A token's ``bytes`` are the
UTF-8 bytes of its decoded text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from radixkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from radixkv.server import protocol as P
from radixkv.server.metrics import ServerMetrics
from radixkv.server.reasoning import ReasoningMode, ReasoningStream
from radixkv.server.submission import ChoiceState, PromptState, Submission
from radixkv.server.tool_calls import ToolCall, ToolCallStream, ToolParser, parse_tool_calls

_MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class LogprobFormat:
    """How a request wants its logprobs: ``num_top`` alternatives per token, tokens as
    ``"token_id:N"`` strings (vLLM's ``return_tokens_as_token_ids``) or as text."""

    num_top: int = 0
    as_token_ids: bool = False

    def token(self, token_id: int, text: str) -> str:
        """How a token is named: ``text`` is its decoded text."""
        return f"token_id:{token_id}" if self.as_token_ids else text


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob and its top alternatives, ready for either API shape; ``logprob``
    and ``top`` are None for an echoed prompt's first token (nothing precedes it) and the
    tokens before ``prompt_logprobs_start``."""

    token: str
    logprob: float | None
    bytes: list[int]
    text_offset: int  # characters of the choice's tokens before this one
    top: list[tuple[str, float, list[int]]] | None  # (token, logprob, bytes), most likely first


@dataclass(frozen=True)
class Delta:
    index: int  # OpenAI choice index = prompt index * n + sample index
    text: str
    finish_reason: str | None  # set once, on the choice's last delta
    logprobs: list[TokenLogprob] | None = field(default=None)  # None: not requested
    tool_calls: list[ToolCall] | None = None  # parsed out of the text (--tool-call-parser)
    reasoning: str | None = None  # read out of the text (--reasoning-parser); text: the rest
    stop_reason: str | int | None = None  # with "stop": the stop string or token id matched


def with_reasoning(
    deltas: list[Delta], streams: dict[int, ReasoningStream], include: bool
) -> list[Delta]:
    """Stream deltas with each choice's text through its ReasoningStream (``streams`` by choice
    index): ``reasoning`` and the content (``text``) as each settles; ``include=False`` drops
    the reasoning (vLLM's ``include_reasoning``)."""
    out = []
    for d in deltas:
        s = streams[d.index]
        reasoning, text = s.feed(d.text)
        if d.finish_reason is not None:
            more_reasoning, more_text = s.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
        if not include:
            reasoning = ""
        if reasoning or text or d.finish_reason is not None or d.logprobs:
            out.append(replace(d, text=text, reasoning=reasoning or None))
    return out


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
        if text or finish is not None or d.logprobs or calls or d.reasoning:
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
            (
                fmt.token(t, lp.decoded_token),
                _value(lp.logprob),
                list(lp.decoded_token.encode(errors="replace")),
            )
            for t, lp in ranked
        ]
        out.append(
            TokenLogprob(
                token=fmt.token(tok, chosen.decoded_token),
                logprob=_value(chosen.logprob),
                bytes=list(chosen.decoded_token.encode(errors="replace")),
                text_offset=state.logprob_chars,
                top=top,
            )
        )
        state.logprob_chars += len(chosen.decoded_token)
    return out


def _echo_head(
    p: PromptState,
    out: RequestOutput,
    c: CompletionOutput,
    fmt: LogprobFormat | None,
    state: ChoiceState,
) -> tuple[str, list[TokenLogprob] | None] | None:
    """The prompt a choice of ``p`` starts with (echo): its text, and its tokens' logprobs
    when the request asked for logprobs (advancing the choice's text offset); None while the
    engine has not computed those yet."""
    assert p.echo is not None
    if fmt is None:
        return p.echo.text, None
    entries = out.prompt_logprobs
    if entries is None:
        if c.finish_reason is None:
            return None  # the engine fills them once the prefill is complete: wait for it
        # finished without them (only an engine that broke its contract): the text alone,
        # rather than never finishing the choice
        return p.echo.text, None
    ids = p.prompt_ids
    unscored = (p.echo.first_token, *p.echo.unscored)  # tokens before prompt_logprobs_start
    head = []
    for tok, text in zip(ids, unscored):
        offset = state.logprob_chars
        head.append(
            TokenLogprob(
                fmt.token(tok, text), None, list(text.encode(errors="replace")), offset, None
            )
        )
        state.logprob_chars += len(text)
    rest: list[dict[int, Logprob]] = []
    for entry in entries[len(unscored) :]:
        assert entry is not None  # only the tokens before the start have no entry
        rest.append(entry)
    head += _token_logprobs(fmt, ids[len(unscored) :], rest, state)
    return p.echo.text, head


def _advance(
    sub: Submission, prompt_index: int, j: int, state: ChoiceState, fmt: LogprobFormat | None
) -> Delta | None:
    """What sample ``j`` of a prompt has new since ``state`` (which it advances): None when
    nothing, or while its echoed prompt waits for the engine's prompt logprobs."""
    p = sub.prompts[prompt_index]
    out = p.latest
    assert out is not None
    c = out.outputs[j]
    text, logprobs = "", None
    if p.echo is not None and not state.echoed:
        head = _echo_head(p, out, c, fmt, state)
        if head is None:
            return None  # the prompt goes first: hold the whole choice back until it can
        text, logprobs = head
        state.echoed = True
    if not sub.echo_only:
        text += c.text[state.sent_chars :]
        state.sent_chars = len(c.text)
        state.completion_tokens = len(c.token_ids)
        if fmt is not None and c.logprobs is not None:
            start = state.sent_logprobs
            generated = _token_logprobs(fmt, c.token_ids[start:], c.logprobs[start:], state)
            logprobs = generated if logprobs is None else logprobs + generated
            state.sent_logprobs = len(c.logprobs)
    finish, stop_reason = None, None
    if c.finish_reason is not None and state.finish_reason is None:
        finish, stop_reason = c.finish_reason, c.stop_reason
        if sub.echo_only and finish in ("stop", "length"):
            finish, stop_reason = "length", None  # max_tokens=0 reached (whatever ended it)
        state.finish_reason = finish
    if not (text or finish is not None or logprobs):
        return None
    return Delta(prompt_index * sub.params.n + j, text, finish, logprobs, stop_reason=stop_reason)


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
    deltas: list[Delta] = []
    now = time.monotonic()
    for j in range(len(out.outputs)):
        state = p.choices[j]
        d = _advance(sub, prompt_index, j, state, fmt)
        if d is None:
            continue
        deltas.append(d)
        if d.finish_reason is not None and metrics is not None:
            m = out.metrics
            ttft = m.ttft
            if ttft is None and m.first_token_time is not None:
                ttft = m.first_token_time - m.arrival_time
            queue = None
            if m.first_scheduled_time is not None:
                queue = m.first_scheduled_time - m.arrival_time
            metrics.observe_finished(
                finish_reason=d.finish_reason,
                prompt_tokens=p.prompt_tokens if j == 0 else 0,
                cached_tokens=p.cached_tokens if j == 0 else 0,
                completion_tokens=state.completion_tokens,
                ttft=ttft if j == 0 else None,
                latency=now - m.arrival_time,
                queue_time=queue if j == 0 else None,
            )
    return deltas


def usage(sub: Submission, reasoning_tokens: int | None = None) -> P.Usage:
    """The submission's usage; ``reasoning_tokens`` (with a reasoning parser) adds
    ``completion_tokens_details``."""
    completion = sum(c.completion_tokens for p in sub.prompts for c in p.choices)
    u = P.make_usage(sub.prompt_tokens, completion, sub.cached_tokens)
    if reasoning_tokens is not None:
        u.completion_tokens_details = P.CompletionTokensDetails(reasoning_tokens)
    return u


def cache_headers(subs: Submission | list[Submission], request_id: str) -> dict[str, str]:
    """The answer's prefix-cache headers: the prompt tokens its submissions (one, or a native
    batch's) served from the cache."""
    cached = sum(s.cached_tokens for s in subs) if isinstance(subs, list) else subs.cached_tokens
    return {
        "x-cache-hit": "true" if cached > 0 else "false",
        "x-cached-tokens": str(cached),
        "x-request-id": request_id,
    }


def _with_sampled(t: TokenLogprob) -> dict[str, float] | None:
    """The legacy shape's top_logprobs entry: the top alternatives plus the sampled token (so
    up to k + 1 entries, as OpenAI and vLLM do), most likely first; None for an echoed
    prompt's first token."""
    if t.top is None or t.logprob is None:
        return None
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
    content = []
    for t in tokens:
        # chat has no echo, so every token has a logprob
        assert t.logprob is not None and t.top is not None
        top = [P.TopLogprob(tok, lp, b) for tok, lp, b in t.top]
        content.append(P.ChatTokenLogprob(t.token, t.logprob, t.bytes, top))
    return P.ChatLogprobs(content=content)


def _all_deltas(sub: Submission, fmt: LogprobFormat | None) -> list[Delta]:
    """Each choice's whole output as one Delta (a finished, non-streamed submission), made
    as a stream's deltas are, so a stream's concatenation cannot differ from it."""
    deltas = []
    for i, p in enumerate(sub.prompts):
        assert p.latest is not None
        for j in range(len(p.latest.outputs)):
            d = _advance(sub, i, j, ChoiceState(), fmt)
            deltas.append(d or Delta(i * sub.params.n + j, "", None))
    return deltas


def prompt_logprobs(out: RequestOutput, num_top: int) -> P.PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of one prompt: per token (after the first, which has none)
    its own logprob and the ``num_top`` most likely (the engine may hold more: it computed
    what echo and this extension need together); None if the engine has none."""
    if out.prompt_logprobs is None:
        return None
    result: P.PromptLogprobs = []
    for tok, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num_top]
        shown = {tok: entry[tok], **dict(ranked)}  # the prompt's own token first
        result.append(
            {
                str(t): P.PromptLogprob(_value(lp.logprob), lp.rank, lp.decoded_token)
                for t, lp in shown.items()
            }
        )
    return result


def completion_response(
    sub: Submission,
    rid: str,
    model: str,
    created: int,
    fmt: LogprobFormat | None = None,
    num_prompt_logprobs: int | None = None,
) -> P.CompletionResponse:
    """The whole response; ``num_prompt_logprobs``: the request's ``prompt_logprobs``, shown
    on each choice (each choice of a prompt shows that prompt's)."""
    shown: list[P.PromptLogprobs | None] = [None] * len(sub.prompts)
    if num_prompt_logprobs is not None:
        for i, p in enumerate(sub.prompts):
            assert p.latest is not None
            shown[i] = prompt_logprobs(p.latest, num_prompt_logprobs)
    choices = []
    for d in _all_deltas(sub, fmt):
        plp = shown[d.index // sub.params.n]
        choices.append(
            P.CompletionChoice(
                d.index,
                d.text,
                d.finish_reason,
                completion_logprobs(d.logprobs),
                plp,
                d.stop_reason,
            )
        )
    return P.CompletionResponse(rid, created, model, choices, usage(sub))


def _tool_calls_out(calls: list[ToolCall]) -> list[P.ToolCallOut]:
    return [P.ToolCallOut(c.id, P.FunctionCall(c.name, c.arguments)) for c in calls]


def chat_response(
    sub: Submission,
    rid: str,
    model: str,
    created: int,
    fmt: LogprobFormat | None = None,
    tool_parser: ToolParser | None = None,
    num_prompt_logprobs: int | None = None,
    reasoning: ReasoningMode | None = None,
    reasoning_tokens: int | None = None,
) -> P.ChatCompletionResponse:
    """The whole chat response; with ``reasoning`` each reply's reasoning is read out of its
    text first (server/reasoning.py), then with ``tool_parser`` the tool calls out of the rest
    (server/tool_calls.py), and its choice finishes with "tool_calls";
    ``num_prompt_logprobs``: the request's ``prompt_logprobs`` (of the rendered messages)."""
    choices = []
    for d in _all_deltas(sub, fmt):
        thought, text = None, d.text
        if reasoning is not None:
            thought, text = reasoning.parser.split(d.text, reasoning.opened)
            thought = thought if reasoning.include else None
        message, finish = P.ChatResponseMessage(text, reasoning=thought), d.finish_reason
        if tool_parser is not None and text is not None:
            # no calls: the text as content (mistral's: without its markers, module doc)
            content, calls = parse_tool_calls(text, tool_parser)
            message = P.ChatResponseMessage(
                content, tool_calls=_tool_calls_out(calls) if calls else None, reasoning=thought
            )
            if calls:
                finish = "tool_calls"
        choices.append(
            P.ChatChoice(d.index, message, finish, chat_logprobs(d.logprobs), d.stop_reason)
        )
    plp = None
    if num_prompt_logprobs is not None:
        out = sub.prompts[0].latest
        assert out is not None
        plp = prompt_logprobs(out, num_prompt_logprobs)
    u = usage(sub, reasoning_tokens)
    return P.ChatCompletionResponse(rid, created, model, choices, u, prompt_logprobs=plp)


def sse(obj: object) -> bytes:
    return b"data: " + P.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_event(event: dict[str, object]) -> bytes:
    """A Responses API stream event: named by its ``type``, as OpenAI sends them (no [DONE])."""
    return f"event: {event['type']}\n".encode() + sse(event)


def completion_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = [
        P.CompletionChoice(
            d.index,
            d.text,
            d.finish_reason,
            completion_logprobs(d.logprobs),
            stop_reason=d.stop_reason,
        )
        for d in deltas
    ]
    return sse(P.CompletionResponse(rid, created, model, choices, None))


def chat_chunk(rid: str, model: str, created: int, deltas: list[Delta]) -> bytes:
    choices = []
    for d in deltas:
        delta = P.ChatDelta(content=d.text)
        if d.reasoning or d.tool_calls:  # content only where there is some (as vLLM sends)
            calls = [
                P.ToolCallDelta(k, c.id, P.FunctionCall(c.name, c.arguments))
                for k, c in enumerate(d.tool_calls or ())
            ]
            delta = P.ChatDelta(
                content=d.text or None, reasoning=d.reasoning, tool_calls=calls or None
            )
        choices.append(
            P.ChatChunkChoice(
                d.index, delta, d.finish_reason, chat_logprobs(d.logprobs), d.stop_reason
            )
        )
    return sse(P.ChatCompletionChunk(rid, created, model, choices))


def chat_role_chunk(rid: str, model: str, created: int, n: int) -> bytes:
    choices = [
        P.ChatChunkChoice(j, P.ChatDelta(role="assistant", content=""), None) for j in range(n)
    ]
    return sse(P.ChatCompletionChunk(rid, created, model, choices))


def usage_chunk(
    sub: Submission,
    rid: str,
    model: str,
    created: int,
    chat: bool,
    reasoning_tokens: int | None = None,
) -> bytes:
    if chat:
        return sse(P.ChatCompletionChunk(rid, created, model, [], usage(sub, reasoning_tokens)))
    return sse(P.CompletionResponse(rid, created, model, [], usage(sub)))
