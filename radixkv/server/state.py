"""Everything the routes share (``app.state.radixkv``): config, auth, metrics, the engine, and
how one OpenAI request becomes engine requests and an HTTP response."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixkv.engine.async_engine import AsyncEngine, QueueFull
from radixkv.engine.intake import PriorityNeedsPolicy
from radixkv.engine.logprobs import TokenTexts
from radixkv.engine.lora import check_lora_name
from radixkv.engine.params import SamplingParams
from radixkv.model.tokenizer import encode_chat
from radixkv.server import protocol as P
from radixkv.server import render as R
from radixkv.server.auth import Authenticator, Principal
from radixkv.server.config import ServerConfig
from radixkv.server.errors import APIError, bad_request
from radixkv.server.metrics import ServerMetrics
from radixkv.server.reasoning import ReasoningMode, ReasoningParser
from radixkv.server.response_store import ResponseStore, Stored
from radixkv.server.responses import (
    RESPONSES_PARAMS,
    ResponseObject,
    ResponsesRequest,
    ResponseWriter,
    error_param,
    new_id,
    response_usage,
)
from radixkv.server.responses import history as responses_history
from radixkv.server.responses import shell as responses_shell
from radixkv.server.structured import request_constraint
from radixkv.server.submission import Echo, PromptState, Submission
from radixkv.server.tenant_limits import TenantLimiter, TenantLimitExceeded, TenantTicket
from radixkv.server.tool_calls import NativeParser, ToolCall, ToolCallStream, ToolParser
from radixkv.server.transport import ClientGone, SSEResponse, wait_or_disconnect

log = logging.getLogger("radixkv.server")

# distinct unknown field names logged at most (a client inventing names cannot flood the log
# or grow the set without bound)
MAX_WARNED_FIELDS = 64
# served model names a 404 lists (a server with hundreds of adapters points to /v1/models)
MAX_LISTED_MODELS = 20
# prompt tokens decoded to see whether the generation prompt opens a reasoning block: the tag
# and what a template writes after it (a newline) fit in a few
_PROMPT_TAIL_TOKENS = 16


class ServerState:
    """Everything the routes share (``app.state.radixkv``)."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.auth = Authenticator(config.api_keys, config.admin_key, keys_file=config.api_keys_file)
        info = engine.info()
        self.tokenizer = engine.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)  # /tokenize's token_strs, memoised
        self.max_context: int = info.max_context
        self.vocab_size: int = info.vocab_size
        self.model_name = config.model_name or info.model
        self.last_stats: Any = None
        self.tenants = TenantLimiter()  # each tenant's load, its limits (tenant_limits.py)
        self.metrics = ServerMetrics(
            stats_fn=lambda: self.last_stats,
            model_name=self.model_name,
            tenants_fn=lambda: self.tenants.load(),
        )
        self._warned_fields: set[str] = set()  # unknown request fields already logged
        self.created = int(time.time())
        self.in_flight = 0  # sequences admitted and not yet released
        self.publisher: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None  # the serving loop (set at startup)
        self._lora_created: dict[str, int] = {}  # adapter name -> when this server loaded it
        self.responses = ResponseStore(config.responses_store_size)  # POST /v1/responses
        self.reasoning_parser = (
            None if config.reasoning_parser is None else ReasoningParser.of(config.reasoning_parser)
        )
        # an adapter named like the base model could never be requested: its name would pick
        # the base model
        if self.model_name in self.lora_names():
            raise ValueError(
                f"the LoRA adapter name {self.model_name!r} is the served model's name; rename "
                "the adapter or the model (--served-model-name)"
            )

    # ------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        """Bind the KV event publisher (if configured) and start listening to the cache.

        Called by the app's lifespan; a host that does not run ASGI lifespan events (some
        ingress wrappers) calls it itself, in the loop that will serve requests."""
        self.loop = asyncio.get_running_loop()
        if self.config.kv_events is not None and self.publisher is None:
            from radixkv.server.kv_events import KVEventPublisher

            self.publisher = KVEventPublisher(
                self.config.kv_events,
                topic=self.config.kv_events_topic,
                replay_endpoint=self.config.kv_events_replay,
                medium="GPU" if self.engine.info().on_gpu else "CPU",
                lora=self._event_lora,
            )
            await self.engine.add_cache_listener(self.publisher.listener)

    def _event_lora(self, namespace: Any) -> tuple[int, str] | None:
        """KV events' ``(lora_id, lora_name)`` of a cache namespace (the engine thread calls
        it, from the publisher's cache listener, as it does everything that loads or unloads
        adapters)."""
        info = self.engine.lora_of_namespace(namespace)
        return None if info is None else (info.slot, info.name)

    async def shutdown(self, *, shutdown_engine: bool = False) -> None:
        """Stop publishing (flushing what is queued) and optionally shut the engine down."""
        if self.publisher is not None:
            with contextlib.suppress(ValueError, RuntimeError):  # RuntimeError: engine shut down
                await self.engine.remove_cache_listener(self.publisher.listener)
            self.publisher.close()
            self.publisher = None
        if shutdown_engine:
            await self.engine.shutdown()

    # ------------------------------------------------------------ request preparation
    def decode(self, body: bytes, kind: type[P.R]) -> P.R:
        """The request, or 400 naming the bad parameter. Unknown fields are 400 with
        ``strict_api``, else ignored with one warning per field name."""
        ignored: list[str] = []
        try:
            req = P.decode_request(body, kind, strict=self.config.strict_api, ignored=ignored)
        except P.ProtocolError as e:
            raise bad_request(e.message, e.param) from None
        for name in ignored:
            if name in self._warned_fields or len(self._warned_fields) > MAX_WARNED_FIELDS:
                continue
            self._warned_fields.add(name)
            if len(self._warned_fields) > MAX_WARNED_FIELDS:
                log.warning(
                    "more than %d distinct unknown request fields: no longer logging them",
                    MAX_WARNED_FIELDS,
                )
            else:
                log.warning(
                    "ignoring unknown request field %r (logged once per field name; "
                    "--strict-api rejects unknown fields)",
                    name[:80],
                )
        return req

    # ------------------------------------------------------------ models and LoRA adapters
    def lora_names(self) -> list[str]:
        """The loaded LoRA adapters' names, in load order."""
        return [info.name for info in self.engine.list_loras()]

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names, None for the base model; 404
        ``model_not_found`` naming what is served otherwise."""
        if model == self.model_name:
            return None
        if model in self.lora_names():
            return model
        raise self.model_not_found(model)

    def model_not_found(self, model: str) -> APIError:
        served = [self.model_name, *self.lora_names()]
        listed = _listed(served, "`", " (GET /v1/models lists them)")
        return APIError(
            404,
            f"The model `{model}` does not exist (this server serves {listed})",
            param="model",
            code="model_not_found",
        )

    def model_list(self) -> P.ModelList:
        """``GET /v1/models``: the base model, then every adapter in load order (vLLM's cards)."""
        cards = [
            P.ModelCard(
                self.model_name, self.created, root=self.model_name, max_model_len=self.max_context
            )
        ]
        for info in self.engine.list_loras():
            created = self._lora_created.get(info.name, self.created)
            cards.append(P.ModelCard(info.name, created, root=info.path, parent=self.model_name))
        return P.ModelList(cards)

    async def load_lora(self, req: P.LoadLoRAAdapterRequest) -> str:
        """``POST /v1/load_lora_adapter``: vLLM's success text, or 400 naming the field at
        fault (a taken or invalid name; a path that is not a readable adapter of this model,
        with the file and the problem)."""
        name, path = req.lora_name, req.lora_path
        if name == self.model_name:
            raise bad_request(
                f"The lora adapter name '{name}' is the served base model's name; choose another",
                "lora_name",
            )
        if name in self.lora_names():
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            check_lora_name(name)
        except ValueError as e:
            raise bad_request(str(e), "lora_name") from None
        try:
            info = await self.engine.load_lora(name, path)
        except ValueError as e:  # ModelLoadError names the file and the problem
            # a concurrent load of the same name got there first: the name is at fault
            param = "lora_name" if name in self.lora_names() else "lora_path"
            raise bad_request(str(e), param) from None
        except OSError as e:  # unreadable (permissions, a name too long): the error names it
            raise bad_request(
                f"cannot read the LoRA adapter at {path!r}: {e}", "lora_path"
            ) from None
        self._lora_created[name] = int(time.time())
        log.info(
            "loaded LoRA adapter %r from %s (rank %d, %s)",
            name,
            info.path,
            info.rank,
            ", ".join(info.modules),
        )
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora(self, req: P.UnloadLoRAAdapterRequest) -> str:
        """``POST /v1/unload_lora_adapter``: vLLM's success text; 404 for an adapter that is not
        loaded, 400 for one that live requests use (they keep running; nothing changes)."""
        name = req.lora_name
        if name not in self.lora_names():
            raise _lora_not_found(name, self.lora_names())
        try:
            await self.engine.unload_lora(name)
        except ValueError:
            if name not in self.lora_names():  # a concurrent unload got there first
                raise _lora_not_found(name, self.lora_names()) from None
            # the engine's message names the requests; other tenants' ids are not this
            # caller's business, so say what is wrong and what to do
            raise bad_request(
                f"The lora adapter '{name}' is in use by requests that are still running; "
                "unload it once they finish",
                "lora_name",
            ) from None
        self._lora_created.pop(name, None)
        log.info("unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise bad_request("prompt encodes to no tokens", "prompt")
            return ids
        return self.check_ids(prompt, "prompt")

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """``ids``, or 400 naming ``param`` if one is outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param
            )
        return ids

    def chat_ids(self, req: P.ChatCompletionRequest | P.TokenizeRequest) -> list[int]:
        """The request's conversation as token ids, made as ``Engine.chat`` makes them
        (:func:`~radixkv.model.tokenizer.encode_chat`)."""
        try:
            return encode_chat(
                self.tokenizer,
                req.template_messages(),
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        except ValueError as e:  # ChatTemplateError is a ValueError
            raise bad_request(f"chat template rejected the messages: {e}", "messages") from None

    def reasoning_mode(self, req: P.ChatCompletionRequest, ids: list[int]) -> ReasoningMode | None:
        """How the replies to chat ``req`` (rendered as ``ids``) are read for reasoning; None
        without a ``--reasoning-parser``. Whether the prompt opens a block is read from the
        text of its last tokens, special tokens kept (the tags sit in the generation prompt)."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return ReasoningMode(
            self.reasoning_parser, self.reasoning_parser.prompt_opens(tail), req.include_reasoning
        )

    def check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        total = len(ids) + max_tokens
        if total > self.max_context:
            raise bad_request(
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the {param}, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param,
                code="context_length_exceeded",
            )

    def check_prompt_logprobs_start(
        self, req: P.CompletionRequest, prompts: list[list[int]]
    ) -> None:
        """400 naming ``prompt_logprobs_start`` unless every prompt is longer than it."""
        start = req.engine_prompt_logprobs_start()
        shortest = min(len(ids) for ids in prompts)
        if start and start >= shortest:
            raise bad_request(
                f"prompt_logprobs_start={start} must be less than the prompt's length "
                f"({shortest} tokens)",
                "prompt_logprobs_start",
            )

    def sampling_params(
        self, req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int
    ) -> SamplingParams:
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        self.check_ids(list(bias), "logit_bias")
        try:
            constraint = request_constraint(req)
        except ValueError as e:  # the decoder checked it already: only a changed request
            raise bad_request(str(e)) from None
        native = self.native_tool_parser(req, constraint is not None)
        try:
            return SamplingParams(
                n=req.n,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=req.min_p,
                max_tokens=max_tokens,
                logprobs=req.engine_logprobs(),
                prompt_logprobs=req.engine_prompt_logprobs(),
                prompt_logprobs_start=req.engine_prompt_logprobs_start(),
                stop=tuple(P.stop_list(req.stop)),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                seed=req.seed,
                min_tokens=req.min_tokens,
                logit_bias=bias,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                priority=req.priority,
                guided=None if constraint is None else constraint.guided,
                beam_width=req.beam_width(),
                length_penalty=req.length_penalty,
                early_stopping=req.early_stopping,
                # a parser whose call marker is a special token reads the reply with it kept
                # (mistral's [TOOL_CALLS], as vLLM does); it leaves it out of the content
                skip_special_tokens=native is None or not native.keeps_special_tokens,
            )
        except (ValueError, TypeError) as e:  # the message starts with the field's name
            name = str(e).split(" ", 1)[0]
            if req.use_beam_search and str(e).startswith("beam search"):
                name = "use_beam_search"
            raise bad_request(str(e), name if name in P.SAMPLING_FIELDS else None) from None

    def native_tool_parser(
        self, req: P.CompletionRequest | P.ChatCompletionRequest, constrained: bool
    ) -> NativeParser | None:
        """The ``--tool-call-parser`` reading the replies to ``req``, with its tools; None when
        they stay text: no parser, not a chat request with tools and ``tool_choice`` "auto",
        or ``constrained`` replies (a client's format is content; forced calls are read
        without a parser)."""
        name = self.config.tool_call_parser
        if name is None or constrained or not isinstance(req, P.ChatCompletionRequest):
            return None
        return NativeParser(name, req.tools) if req.wants_tool_calls() else None

    def echo(self, prompt: str | list[int], ids: list[int], params: SamplingParams) -> Echo:
        """What a choice echoes of ``prompt`` (which runs as ``ids``): a text prompt as given;
        token ids decoded as the engine decodes its output text (``skip_special_tokens``, so
        ids encoded from a text echo that text, BOS aside)."""
        if isinstance(prompt, str):
            text = prompt
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        # the texts of the tokens without a prompt logprob (the first, and those before
        # prompt_logprobs_start) as the engine writes every Logprob.decoded_token
        unscored = (
            ids[1 : params.prompt_logprobs_start] if params.prompt_logprobs is not None else []
        )
        return Echo(text, self.token_texts(ids[0]), tuple(self.token_texts(t) for t in unscored))

    # ------------------------------------------------------------ running a request
    async def run_chat(
        self,
        request: Request,
        principal: Principal,
        req: P.ChatCompletionRequest,
        responses: ResponsesCall | None = None,
    ) -> Response:
        """Run chat ``req`` (its model, rendered conversation, length and sampling checked;
        without ``max_tokens`` up to ``default_max_tokens`` of the context left) and answer
        it, as the Responses API when ``responses`` is given (:meth:`respond`)."""
        lora = self.check_model(req.model)
        ids = self.chat_ids(req)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, self.max_context - len(ids))
            if max_tokens < 1:
                self.check_length(ids, 1, "messages")
        self.check_length(ids, max_tokens, "messages")
        params = self.sampling_params(req, max_tokens)
        return await self.run(
            request,
            principal,
            req,
            [ids],
            params,
            chat=True,
            lora=lora,
            reasoning=self.reasoning_mode(req, ids),
            responses=responses,
        )

    async def run(
        self,
        request: Request,
        principal: Principal,
        req: P.CompletionRequest | P.ChatCompletionRequest,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        chat: bool,
        lora: str | None = None,
        reasoning: ReasoningMode | None = None,
        responses: ResponsesCall | None = None,
    ) -> Response:
        """Run ``prompts`` (with the LoRA adapter ``lora``, if given) and answer ``req``;
        ``reasoning``: how chat replies are read for reasoning (:meth:`reasoning_mode`);
        ``responses``: answer as the Responses API (:meth:`respond`)."""
        echo, echo_only = None, False  # before admission: nothing to release if this fails
        if reasoning is not None and reasoning.opened and params.guided is not None:
            # the reply reasons first: its structured output is what follows the block
            guided = replace(params.guided, start_after=reasoning.parser.end)
            params = replace(params, guided=guided)
        if isinstance(req, P.CompletionRequest) and req.echo:
            echo = [self.echo(p, ids, params) for p, ids in zip(req.prompts(), prompts)]
            echo_only = req.max_tokens == 0
        tool_parser: ToolParser | None = None
        constraint = request_constraint(req)  # the decoder checked it: cannot raise here
        if constraint is not None and constraint.tool_choice is not None:
            tool_parser = constraint.tool_choice  # forced calls: the reply is their JSON
        else:  # a reply constrained to the client's format is content
            tool_parser = self.native_tool_parser(req, constraint is not None)
        guided_param = None if constraint is None else constraint.param
        slot = self.admit(
            len(prompts) * params.n,
            len(prompts),
            params.n,
            "prompt" if len(prompts) > 1 else "n",
            tenant=principal.tenant,
            prompt_tokens=sum(map(len, prompts)),
        )
        if params.guided is not None:
            # compiled (off the event loop) before anything is submitted: a language the
            # engine cannot use is a 400 naming its field, and no prompt of the request runs
            try:
                err = await wait_or_disconnect(self.compile_guided(params), request.receive)
            except ClientGone:
                await slot.release()
                self.metrics.count_client_closed("waiting")
                return Response(status_code=499)
            except BaseException:
                await slot.release()
                raise
            if err is not None:
                await slot.release()
                raise self.submission_error(err, guided_param, lora)
        rid = responses.id if responses else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        namespace = principal.namespace(req.cache_salt)
        sub = Submission(
            self.engine,
            prompts,
            params,
            namespace=namespace,
            request_id=rid,
            echo=echo,
            echo_only=echo_only,
            lora=lora,
            tenant=slot.tenant,
            on_start=slot.started,
        )
        slot.subs.append(sub)
        handed_off = False  # True once an SSEResponse owns the release
        fmt = (
            None
            if params.logprobs is None
            else R.LogprobFormat(params.logprobs, req.return_tokens_as_token_ids)
        )
        try:
            created = int(time.time())
            if req.stream:
                err = await wait_or_disconnect(sub.wait_started(), request.receive)
                if err is not None:
                    raise self.submission_error(err, guided_param, lora)
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                body: AsyncIterator[bytes]
                if responses is not None:
                    body = self._response_events(
                        sub, responses, created, fmt, tool_parser, reasoning
                    )
                else:
                    body = self._stream(
                        sub,
                        rid,
                        req.model,
                        created,
                        chat=chat,
                        include_usage=include_usage,
                        fmt=fmt,
                        tool_parser=tool_parser,
                        reasoning=reasoning,
                    )
                response: Response = SSEResponse(
                    body,
                    headers=R.cache_headers(sub, rid),
                    cleanup=slot.release,
                    on_client_gone=lambda: self.metrics.count_client_closed("streaming"),
                )
                handed_off = True  # the response owns the submission from here on
                return response
            err = await wait_or_disconnect(sub.wait_finished(), request.receive)
            if err is not None:
                raise self.submission_error(err, guided_param, lora)
            for i in range(len(sub.prompts)):
                R.take_deltas(sub, i, self.metrics)
            if chat:
                payload: Any = R.chat_response(
                    sub,
                    rid,
                    req.model,
                    created,
                    fmt,
                    tool_parser,
                    req.prompt_logprobs,
                    reasoning,
                    self._reasoning_tokens(sub, reasoning),
                )
                if responses is not None:
                    payload = self._whole_response(responses, payload)
            else:
                payload = R.completion_response(
                    sub, rid, req.model, created, fmt, req.prompt_logprobs
                )
            return Response(
                P.encode(payload), media_type="application/json", headers=R.cache_headers(sub, rid)
            )
        except ClientGone:
            self.metrics.count_client_closed("waiting")
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        finally:
            if not handed_off:
                await slot.release()

    def admit(
        self, seqs: int, prompts: int, n: int, param: str, *, tenant: str, prompt_tokens: int
    ) -> Admission:
        """Count a request's ``seqs`` sequences (its ``prompts`` prompts of ``prompt_tokens``
        tokens in all, ``n`` samples each, as the messages say) in flight (``max_queue``) and
        in ``tenant``'s load: a request that could never fit is a 400 naming ``param``, one
        past a limit of its tenant a 429 naming the limit (server/tenant_limits.py), one that
        does not fit the server now a 503 (``queue_full``, retry-after). The caller releases
        the slot however the request ends."""
        if seqs > self.config.max_queue:  # could never be admitted: retrying will not help
            raise bad_request(
                f"This request has {seqs} sequences ({prompts} prompts x n={n}), "
                f"more than the server admits at once (max_queue={self.config.max_queue})",
                param,
            )
        limits = self.config.tenant_limits(self.auth.num_tenants)
        try:
            ticket = self.tenants.admit(
                tenant, limits, seqs=seqs, prompts=prompts, n=n, tokens=prompt_tokens, param=param
            )
        except TenantLimitExceeded as e:
            self.metrics.count_tenant_rejected(tenant, e.limit)
            raise
        if self.in_flight + seqs > self.config.max_queue:
            ticket.release()
            raise APIError(
                503,
                f"Server is at capacity ({self.in_flight} sequences in flight, max_queue="
                f"{self.config.max_queue}); retry later",
                code="queue_full",
                headers={"retry-after": "1"},
            )
        self.in_flight += seqs
        return Admission(self, seqs, ticket)

    def submission_error(
        self, err: BaseException, guided_param: str | None, lora: str | None
    ) -> APIError:
        """The response to ``err``; an adapter unloaded between the model check and the
        submission makes the request's model unknown (404), as if it had come a moment later."""
        if lora is not None and isinstance(err, ValueError) and lora not in self.lora_names():
            return self.model_not_found(lora)
        return engine_error(err, guided_param)

    async def compile_guided(self, params: SamplingParams) -> BaseException | None:
        """Compile ``params.guided`` in a worker thread (seconds for a large schema on a large
        vocabulary); the ValueError when the engine cannot use it."""
        try:
            await self.engine.compile_guided(params)
        except (ValueError, TypeError) as e:
            return e
        return None

    async def _deltas(
        self,
        sub: Submission,
        fmt: R.LogprobFormat | None,
        tool_parser: ToolParser | None,
        reasoning: ReasoningMode | None,
    ) -> AsyncIterator[list[R.Delta] | BaseException]:
        """The submission's deltas as they come (reasoning, then tool calls, read out of the
        replies when asked), until it finishes, or an engine error (then nothing more)."""
        choices = range(len(sub.prompts) * sub.params.n)
        # per choice, when reasoning and then tool calls are read out of the replies
        thinking = None if reasoning is None else {k: reasoning.stream() for k in choices}
        calling = None if tool_parser is None else {k: ToolCallStream(tool_parser) for k in choices}

        def take(i: int) -> list[R.Delta]:
            deltas = R.take_deltas(sub, i, self.metrics, fmt)
            if thinking is not None:
                assert reasoning is not None
                deltas = R.with_reasoning(deltas, thinking, reasoning.include)
            return deltas if calling is None else R.with_tool_calls(deltas, calling)

        for i in range(len(sub.prompts)):
            deltas = take(i)
            if deltas:
                yield deltas
        while not sub.finished:
            i, item = await sub.next_event()
            if isinstance(item, BaseException):
                yield item
                return
            deltas = take(i)
            if deltas:
                yield deltas

    async def _stream(
        self,
        sub: Submission,
        rid: str,
        model: str,
        created: int,
        *,
        chat: bool,
        include_usage: bool,
        fmt: R.LogprobFormat | None,
        tool_parser: ToolParser | None = None,
        reasoning: ReasoningMode | None = None,
    ) -> AsyncIterator[bytes]:
        chunk = R.chat_chunk if chat else R.completion_chunk
        if chat:
            yield R.chat_role_chunk(rid, model, created, sub.params.n)
        async for deltas in self._deltas(sub, fmt, tool_parser, reasoning):
            if isinstance(deltas, BaseException):
                yield R.sse(engine_error(deltas).body_struct())
                break
            yield chunk(rid, model, created, deltas)
        if include_usage:
            yield R.usage_chunk(
                sub, rid, model, created, chat, self._reasoning_tokens(sub, reasoning)
            )
        yield R.SSE_DONE

    # ------------------------------------------------------------ the Responses API
    async def respond(
        self, request: Request, principal: Principal, rreq: ResponsesRequest
    ) -> Response:
        """``POST /v1/responses``: ``rreq`` run as the chat request it maps to
        (server/responses.py); errors name the Responses API's fields."""
        try:
            prior: list[P.ChatMessage] = []
            if rreq.previous_response_id is not None:
                stored = self.responses.get(principal.tenant, rreq.previous_response_id)
                if stored is None:
                    raise APIError(
                        404,
                        f"Previous response with id '{rreq.previous_response_id}' not found "
                        "(responses are kept in this server's memory, per tenant, while "
                        "store=true and until it restarts)",
                        param="previous_response_id",
                        code="previous_response_not_found",
                    )
                prior = stored.history
            try:
                req = rreq.chat_request(prior)
            except ValueError as e:  # msgspec's ValidationError is one
                raise bad_request(str(e), error_param(str(e))) from None
            call = ResponsesCall(rreq, req.messages, principal.tenant, new_id("resp"))
            return await self.run_chat(request, principal, req, responses=call)
        except APIError as e:
            e.param = RESPONSES_PARAMS.get(e.param or "", e.param)
            raise

    def _reasoning_tokens(self, sub: Submission, reasoning: ReasoningMode | None) -> int | None:
        """The replies' reasoning tokens, all choices together; None without a parser."""
        if reasoning is None:
            return None
        skip = sub.params.skip_special_tokens

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=skip)

        return sum(
            reasoning.parser.reasoning_tokens(decode, c.token_ids, reasoning.opened)
            for p in sub.prompts
            if p.latest is not None
            for c in p.latest.outputs
        )

    def _keep(self, call: ResponsesCall, response: ResponseObject) -> None:
        if call.request.store:
            self.responses.put(
                call.tenant, Stored(response, responses_history(response, call.conversation))
            )

    def _whole_response(
        self, call: ResponsesCall, chat: P.ChatCompletionResponse
    ) -> ResponseObject:
        """A finished chat response as the Responses API's response (its usage with the
        reasoning tokens the chat response counted)."""
        writer = ResponseWriter(responses_shell(call.request, call.id, chat.created))
        choice = chat.choices[0]
        msg = choice.message
        writer.reasoning(msg.reasoning or "")
        writer.content(msg.content or "")
        calls = [
            ToolCall(c.function.name, c.function.arguments, c.id) for c in msg.tool_calls or []
        ]
        if calls:
            writer.calls(calls)
        writer.finish(choice.finish_reason, response_usage(chat.usage))
        self._keep(call, writer.response)
        return writer.response

    async def _response_events(
        self,
        sub: Submission,
        call: ResponsesCall,
        created: int,
        fmt: R.LogprobFormat | None,
        tool_parser: ToolParser | None,
        reasoning: ReasoningMode | None,
    ) -> AsyncIterator[bytes]:
        """The Responses API's stream: typed events, the last one the whole response."""
        writer = ResponseWriter(responses_shell(call.request, call.id, created))
        for event in writer.started():
            yield R.sse_event(event)
        async for deltas in self._deltas(sub, fmt, tool_parser, reasoning):
            if isinstance(deltas, BaseException):
                err = engine_error(deltas)
                yield R.sse_event({"type": "error", "code": err.code, "message": err.message})
                return
            for d in deltas:
                events = writer.reasoning(d.reasoning or "") + writer.content(d.text)
                if d.tool_calls:
                    events += writer.calls(d.tool_calls)
                if d.finish_reason is not None:
                    usage = R.usage(sub, self._reasoning_tokens(sub, reasoning))
                    events += writer.finish(d.finish_reason, response_usage(usage))
                for event in events:
                    yield R.sse_event(event)
        self._keep(call, writer.response)


