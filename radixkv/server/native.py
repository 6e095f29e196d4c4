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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from radixkv import __version__
from radixkv.engine.outputs import CompletionOutput, Logprob, RequestOutput
from radixkv.engine.params import GuidedDecodingParams, SamplingParams
from radixkv.server import protocol as P
from radixkv.server import render as R
from radixkv.server.auth import Principal
from radixkv.server.errors import APIError, bad_request
from radixkv.server.state import ServerState, engine_error
from radixkv.server.submission import Echo, Submission
from radixkv.server.transport import ClientGone, SSEResponse, read_body, wait_or_disconnect

__all__ = ["GenerateRequest", "NativeSamplingParams", "add_native_routes"]

log = logging.getLogger("radixkv.server")

SGLANG_VERSION = "0.5.23"  # whose wire formats these are
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
GREEDY_BELOW = 1e-6  # SGLang samples greedily below this temperature
_MIN_LOGPROB = -9999.0  # JSON has no infinity (the OpenAI routes send the same)
HEALTH_TIMEOUT_S = 20.0
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class NativeSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``sampling_params`` object (its ``SamplingParams`` contract: unknown keys are
    refused). null means the default, as in SGLang, except ``max_new_tokens``: null there is
    "up to the context length"."""

    max_new_tokens: NonNegative | None = DEFAULT_MAX_NEW_TOKENS
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegative] | None = None
    stop_regex: str | list[str] | None = None  # refused when set
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: int | None = None  # -1 (or the vocabulary or more): all tokens
    min_p: Probability | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: (
        Annotated[float, msgspec.Meta(gt=0.0, le=P.MAX_REPETITION_PENALTY)] | None
    ) = None
    min_new_tokens: NonNegative | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=P.MAX_N)] | None = None
    beam_width: int | None = None  # > 1: beam search, ``n`` of its hypotheses returned
    json_schema: str | dict[str, Any] | None = None  # "$$ANY$$": any JSON value
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None  # refused when set
    choice: list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None  # accepted; decoding ignores it
    no_stop_trim: bool | None = None
    stream_interval: int | None = None  # operational: every output is streamed
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    sampling_seed: Annotated[int, msgspec.Meta(ge=0, le=P.MAX_SEED)] | None = None
    custom_params: Any = None  # for custom logit processors, which are refused: unused
    watermark: Any = None  # refused when enabled


_SAMPLING_FIELDS = tuple(NativeSamplingParams.__struct_fields__)
_GUIDED_FIELDS = ("json_schema", "regex", "ebnf", "choice")


class GenerateRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``POST /generate`` body (``GenerateReqInput``). Fields past the first group
    are accepted only unset (see ``_REFUSED``) or are operational and ignored."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    lora_path: str | list[str | None] | None = None
    cache_salt: str | list[str] | None = None
    extra_key: str | list[str] | None = None
    priority: int | None = None
    return_prompt_token_ids: bool = False
    # refused when set: radixkv cannot honour them
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    return_indexer_topk: Any = None
    return_entropy: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    require_reasoning: Any = None
    max_thinking_tokens: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    watermark: Any = None
    # operational (routing, disaggregation, logging, media options without media): ignored
    session_id: Any = None
    lora_id: Any = None
    log_metrics: Any = None
    modalities: Any = None
    sampling_logprobs_mode: Any = None
    routed_experts_start_len: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    routing_key: Any = None
    conversation_id: Any = None
    http_worker_ipc: Any = None
    background: Any = None
    no_logs: Any = None
    custom_labels: Any = None
    return_bytes: Any = None
    external_trace_header: Any = None
    received_time: Any = None
    kv_hints: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None


# field -> why it is refused when set
_REFUSED = {
    "input_embeds": "radixkv takes text or input_ids",
    "image_data": "radixkv serves text-only models",
    "video_data": "radixkv serves text-only models",
    "audio_data": "radixkv serves text-only models",
    "token_ids_logprob": "logprobs of chosen token ids are not supported (use top_logprobs_num)",
    "return_hidden_states": "hidden states are not returned",
    "return_routed_experts": "radixkv serves no mixture-of-experts models",
    "return_indexer_topk": "radixkv has no sparse-attention indexer",
    "return_entropy": "entropies are not returned",
    "return_sampling_mask": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_output_top_logprobs": "top logprobs come as nested lists only",
    "return_flat_raw_top_logprobs_b64": "top logprobs come as nested lists only",
    "session_params": "sessions are not supported (the prefix cache reuses earlier turns)",
    "custom_logit_processor": "custom logit processors are not supported",
    "positional_embed_overrides": "embedding overrides are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "require_reasoning": "reasoning control is not supported on /generate",
    "max_thinking_tokens": "thinking budgets are not supported",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
    "token_indices_to_pool": "pooled readout is not supported",
    "watermark": "watermarking is not supported",
}


def _is_set(value: Any) -> bool:
    """Whether a refused field asks for something: not null, false, empty, or a list of those
    (a batch's per-prompt values); a watermark only when enabled."""
    if value is None or value is False:
        return False
    if isinstance(value, list):
        return any(_is_set(v) for v in value)
    if isinstance(value, dict):
        return bool(value) and value.get("enabled", True) is not False
    if isinstance(value, str):
        return bool(value)
    return True


# ---------------------------------------------------------------- the plan of one request


@dataclass(frozen=True)
class LogprobPlan:
    """What a prompt returns of logprobs (``return_logprob``): ``start`` is SGLang's
    ``logprob_start_len`` resolved (the prompt's length: output tokens only), ``top`` is
    ``top_logprobs_num``, ``text``: each entry carries its token's text."""

    start: int
    top: int
    text: bool


@dataclass(frozen=True)
class Item:
    """One prompt of a /generate request and how it runs."""

    ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # as asked: 0 runs the prompt and shows no output (SGLang's prefill)
    sample_ids: list[str]  # meta_info.id per returned entry (beam search: one)
    logprobs: LogprobPlan | None
    lora: str | None
    namespace: Any
    guided_param: str | None  # the field a guided-decoding error names

    @property
    def beam(self) -> bool:
        return self.params.beam_width > 0

    @property
    def hidden(self) -> bool:
        return self.max_new_tokens == 0


@dataclass(frozen=True)
class Plan:
    items: list[Item]
    batch: bool  # the answer is a list (a list of prompts, or n > 1)
    stream: bool
    prompt_token_ids: bool  # each entry carries its prompt's ids (return_prompt_token_ids)
    source: str  # "text" or "input_ids": the field the prompts came from


def _field(name: str, i: int | None) -> str:
    return name if i is None else f"{name}[{i}]"


def _sampling_param(field: str, i: int | None) -> str:
    return f"{_field('sampling_params', i)}.{field}"


def _per_prompt(value: Any, name: str, count: int, batch: bool) -> list[Any]:
    """A field that is one value for every prompt or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if not batch and len(value) == 1:
        return value
    if not batch:
        raise bad_request(f"{name} must be a single value for a single prompt", name)
    if len(value) != count:
        raise bad_request(
            f"{name} has {len(value)} entries for {count} prompts (give one value or one per "
            "prompt)",
            name,
        )
    return value


def parse_sampling_params(raw: dict[str, Any], i: int | None) -> NativeSamplingParams:
    """One ``sampling_params`` object, or 400 naming the field (``sampling_params.x``, in a
    list ``sampling_params[i].x``); an unknown key is refused, as SGLang refuses it."""
    for key in raw:
        if key not in _SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in _SAMPLING_FIELDS)
            raise bad_request(
                f"unknown field `{key}` in sampling_params, expected one of {listed}",
                _sampling_param(key, i),
            )
    try:
        sp = msgspec.convert(raw, NativeSamplingParams)
    except msgspec.ValidationError as e:
        msg = str(e)
        path = msg.rpartition("- at `$")[2].rstrip("`")
        field = path.lstrip(".").split("[", 1)[0].split(".", 1)[0] or None
        param = _sampling_param(field, i) if field else _field("sampling_params", i)
        raise bad_request(f"{param}: {msg}", param) from None
    for name, why in (
        ("stop_regex", "stop regexes are not supported (use stop strings)"),
        ("structural_tag", "structural tags are not supported (use json_schema or ebnf)"),
        ("watermark", "watermarking is not supported"),
    ):
        if _is_set(getattr(sp, name)):
            param = _sampling_param(name, i)
            raise bad_request(f"{param} is not supported by this server: {why}", param)
    return sp


def _guided(sp: NativeSamplingParams, i: int | None) -> tuple[GuidedDecodingParams | None, str]:
    """The constraint of ``sp`` (at most one of json_schema, regex, ebnf and choice) and the
    parameter a compile error names."""
    given = [
        f for f in _GUIDED_FIELDS if getattr(sp, f) not in (None, "", [])
    ]  # SGLang: empty means unset
    if not given:
        return None, ""
    param = _sampling_param(given[0], i)
    if len(given) > 1:
        raise bad_request(
            f"only one of json_schema, regex, ebnf and choice can be set, got {', '.join(given)}",
            param,
        )
    try:
        if sp.json_schema is not None and sp.json_schema != "":
            schema = sp.json_schema
            return GuidedDecodingParams(json="{}" if schema == "$$ANY$$" else schema), param
        if sp.regex:
            return GuidedDecodingParams(regex=sp.regex), param
        if sp.ebnf:
            return GuidedDecodingParams(grammar=sp.ebnf), param
        return GuidedDecodingParams(choice=tuple(sp.choice or ())), param
    except (ValueError, TypeError) as e:
        raise bad_request(f"{param}: {e}", param) from None


# radixkv SamplingParams field (the start of its error messages) -> the SGLang field
_ENGINE_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
    "beam": "beam_width",
}
_TOP_LEVEL_NAMES = {
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "prompt_logprobs_start": "logprob_start_len",
    "priority": "priority",
}


class _Planner:
    """Validates a /generate request into a :class:`Plan` (400 naming the field otherwise)."""

    def __init__(self, st: ServerState, principal: Principal) -> None:
        self.st = st
        self.principal = principal

    def prompts(self, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
        """The prompts' token ids, whether they are a batch, and the field they came from."""
        if (req.text is None) == (req.input_ids is None):
            if req.text is None:
                raise bad_request("Either text or input_ids should be provided.", "text")
            raise bad_request("text and input_ids: give exactly one of them", "input_ids")
        if req.text is not None:
            texts = [req.text] if isinstance(req.text, str) else req.text
            if not texts:
                raise bad_request("text must not be an empty list", "text")
            batch = not isinstance(req.text, str)
            out = []
            for i, t in enumerate(texts):
                ids = list(self.st.tokenizer.encode(t))
                if not ids:
                    raise bad_request(
                        "text encodes to no tokens", _field("text", i if batch else None)
                    )
                out.append(ids)
            return out, batch, "text"
        raw = req.input_ids
        assert raw is not None
        if not raw:
            raise bad_request("input_ids cannot be empty.", "input_ids")
        flat = [x for x in raw if isinstance(x, int)]
        if len(flat) == len(raw):
            return [self.st.check_ids(flat, "input_ids")], False, "input_ids"
        if not all(isinstance(x, list) for x in raw):
            raise bad_request(
                "input_ids must be a list of token ids or a list of such lists (not a mixture)",
                "input_ids",
            )
        out = []
        for i, ids in enumerate(raw):
            assert isinstance(ids, list)
            if not ids:
                raise bad_request("input_ids cannot be empty.", f"input_ids[{i}]")
            out.append(self.st.check_ids(list(ids), f"input_ids[{i}]"))
        return out, True, "input_ids"

    def plan(self, req: GenerateRequest) -> Plan:
        for name, why in _REFUSED.items():
            if _is_set(getattr(req, name)):
                raise bad_request(f"{name} is not supported by this server: {why}", name)
        prompts, batch, source = self.prompts(req)
        count = len(prompts)
        raw_sp = req.sampling_params
        if isinstance(raw_sp, list):
            if not batch and len(raw_sp) != 1:
                raise bad_request(
                    "sampling_params must be one object for a single prompt", "sampling_params"
                )
            if batch and len(raw_sp) != count:
                raise bad_request(
                    f"sampling_params has {len(raw_sp)} entries for {count} prompts",
                    "sampling_params",
                )
            sps = [parse_sampling_params(d, i) for i, d in enumerate(raw_sp)]
        else:
            sps = [parse_sampling_params(raw_sp or {}, None)] * count
        ns = {sp.n or 1 for sp in sps}
        if len(ns) > 1:
            raise bad_request(
                "The parallel_sample_num should be the same for all samples in sample params.",
                "sampling_params",
            )
        n = ns.pop()
        beams = [(sp.beam_width or 1) > 1 for sp in sps]
        if len(set(beams)) > 1:
            raise bad_request(
                "beam_width must be > 1 for every prompt of a batch or for none",
                "sampling_params",
            )
        beam = beams[0]
        answer_is_list = batch or (n > 1 and not beam)
        rids = self.sample_ids(req.rid, count, batch, n, beam)
        flags = _per_prompt(req.return_logprob, "return_logprob", count, batch)
        starts = _per_prompt(req.logprob_start_len, "logprob_start_len", count, batch)
        tops = _per_prompt(req.top_logprobs_num, "top_logprobs_num", count, batch)
        loras = _per_prompt(req.lora_path, "lora_path", count, batch)
        salts = _per_prompt(req.cache_salt, "cache_salt", count, batch)
        keys = _per_prompt(req.extra_key, "extra_key", count, batch)
        priority = self.priority(req.priority)
        items = []
        for i, ids in enumerate(prompts):
            at = i if batch else None
            logprobs = self.logprobs(ids, flags[i], starts[i], tops[i], req, at)
            sp = sps[i]
            sp_at = i if isinstance(raw_sp, list) else None  # the list entry errors name
            params, max_new, guided_param = self.sampling(
                sp, ids, logprobs, priority, _field(source, at), sp_at
            )
            lora_at = at if isinstance(req.lora_path, list) else None
            items.append(
                Item(
                    ids=ids,
                    params=params,
                    max_new_tokens=max_new,
                    sample_ids=rids[i],
                    logprobs=logprobs,
                    lora=self.lora(loras[i], _field("lora_path", lora_at)),
                    namespace=self.namespace(salts[i], keys[i], at),
                    guided_param=guided_param,
                )
            )
        return Plan(items, answer_is_list, req.stream, req.return_prompt_token_ids, source)

    @staticmethod
    def sample_ids(
        rid: str | list[str] | None, count: int, batch: bool, n: int, beam: bool
    ) -> list[list[str]]:
        """meta_info.id of each returned entry, per prompt, as SGLang names them: the ``rid``
        (a batch's given list, or ``rid_i`` from one string), else a fresh id; each of ``n`` > 1
        samples gets a fresh id (SGLang runs them as requests of their own)."""
        if isinstance(rid, list):
            if not batch and len(rid) == 1:
                rid = rid[0]
            elif not batch:
                raise bad_request("rid must be a string for a single prompt", "rid")
            elif len(rid) != count:
                raise bad_request(
                    "The specified rids length mismatch with the batch_size for batch processing.",
                    "rid",
                )
            elif len(set(rid)) != len(rid):
                dup = sorted({r for r in rid if rid.count(r) > 1})
                raise bad_request(
                    f"Duplicate request IDs detected within the request: {dup}", "rid"
                )
        if n > 1 and not beam:
            return [[uuid.uuid4().hex for _ in range(n)] for _ in range(count)]
        if isinstance(rid, list):
            return [[r] for r in rid]
        if rid is None:
            return [[uuid.uuid4().hex] for _ in range(count)]
        return [[f"{rid}_{i}"] for i in range(count)] if batch else [[rid]]

    def priority(self, priority: int | None) -> int:
        """The engine's priority (lower first) of SGLang's (higher first, its default)."""
        if not priority:
            return 0
        if self.st.engine.engine.config.schedule_policy != "priority":
            raise bad_request(
                f"priority={priority} needs the server started with --schedule-policy "
                "priority; under the other policies leave it unset",
                "priority",
            )
        if abs(priority) > 2**31 - 1:
            raise bad_request("priority must be in [-(2**31 - 1), 2**31 - 1]", "priority")
        return -priority

    def logprobs(
        self,
        ids: list[int],
        flag: bool | None,
        start: int | None,
        top: int | None,
        req: GenerateRequest,
        at: int | None,
    ) -> LogprobPlan | None:
        if not flag:
            return None  # SGLang ignores logprob_start_len and top_logprobs_num then
        top = top or 0
        if not 0 <= top <= P.MAX_LOGPROBS:
            raise bad_request(
                f"top_logprobs_num must be in [0, {P.MAX_LOGPROBS}], got {top}", "top_logprobs_num"
            )
        if start is None or start == -1:
            start = len(ids)  # output tokens only
        elif start < -1:
            raise bad_request(
                f"logprob_start_len must be -1 (output only) or >= 0, got {start}",
                "logprob_start_len",
            )
        elif start > len(ids):
            raise bad_request(
                f"logprob_start_len={start} is higher than the number of input tokens "
                f"({len(ids)}{'' if at is None else f' in prompt {at}'}). Please use a smaller "
                "logprob_start_len.",
                "logprob_start_len",
            )
        return LogprobPlan(start, top, req.return_text_in_logprobs)

    def sampling(
        self,
        sp: NativeSamplingParams,
        ids: list[int],
        logprobs: LogprobPlan | None,
        priority: int,
        prompt_param: str,
        i: int | None,
    ) -> tuple[SamplingParams, int, str | None]:
        """The engine's parameters for one prompt, the max_new_tokens asked for, and the
        field a guided-decoding error names."""
        st = self.st
        max_new = sp.max_new_tokens
        if max_new is None:  # null: up to the context length
            max_new = st.max_context - len(ids)
            if max_new < 1:
                st.check_length(ids, 1, prompt_param)
        min_new = sp.min_new_tokens or 0
        if min_new > max_new:
            raise bad_request(
                f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.",
                _sampling_param("min_new_tokens", i),
            )
        engine_max = max(1, max_new)  # 0: the prompt runs (cached, scored) and one token
        st.check_length(ids, engine_max, prompt_param)
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}",
                _sampling_param("stop", i),
            )
        if any(s == "" for s in stops):
            raise bad_request("stop strings must be non-empty", _sampling_param("stop", i))
        stop_ids = list(sp.stop_token_ids or ())
        st.check_ids(stop_ids, _sampling_param("stop_token_ids", i))
        bias: dict[int, float] = {}
        for key, value in (sp.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise bad_request(
                    f"logit_bias keys must be token ids (digits), got {key[:40]!r}",
                    _sampling_param("logit_bias", i),
                )
            bias[int(key)] = value
        st.check_ids(list(bias), _sampling_param("logit_bias", i))
        top_k = 0 if sp.top_k is None else sp.top_k
        if top_k < -1:
            raise bad_request(
                f"top_k must be -1 (disable) or at least 1, got {top_k}.",
                _sampling_param("top_k", i),
            )
        if top_k == -1 or top_k >= min(TOP_K_ALL, st.vocab_size):
            top_k = 0
        temperature = 1.0 if sp.temperature is None else sp.temperature
        if temperature < GREEDY_BELOW:
            temperature = 0.0
        width = sp.beam_width
        if width is not None and width < 1:
            raise bad_request(
                f"beam_width must be at least 1, got {width}.", _sampling_param("beam_width", i)
            )
        beam_width = width if width is not None and width > 1 else 0
        guided, guided_param = _guided(sp, i)
        prompt_logprobs = prompt_start = None
        if logprobs is not None and logprobs.start + 1 < len(ids):
            # SGLang's entry for the token at logprob_start_len has no value (None); the
            # engine's values begin with the next token
            prompt_logprobs, prompt_start = logprobs.top, logprobs.start + 1
        try:
            params = SamplingParams(
                n=sp.n or 1,
                temperature=temperature,
                top_p=1.0 if sp.top_p is None else sp.top_p,
                top_k=top_k,
                min_p=sp.min_p or 0.0,
                max_tokens=engine_max,
                stop=tuple(stops),
                stop_token_ids=tuple(stop_ids),
                include_stop_str_in_output=bool(sp.no_stop_trim),
                ignore_eos=bool(sp.ignore_eos),
                seed=sp.sampling_seed,
                skip_special_tokens=sp.skip_special_tokens is not False,
                logprobs=None if logprobs is None else logprobs.top,
                prompt_logprobs=prompt_logprobs,
                prompt_logprobs_start=prompt_start or 0,
                min_tokens=min_new,
                logit_bias=bias,
                presence_penalty=sp.presence_penalty or 0.0,
                frequency_penalty=sp.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if sp.repetition_penalty is None else sp.repetition_penalty
                ),
                priority=priority,
                guided=guided,
                beam_width=beam_width,
            )
        except (ValueError, TypeError) as e:  # the message starts with the engine's field name
            message = str(e)
            first = message.split(" ", 1)[0].split("=", 1)[0]
            if first in _TOP_LEVEL_NAMES:
                param = _TOP_LEVEL_NAMES[first]
            elif first == "guided" and guided_param:
                param = guided_param
            else:
                name = _ENGINE_NAMES.get(first, first)
                param = _sampling_param(name, i) if name in _SAMPLING_FIELDS else None
            raise bad_request(message, param) from None
        return params, max_new, guided_param or None

    def lora(self, name: str | None, param: str) -> str | None:
        """The loaded LoRA adapter ``lora_path`` names (None, "" or the served model's name:
        the base model); 400 naming what is loaded otherwise."""
        if not name or name == self.st.model_name:
            return None
        loaded = self.st.lora_names()
        if name in loaded:
            return name
        shown = ", ".join(repr(n) for n in loaded[:20]) or "none"
        raise bad_request(
            f"lora_path {name!r} is not a loaded LoRA adapter (loaded: {shown}); load it with "
            "POST /v1/load_lora_adapter or radixkv serve --lora-modules",
            param,
        )

    def namespace(self, salt: str | None, key: str | None, at: int | None) -> Any:
        """The prompt's prefix-cache namespace: the tenant's, narrowed by ``cache_salt`` as on
        the OpenAI routes (the same salt shares their cache), and by ``extra_key``."""
        for name, value in (("cache_salt", salt), ("extra_key", key)):
            if value is not None and len(value) > 256:
                raise bad_request(f"{name} must be at most 256 characters", _field(name, at))
        salt = salt or None  # SGLang: empty means unset
        base = self.principal.namespace(salt)
        if not key:
            return base
        # a longer tuple than any (tenant, salt): cannot meet an OpenAI-route namespace
        return (self.principal.tenant, salt or "", "extra_key", key)


