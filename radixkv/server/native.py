"""SGLang's native HTTP API (its 0.5.23 wire formats), so SGLang's clients work unchanged.

Routes (added to the app by :func:`add_native_routes`, left out of /openapi.json):

- ``POST /generate`` (and PUT): ``text`` (a string or a list) or ``input_ids`` (a list of ids
  or a list of lists), exactly one; ``sampling_params`` (one object, or one per prompt);
  ``stream``; ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``,
  ``return_text_in_logprobs``; ``rid``; ``lora_path`` (a loaded adapter's name); ``cache_salt``
  and ``extra_key`` (prefix-cache isolation); ``priority``; ``return_prompt_token_ids``. The
  answer is ``{"text", "output_ids", "meta_info"}``, a list of those for a batch (a list of
  prompts, or ``n`` > 1: prompt-major, each prompt's samples together). A stream sends SSE
  ``data: {json}`` chunks with the text, ``output_ids`` and logprobs so far (cumulative: SGLang's
  default, ``incremental_streaming_output`` off) and, in a batch, the entry's ``index``, then
  ``data: [DONE]``.
- ``GET /get_model_info`` and ``/model_info``, ``GET /get_server_info`` and ``/server_info``.
- ``POST /flush_cache`` (and GET): what ``/reset_prefix_cache`` does (admin key), answered
  with SGLang's text.
- ``GET /health_generate``: generates one token; 200, or 503 when the engine cannot.
- ``POST /update_weights_from_disk`` (admin key): new weights from a checkpoint folder, in
  place (``Engine.update_weights``); requests in flight are retracted and recomputed, or
  aborted with ``abort_all_requests``. ``GET /get_weight_version``: the version served.

A request goes through what the OpenAI routes use (server/state.py): the API key, the body size
limit, ``max_queue`` admission, guided-decoding compilation before anything is submitted, the
:class:`~radixkv.server.submission.Submission` that aborts its engine requests whatever happens
(a client that disconnects frees their locks and pages), the prefix cache's tenant namespace
(``cache_salt`` narrows it as on the OpenAI routes, so both share cached prefixes) and the
metrics. Errors are 4xx/5xx with ``{"error": {"message", "type", "param", "code"}}``, ``code``
being the HTTP status (SGLang's ``ErrorBody``), ``param`` the field at fault (``text``,
``sampling_params.temperature``, ``sampling_params[1].n``, ...).

SGLang fields radixkv cannot honour (images, hidden states, sessions, custom logit processors,
``stop_regex``, ``structural_tag``, ...) are a 400 naming the field when they are set; purely
operational ones (routing, disaggregation ranks, logging switches) are accepted and ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixkv import __version__
from radixkv.engine.intake import PriorityNeedsPolicy
from radixkv.engine.params import SamplingParams
from radixkv.server import render as R
from radixkv.server.errors import APIError, bad_request
from radixkv.server.native_plan import Item, Plan, Planner
from radixkv.server.native_protocol import (
    SGLANG_VERSION,
    GenerateRequest,
    NativeSamplingParams,
    UpdateWeightsFromDiskRequest,
)
from radixkv.server.native_render import Renderer, encode_json, native_error, stream_error
from radixkv.server.state import ServerState, engine_error
from radixkv.server.submission import Echo, Submission
from radixkv.server.transport import ClientGone, SSEResponse, read_body, wait_or_disconnect

__all__ = ["GenerateRequest", "NativeSamplingParams", "add_native_routes"]

log = logging.getLogger("radixkv.server")

HEALTH_TIMEOUT_S = 20.0
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


class _Waker:
    """Wakes when any of several submissions has news (their states are what is read)."""

    def __init__(self, subs: list[Submission]) -> None:
        self.subs = subs
        self.pending: dict[asyncio.Future[Any], int] = {}

    async def wait(self) -> set[int]:
        """The submissions that moved (their outputs or errors are in their states)."""
        watched = set(self.pending.values())
        for k, s in enumerate(self.subs):
            if k not in watched and not s.finished:
                self.pending[asyncio.ensure_future(s.next_event())] = k
        if not self.pending:
            return set()
        done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
        moved = set()
        for t in done:
            moved.add(self.pending.pop(t))
            t.result()  # next_event raises nothing; an engine error is in the state
        return moved

    def close(self) -> None:
        for t in self.pending:
            t.cancel()
        self.pending.clear()


def _error_of(subs: list[Submission]) -> tuple[int, BaseException] | None:
    for k, s in enumerate(subs):
        err = s.prompts[0].error
        if err is not None:
            return k, err
    return None


async def _wait(subs: list[Submission], started: bool) -> tuple[int, BaseException] | None:
    """Until every submission has its first output (``started``) or has finished, or one
    failed (its index and error)."""
    waker = _Waker(subs)
    try:
        while True:
            failed = _error_of(subs)
            if failed is not None:
                return failed
            if started and all(s.prompts[0].latest is not None or s.finished for s in subs):
                return None
            if all(s.finished for s in subs):
                return None
            await waker.wait()
    finally:
        waker.close()


class NativeAPI:
    """The native routes' handlers, sharing the OpenAI routes' :class:`ServerState`."""

    def __init__(self, st: ServerState) -> None:
        self.st = st

    # ------------------------------------------------------------ POST /generate
    async def generate(self, request: Request) -> Response:
        st = self.st
        try:
            principal = st.auth.authenticate(request.headers.get("authorization"))
            body = await read_body(request, st.config.max_body_bytes)
            req = st.decode(body, GenerateRequest)
            plan = Planner(st, principal).plan(req)
            return await self.run(request, plan, principal.tenant)
        except APIError as e:
            st.metrics.count_http_error(e.status)
            return native_error(e)

    def _error(self, err: BaseException, item: Item) -> APIError:
        if item.lora is not None and item.lora not in self.st.lora_names():
            return bad_request(f"lora_path {item.lora!r} was unloaded", "lora_path")
        if isinstance(err, PriorityNeedsPolicy):  # named as sent: SGLang's, the engine's negated
            return bad_request(
                f"priority={-err.priority} needs the server started with --schedule-policy "
                "priority; under the other policies leave it unset",
                "priority",
            )
        return engine_error(err, item.guided_param)

    async def run(self, request: Request, plan: Plan, tenant: str) -> Response:
        st = self.st
        items = plan.items
        slot = st.admit(
            sum(it.params.n for it in items),
            len(items),
            items[0].params.n,
            plan.source if len(items) > 1 else "sampling_params.n",
            tenant=tenant,
            prompt_tokens=sum(len(it.ids) for it in items),
        )
        subs = slot.subs
        handed_off = False  # True once an SSEResponse owns the release
        try:
            compiled: set[Any] = set()
            for it in items:  # before anything is submitted: a bad constraint runs nothing
                guided = it.params.guided
                if guided is None or guided in compiled:
                    continue
                err = await wait_or_disconnect(st.compile_guided(it.params), request.receive)
                if err is not None:
                    raise self._error(err, it)
                compiled.add(guided)
            base = f"generate-{uuid.uuid4().hex}"
            for k, it in enumerate(items):
                subs.append(
                    Submission(
                        st.engine,
                        [it.ids],
                        it.params,
                        namespace=it.namespace,
                        request_id=f"{base}-{k}",
                        # the prompt alone (max_new_tokens 0): its one token is not shown
                        echo=[Echo("", "")] if it.hidden else None,
                        echo_only=it.hidden,
                        lora=it.lora,
                        tenant=slot.tenant,
                        on_start=slot.started,
                    )
                )
            renderer = Renderer(st)
            if plan.stream:
                failed = await wait_or_disconnect(_wait(subs, started=True), request.receive)
                if failed is not None:
                    raise self._error(failed[1], items[failed[0]])
                response = SSEResponse(
                    self._stream(subs, plan, renderer),
                    headers=R.cache_headers(subs, items[0].sample_ids[0]),
                    cleanup=slot.release,
                    on_client_gone=lambda: st.metrics.count_client_closed("streaming"),
                )
                handed_off = True
                return response
            failed = await wait_or_disconnect(_wait(subs, started=False), request.receive)
            if failed is not None:
                raise self._error(failed[1], items[failed[0]])
            entries = []
            for k, (sub, it) in enumerate(zip(subs, items)):
                R.take_deltas(sub, 0, st.metrics)
                out = sub.prompts[0].latest
                assert out is not None
                if any(c.finish_reason == "error" for c in out.outputs):
                    # SGLang answers a request its engine aborted with the abort's status
                    raise APIError(500, "The engine failed while serving the request")
                shown = 1 if it.beam else len(out.outputs)
                entries += [
                    renderer.entry(k, it, out, j, plan.prompt_token_ids) for j in range(shown)
                ]
            payload: Any = entries if plan.batch else entries[0]
            return Response(
                encode_json(payload),
                media_type="application/json",
                headers=R.cache_headers(subs, items[0].sample_ids[0]),
            )
        except ClientGone:
            st.metrics.count_client_closed("waiting")
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        finally:
            if not handed_off:
                await slot.release()

    async def _stream(
        self, subs: list[Submission], plan: Plan, renderer: Renderer
    ) -> AsyncIterator[bytes]:
        """SGLang's stream: per entry, a chunk whenever it has new tokens or finishes, with
        everything so far (cumulative); then [DONE]. An engine error ends it with an error
        chunk."""
        st = self.st
        items = plan.items
        # what each entry showed last: (tokens, finished)
        sent: dict[tuple[int, int], tuple[int, bool]] = {}
        first_index = [0]
        for it in items[:-1]:
            first_index.append(first_index[-1] + (1 if it.beam else it.params.n))
        waker = _Waker(subs)
        moved: set[int] = set(range(len(subs)))
        try:
            while True:
                for k in sorted(moved):
                    sub, it = subs[k], items[k]
                    R.take_deltas(sub, 0, st.metrics)
                    out = sub.prompts[0].latest
                    if out is None:
                        continue
                    if it.beam and not out.finished:
                        continue  # a search's hypotheses come at its end
                    samples = [0] if it.beam else range(len(out.outputs))
                    for j in samples:
                        c = out.outputs[j]
                        done = c.finish_reason is not None
                        tokens = 0 if it.hidden or it.beam else len(c.token_ids)
                        before = sent.get((k, j), (0, False))
                        if (tokens, done) == before or (not done and tokens == before[0]):
                            continue
                        sent[(k, j)] = (tokens, done)
                        chunk = renderer.entry(k, it, out, j, plan.prompt_token_ids)
                        if plan.batch:
                            chunk["index"] = first_index[k] + j
                        yield b"data: " + encode_json(chunk) + b"\n\n"
                failed = _error_of(subs)
                if failed is not None:
                    k, err = failed
                    index = first_index[k] if plan.batch else None
                    yield stream_error(self._error(err, items[k]), index)
                    break
                if all(s.finished for s in subs):
                    break
                moved = await waker.wait()
        finally:
            waker.close()
        yield R.SSE_DONE

    # ------------------------------------------------------------ the other routes
    async def update_weights_from_disk(self, req: UpdateWeightsFromDiskRequest) -> Response:
        """New weights from a checkpoint folder, answered in SGLang's shape: 200 with
        ``success`` true, or 400 with ``success`` false and the problem (nothing changed)."""
        if not req.flush_cache:
            raise bad_request(
                "flush_cache=false is not supported: radixkv never serves KV computed under "
                "other weights",
                "flush_cache",
            )
        if req.load_format not in (None, "auto", "safetensors"):
            raise bad_request(
                f"load_format {req.load_format!r} is not supported (safetensors or auto)",
                "load_format",
            )
        in_flight = "abort" if req.abort_all_requests else "retract"
        try:
            u = await self.st.engine.update_weights(
                req.model_path, weight_version=req.weight_version, in_flight=in_flight
            )
        except (ValueError, TypeError) as e:  # a bad folder or version: nothing changed
            answer = {"success": False, "message": str(e), "num_paused_requests": 0}
            return Response(encode_json(answer), status_code=400, media_type="application/json")
        message = (
            f"Succeeded to update model weights: {u.tensors} tensors, version "
            f"{u.weight_version}, {u.dropped_pages + u.dropped_host_pages} cached pages dropped."
        )
        answer = {"success": True, "message": message, "num_paused_requests": u.retracted}
        return Response(encode_json(answer), media_type="application/json")

    def model_info(self) -> dict[str, Any]:
        info = self.st.engine.info()
        return {
            "model_path": info.model,
            "served_model_name": self.st.model_name,
            "tokenizer_path": info.tokenizer or info.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": info.weight_version,
            "reasoning_parser": self.st.config.reasoning_parser,
            "tool_call_parser": self.st.config.tool_call_parser,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": [info.architecture],
        }

    async def server_info(self) -> dict[str, Any]:
        st = self.st
        eng = st.engine.info()
        stats = await asyncio.wait_for(st.engine.stats(), timeout=10)
        info = self.model_info()
        return {
            "model_path": info["model_path"],
            "served_model_name": st.model_name,
            "tokenizer_path": info["tokenizer_path"],
            "context_length": st.max_context,
            "max_context_length": st.max_context,
            "max_total_num_tokens": eng.num_pages * eng.page_size,
            "page_size": eng.page_size,
            "max_running_requests": eng.max_running_requests,
            "max_queued_requests": st.config.max_queue,
            "chunked_prefill_size": eng.chunked_prefill_size,
            "schedule_policy": eng.schedule_policy,
            "disable_radix_cache": not eng.enable_prefix_cache,
            "attention_backend": eng.attention_backend,
            "device": eng.kv_device,
            # the dtype the model computes in, and what KV pages store (as configured)
            "dtype": eng.dtype,
            "kv_cache_dtype": eng.kv_cache_dtype,
            "reasoning_parser": st.config.reasoning_parser,
            "tool_call_parser": st.config.tool_call_parser,
            "api_key_required": st.auth.enabled,
            "lora_paths": st.lora_names(),
            "incremental_streaming_output": False,
            "disaggregation_mode": "null",
            "internal_states": [
                {
                    "num_running_reqs": stats.num_running,
                    "num_waiting_reqs": stats.num_waiting,
                    "kv_usage": stats.kv_usage,
                    "cached_pages": stats.cached_pages,
                    "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                }
            ],
            "startup_time": st.created,
            "version": __version__,
            "sglang_api_version": SGLANG_VERSION,
            "frontend": "radixkv",
        }

    async def health_generate(self) -> Response:
        """One greedy token from the engine (SGLang's ``input_ids=[0]``): 200, else 503."""
        engine = self.st.engine

        async def one_token() -> None:
            params = SamplingParams(max_tokens=1, temperature=0.0)
            gen = engine.generate([0], params, request_id=f"health-{uuid.uuid4().hex}")
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.finished:
                        if out.outputs[0].finish_reason not in ("stop", "length"):
                            raise RuntimeError(f"finished with {out.outputs[0].finish_reason}")
                        return
            raise RuntimeError("the request ended without an output")

        try:
            await asyncio.wait_for(one_token(), timeout=HEALTH_TIMEOUT_S)
        except Exception as e:
            raise APIError(503, f"engine cannot generate: {type(e).__name__}: {e}") from None
        return Response(status_code=200)


def _native(
    st: ServerState, handler: Callable[[Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` with its APIErrors answered in the native shape (and counted)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            st.metrics.count_http_error(e.status)
            return native_error(e)

    return wrapped


def add_native_routes(app: FastAPI, st: ServerState) -> None:
    """Serve SGLang's native API (module doc) from ``app``, with ``st`` (the OpenAI routes')."""
    api = NativeAPI(st)
    hidden = {"include_in_schema": False}

    app.add_api_route("/generate", api.generate, methods=["POST", "PUT"], **hidden)

    async def model_info(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        return Response(encode_json(api.model_info()), media_type="application/json")

    async def server_info(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        return Response(encode_json(await api.server_info()), media_type="application/json")

    async def flush_cache(request: Request) -> Response:
        st.auth.require_admin(request.headers.get("authorization"))
        await st.engine.reset_prefix_cache()
        return Response(FLUSHED, media_type="text/plain")

    async def health_generate(request: Request) -> Response:
        if st.config.metrics_key_required:  # with API keys: it runs the engine
            st.auth.require_key(request.headers.get("authorization"), "/health_generate")
        return await api.health_generate()

    async def update_weights_from_disk(request: Request) -> Response:
        st.auth.require_admin(request.headers.get("authorization"))
        req = st.decode(
            await read_body(request, st.config.max_body_bytes), UpdateWeightsFromDiskRequest
        )
        return await api.update_weights_from_disk(req)

    async def get_weight_version(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        version = {"weight_version": st.engine.info().weight_version}
        return Response(encode_json(version), media_type="application/json")

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, _native(st, model_info), methods=["GET"], **hidden)
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, _native(st, server_info), methods=["GET"], **hidden)
    app.add_api_route("/flush_cache", _native(st, flush_cache), methods=["GET", "POST"], **hidden)
    app.add_api_route("/health_generate", _native(st, health_generate), methods=["GET"], **hidden)
    app.add_api_route(
        "/update_weights_from_disk",
        _native(st, update_weights_from_disk),
        methods=["POST"],
        **hidden,
    )
    app.add_api_route(
        "/get_weight_version", _native(st, get_weight_version), methods=["GET"], **hidden
    )