class Admission:
    """A request's sequences counted in flight (``ServerState.admit``) and the submissions made
    under it (``subs``): ``release`` closes them (aborting what still runs, freeing locks and
    pages) and gives the count back, once, however often it is called."""

    def __init__(self, state: ServerState, seqs: int, ticket: TenantTicket) -> None:
        self._state = state
        self.seqs = seqs
        self.subs: list[Submission] = []
        self._ticket = ticket
        self._released = False

    @property
    def tenant(self) -> str:
        return self._ticket.tenant

    def started(self, prompt: PromptState) -> None:
        """A prompt's first output came: its sequences count as running (Submission's
        ``on_start``)."""
        self._ticket.started(len(prompt.choices), prompt.prompt_tokens)

    async def release(self) -> None:
        if not self._released:
            self._released = True
            self._ticket.release()
            for sub in self.subs:
                await sub.close()
            self._state.in_flight -= self.seqs


@dataclass(frozen=True)
class ResponsesCall:
    """A chat request run for ``POST /v1/responses``: the request, the conversation it ran
    (for a continuation), whose it is (the store is per tenant) and the response id."""

    request: ResponsesRequest
    conversation: list[P.ChatMessage]
    tenant: str
    id: str


def _lora_not_found(name: str, loaded: list[str]) -> APIError:
    """vLLM's 404 for an adapter that is not loaded, naming the loaded ones."""
    names = _listed(loaded, "'") or "none"
    return APIError(
        404,
        f"The lora adapter '{name}' cannot be found (loaded: {names}).",
        param="lora_name",
        code="lora_not_found",
    )