# ---------------------------------------------------------------- the answer


def _value(x: float) -> float:
    return max(x, _MIN_LOGPROB)


def _entry(logprob: float | None, token: int, text: str | None) -> list[Any]:
    """SGLang's ``[logprob, token_id, text_or_null]``."""
    return [None if logprob is None else _value(logprob), token, text]


def _top_row(entry: dict[int, Logprob], k: int, with_text: bool) -> list[list[Any]]:
    """The ``k`` most likely tokens at one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
    return [_entry(lp.logprob, t, lp.decoded_token if with_text else None) for t, lp in ranked]


class Renderer:
    """Engine outputs as SGLang's ``{"text", "output_ids", "meta_info"}`` entries."""

    def __init__(self, st: ServerState) -> None:
        self.st = st
        self._input_cache: dict[int, tuple[list[Any], list[Any] | None]] = {}

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

    def _inputs(self, k: int, item: Item, out: RequestOutput) -> tuple[list[Any], list[Any] | None]:
        """input_token_logprobs and (with top_logprobs_num) input_top_logprobs of prompt ``k``,
        from logprob_start_len on: its first entry has no value (as in SGLang)."""
        cached = self._input_cache.get(k)
        if cached is not None:
            return cached
        plan = item.logprobs
        assert plan is not None
        ids = item.ids
        texts = self.st.token_texts
        tokens: list[Any] = []
        tops: list[Any] | None = [] if plan.top > 0 else None
        if plan.start < len(ids):
            first = ids[plan.start]
            tokens.append(_entry(None, first, texts(first) if plan.text else None))
            if tops is not None:
                tops.append(None)
            entries = out.prompt_logprobs
            rest = ids[plan.start + 1 :]
            if rest and entries is None:
                return tokens, tops  # not computed yet (the prefill is not complete): later
            for pos, tok in enumerate(rest, plan.start + 1):
                assert entries is not None
                entry = entries[pos]
                assert entry is not None  # the engine scores every token from the start on
                lp = entry[tok]
                tokens.append(_entry(lp.logprob, tok, lp.decoded_token if plan.text else None))
                if tops is not None:
                    tops.append(_top_row(entry, plan.top, plan.text))
        self._input_cache[k] = (tokens, tops)
        return tokens, tops

    def meta(
        self, k: int, item: Item, out: RequestOutput, c: CompletionOutput, sample_id: str
    ) -> dict[str, Any]:
        finish = self.finish_reason(item, c)
        shown = [] if item.hidden else c.token_ids
        meta: dict[str, Any] = {
            "id": sample_id,
            "finish_reason": finish,
            "prompt_tokens": len(item.ids),
            "weight_version": "default",
        }
        plan = item.logprobs
        if plan is not None:
            inputs, input_tops = self._inputs(k, item, out)
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


