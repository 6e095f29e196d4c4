"""Engine outputs as SGLang's ``/generate`` answers: ``{"text", "output_ids", "meta_info"}``
entries (logprobs as ``[logprob, token_id, text_or_null]`` triples, beam results), and errors
as SGLang's ``{"error": {"message", "code"}}`` bodies and stream chunks."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.responses import Response

from radixkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from radixkv.server.errors import APIError
from radixkv.server.native_plan import Item
from radixkv.server.state import ServerState

_MIN_LOGPROB = -9999.0  # JSON has no infinity (the OpenAI routes send the same)


def _value(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _entry(logprob: float | None, token: int, text: str | None) -> list[Any]:
    """SGLang's ``[logprob, token_id, text_or_null]``."""
    return [None if logprob is None else _value(logprob), token, text]


def _top_row(entry: dict[int, Logprob], k: int, with_text: bool) -> list[list[Any]]:
    """The ``k`` most likely tokens at one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    return [_entry(lp.logprob, t, lp.decoded_token if with_text else None) for t, lp in ranked]


def _asked_row(entry: dict[int, Logprob], ids: tuple[int, ...], with_text: bool) -> list[Any]:
    """The ``token_ids_logprob`` ids at one position, in the order asked."""
    return [_entry(entry[t].logprob, t, entry[t].decoded_token if with_text else None) for t in ids]


class Renderer:
    """Engine outputs as SGLang's ``{"text", "output_ids", "meta_info"}`` entries."""

    def __init__(self, st: ServerState) -> None:
        self.st = st
        self._input_cache: dict[int, tuple[list[Any], list[Any] | None, list[Any] | None]] = {}

    def finish_reason(self, item: Item, c: CompletionOutput) -> dict[str, Any] | None:
        r = c.finish_reason
        if r is None:
            return None
        if item.hidden and r in ("stop", "length"):
            return {"type": "length", "length": 0}
        if r == "length":
            length = len(c.token_ids) if item.beam else item.max_new_tokens
            return {"type": "length", "length": length}
        if r == "stop":
            matched = c.stop_reason
            if matched is None and c.token_ids:  # a constraint completed: its last token
                matched = c.token_ids[-1]
            return {"type": "stop", "matched": matched}
        if r == "abort":
            return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        return {
            "type": "abort",
            "message": "The engine failed while serving the request",
            "status_code": 500,
            "err_type": "InternalServerError",
        }

    def _inputs(
        self, k: int, item: Item, out: RequestOutput
    ) -> tuple[list[Any], list[Any] | None, list[Any] | None]:
        """input_token_logprobs, (with top_logprobs_num) input_top_logprobs and (with
        token_ids_logprob) input_token_ids_logprobs of prompt ``k``, from logprob_start_len
        on: their first entry has no value (as in SGLang)."""
        cached = self._input_cache.get(k)
        if cached is not None:
            return cached
        plan = item.logprobs
        assert plan is not None
        ids = item.ids
        texts = self.st.token_texts
        tokens: list[Any] = []
        tops: list[Any] | None = [] if plan.top > 0 else None
        asked: list[Any] | None = [] if plan.token_ids else None
        if plan.start < len(ids):
            first = ids[plan.start]
            tokens.append(_entry(None, first, texts(first) if plan.text else None))
            for rows in (tops, asked):
                if rows is not None:
                    rows.append(None)
            entries = out.prompt_logprobs
            rest = ids[plan.start + 1 :]
            if rest and entries is None:
                return tokens, tops, asked  # not computed yet (the prefill is not complete)
            for pos, tok in enumerate(rest, plan.start + 1):
                assert entries is not None
                entry = entries[pos]
                assert entry is not None  # the engine scores every token from the start on
                lp = entry[tok]
                tokens.append(_entry(lp.logprob, tok, lp.decoded_token if plan.text else None))
                if tops is not None:
                    tops.append(_top_row(entry, plan.top, plan.text))
                if asked is not None:
                    asked.append(_asked_row(entry, plan.token_ids, plan.text))
        self._input_cache[k] = (tokens, tops, asked)
        return tokens, tops, asked

    def meta(
        self, k: int, item: Item, out: RequestOutput, c: CompletionOutput, sample_id: str
    ) -> dict[str, Any]:
        finish = self.finish_reason(item, c)
        shown = [] if item.hidden else c.token_ids
        meta: dict[str, Any] = {
            "id": sample_id,
            "finish_reason": finish,
            "prompt_tokens": len(item.ids),
            "weight_version": out.weight_version,
        }
        plan = item.logprobs
        if plan is not None:
            inputs, input_tops, input_asked = self._inputs(k, item, out)
            entries = [] if item.hidden else (c.logprobs or [])
            outputs = [
                _entry(e[t].logprob, t, e[t].decoded_token if plan.text else None)
                for t, e in zip(shown, entries)
            ]
            meta["input_token_logprobs"] = inputs
            meta["output_token_logprobs"] = outputs
            meta["output_token_logprobs_length"] = len(outputs)
            if plan.top > 0:
                meta["input_top_logprobs"] = input_tops
                meta["output_top_logprobs"] = [
                    _top_row(e, plan.top, plan.text) for e in entries[: len(shown)]
                ]
            if plan.token_ids:
                meta["input_token_ids_logprobs"] = input_asked
                meta["output_token_ids_logprobs"] = [
                    _asked_row(e, plan.token_ids, plan.text) for e in entries[: len(shown)]
                ]
        if self.st.reasoning_parser is None:
            meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(shown)
        meta["cached_tokens"] = int(out.num_cached_tokens)
        if finish is not None:
            m = out.metrics
            latency = m.latency if m.latency is not None else time.monotonic() - m.arrival_time
            meta["e2e_latency"] = latency
        return meta

    def entry(
        self, k: int, item: Item, out: RequestOutput, j: int, with_prompt_ids: bool
    ) -> dict[str, Any]:
        """Sample ``j`` of prompt ``k`` (beam search: the best hypothesis, all of them under
        ``meta_info.beam_results``)."""
        if item.beam:
            return self._beams(k, item, out, with_prompt_ids)
        c = out.outputs[j]
        text, ids = ("", []) if item.hidden else (c.text, list(c.token_ids))
        body: dict[str, Any] = {
            "text": text,
            "output_ids": ids,
            "meta_info": self.meta(k, item, out, c, item.sample_ids[j]),
        }
        if with_prompt_ids:
            body["prompt_token_ids"] = item.ids
        return body

    def _beams(
        self, k: int, item: Item, out: RequestOutput, with_prompt_ids: bool
    ) -> dict[str, Any]:
        results = []
        total = sum(len(c.token_ids) for c in out.outputs)
        for idx, c in enumerate(out.outputs):
            meta: dict[str, Any] = {}
            if idx == 0:
                meta = self.meta(k, item, out, c, item.sample_ids[0])
                meta["completion_tokens"] = total  # all returned sequences (SGLang's)
            meta["finish_reason"] = self.finish_reason(item, c)
            meta["sequence_score"] = c.score
            results.append({"output_ids": list(c.token_ids), "text": c.text, "meta_info": meta})
        best = results[0]
        body: dict[str, Any] = {
            "text": best["text"],
            "output_ids": best["output_ids"],
            "meta_info": {**best["meta_info"], "beam_results": results},
        }
        if with_prompt_ids:
            body["prompt_token_ids"] = item.ids
        return body


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def native_error(err: APIError) -> Response:
    """An error as the native routes answer it: SGLang's ``{"error": {"message", "code"}}``
    (``code`` the HTTP status), with radixkv's ``type`` and the ``param`` at fault."""
    body = {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}
    }
    return Response(
        encode_json(body),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers,
    )


def stream_error(err: APIError, index: int | None) -> bytes:
    body: dict[str, Any] = {
        "error": {
            "message": err.message,
            "type": err.type,
            "code": err.status,
            "retryable": err.status == 503,
        }
    }
    if index is not None:
        body["index"] = index
    return b"data: " + encode_json(body) + b"\n\n"