def engine_error(err: BaseException, guided_param: str | None = None) -> APIError:
    """The response to an engine error; a ValueError at submission is the request's fault (400):
    one about its guided decoding names ``guided_param``, the field the constraint came from."""
    if isinstance(err, QueueFull):
        return APIError(503, str(err), code="queue_full", headers={"retry-after": "1"})
    if isinstance(err, PriorityNeedsPolicy):  # the engine's intake checks it, in its words
        return bad_request(
            f"priority={err.priority} needs the server started with --schedule-policy "
            "priority; under the other policies it must be 0",
            "priority",
        )
    if isinstance(err, ValueError | TypeError):
        message = str(err)
        param = None
        if message.startswith("guided") and guided_param is not None:
            param = guided_param
            message = f"{guided_param}: {message.removeprefix('guided json: ')}"
        elif message.startswith("prompt_logprobs_start"):
            param = "prompt_logprobs_start"
        return bad_request(message, param)
    log.error("request failed in the engine: %r", err)
    return APIError(500, f"The engine failed while serving the request: {err}")


def _listed(names: list[str], quote: str, more_hint: str = "") -> str:
    """Up to MAX_LISTED_MODELS names, quoted and comma-separated, then how many more (and
    ``more_hint``) when there are more: an error message names what is served, not thousands."""
    text = ", ".join(f"{quote}{n}{quote}" for n in names[:MAX_LISTED_MODELS])
    if len(names) > MAX_LISTED_MODELS:
        text += f" and {len(names) - MAX_LISTED_MODELS} more{more_hint}"
    return text