def _encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def native_error(err: APIError) -> Response:
    """An error as the native routes answer it: SGLang's ``{"error": {"message", "code"}}``
    (``code`` the HTTP status), with radixkv's ``type`` and the ``param`` at fault."""
    body = {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}
    }
    return Response(
        _encode(body), status_code=err.status, media_type="application/json", headers=err.headers
    )


def _stream_error(err: APIError, index: int | None) -> bytes:
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
    return b"data: " + _encode(body) + b"\n\n"


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
            plan = _Planner(st, principal).plan(req)
            return await self.run(request, plan)
        except APIError as e:
            st.metrics.count_http_error(e.status)
            return native_error(e)

    def _error(self, err: BaseException, item: Item) -> APIError:
        if item.lora is not None and item.lora not in self.st.lora_names():
            return bad_request(f"lora_path {item.lora!r} was unloaded", "lora_path")
        return engine_error(err, item.guided_param)

    async def run(self, request: Request, plan: Plan) -> Response:
        st = self.st
        items = plan.items
        slot = st.admit(
            sum(it.params.n for it in items),
            len(items),
            items[0].params.n,
            plan.source if len(items) > 1 else "sampling_params.n",
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
                    )
                )
            renderer = Renderer(st)
            if plan.stream:
                failed = await wait_or_disconnect(_wait(subs, started=True), request.receive)
                if failed is not None:
                    raise self._error(failed[1], items[failed[0]])
                response = SSEResponse(
                    self._stream(subs, plan, renderer),
                    headers=self._headers(subs, items),
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
                _encode(payload), media_type="application/json", headers=self._headers(subs, items)
            )
        except ClientGone:
            st.metrics.count_client_closed("waiting")
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        finally:
            if not handed_off:
                await slot.release()

    @staticmethod
    def _headers(subs: list[Submission], items: list[Item]) -> dict[str, str]:
        cached = sum(s.cached_tokens for s in subs)
        return {
            "x-cache-hit": "true" if cached > 0 else "false",
            "x-cached-tokens": str(cached),
            "x-request-id": items[0].sample_ids[0],
        }

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
                        yield b"data: " + _encode(chunk) + b"\n\n"
                failed = _error_of(subs)
                if failed is not None:
                    k, err = failed
                    index = first_index[k] if plan.batch else None
                    yield _stream_error(self._error(err, items[k]), index)
                    break
                if all(s.finished for s in subs):
                    break
                moved = await waker.wait()
        finally:
            waker.close()
        yield R.SSE_DONE

    # ------------------------------------------------------------ the other routes
    def model_info(self) -> dict[str, Any]:
        core = self.st.engine.engine
        path = str(core.model.name)
        return {
            "model_path": path,
            "served_model_name": self.st.model_name,
            "tokenizer_path": str(getattr(core.config, "tokenizer", None) or path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "reasoning_parser": self.st.config.reasoning_parser,
            "tool_call_parser": self.st.config.tool_call_parser,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": [core.model.config.architecture],
        }

    async def server_info(self) -> dict[str, Any]:
        st = self.st
        core = st.engine.engine
        cfg = core.config
        stats = await asyncio.wait_for(st.engine.stats(), timeout=10)
        info = self.model_info()
        return {
            "model_path": info["model_path"],
            "served_model_name": st.model_name,
            "tokenizer_path": info["tokenizer_path"],
            "context_length": st.max_context,
            "max_context_length": st.max_context,
            "max_total_num_tokens": core.pool.num_pages * core.page_size,
            "page_size": core.page_size,
            "max_running_requests": cfg.max_running_requests,
            "max_queued_requests": st.config.max_queue,
            "chunked_prefill_size": cfg.chunked_prefill_size,
            "schedule_policy": cfg.schedule_policy,
            "disable_radix_cache": not cfg.enable_prefix_cache,
            "attention_backend": core.backend_choice.name,
            "device": str(getattr(core.kv_pool, "device", "cpu")),
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
        return Response(_encode(api.model_info()), media_type="application/json")

    async def server_info(request: Request) -> Response:
        st.auth.authenticate(request.headers.get("authorization"))
        return Response(_encode(await api.server_info()), media_type="application/json")

    async def flush_cache(request: Request) -> Response:
        st.auth.require_admin(request.headers.get("authorization"))
        await st.engine.reset_prefix_cache()
        return Response(FLUSHED, media_type="text/plain")

    async def health_generate(request: Request) -> Response:
        return await api.health_generate()

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, _native(st, model_info), methods=["GET"], **hidden)
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, _native(st, server_info), methods=["GET"], **hidden)
    app.add_api_route("/flush_cache", _native(st, flush_cache), methods=["GET", "POST"], **hidden)
    app.add_api_route("/health_generate", _native(st, health_generate), methods=["GET"], **hidden)
