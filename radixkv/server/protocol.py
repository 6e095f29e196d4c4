"""OpenAI-compatible request and response shapes (msgspec Structs).

Requests are decoded the way real OpenAI clients send them (``decode_request``):

- ``null`` for an optional field means "not given" (its default), at any depth;
- neutral values of features the engine does not have are accepted (``"logprobs": false``,
  ``"suffix": null``, ``best_of`` equal to ``n``); other values of those are 400 naming the
  field;
- unknown fields are dropped and reported to the caller (the app logs one warning per field
  name), or, with ``strict=True`` (``radixkv serve --strict-api``), rejected with 400;
- wrong JSON types and out-of-range values are a ``ProtocolError`` naming the parameter, which
  the app turns into an OpenAI-shaped 400; an integral number (``1.0``) is an integer, as JSON
  Schema has it; a body nested deeper than ``MAX_JSON_DEPTH`` is refused before it is parsed.

Range checks are msgspec ``Meta`` constraints (so the OpenAPI schema, server/openapi.py, states
them too) plus cross-field checks in ``__post_init__`` whose messages start with the field's
name, stated in JSON Schema too where it can say them (a Struct's ``json_schema_extra``); a
Struct that exists is a valid one. Responses are Structs too, encoded with
``msgspec.json``.

Extensions beyond OpenAI's schema (accepted, documented): ``cache_salt`` (narrows prefix-cache
sharing within the caller's tenant), ``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``chat_template_kwargs``, ``use_beam_search`` with ``length_penalty`` and ``early_stopping``
(vLLM's: ``n`` beams, on completions ``best_of`` beams with the ``n`` best returned; the
response comes whole, or as one chunk per choice when streamed), ``return_tokens_as_token_ids`` (vLLM's: logprob tokens as
``"token_id:N"``), ``prompt_logprobs`` (vLLM's: every prompt token's logprob and the k most
likely tokens at its position, non-streamed only), on /v1/completions ``"max_tokens": 0``
with ``echo`` (vLLM's: the prompt scored, nothing generated) and ``prompt_logprobs_start``
(SGLang's ``logprob_start_len``: prompt logprobs from that token on, the context before it
served from the prefix cache).

Structured outputs (server/structured.py): OpenAI's ``response_format`` (``text``,
``json_object``, ``json_schema``), vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``, ``guided_whitespace_pattern`` and ``structured_outputs``, and chat's ``tool_choice``
``"required"`` or naming a function (the reply constrained to the tools' schemas and returned as
tool calls, without a ``--tool-call-parser``); at most one source of constraint per request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np

from radixkv.server.structured import request_constraint

# Bounds that keep one request from monopolising the server; the engine checks the context length.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1 - MAX_N  # sample i uses seed + i
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM's default max_logprobs
MAX_REPETITION_PENALTY = 10.0  # a divisor of logits: beyond ~2 it already forbids repeats
# Deepest nesting of arrays and objects a request body may have. Real requests stay far below
# (a JSON schema 30 levels deep in response_format is about 64); what reads a body (msgspec,
# the schema compiler, templates) recurses, and a body nested thousands deep would exhaust
# the interpreter's stack: a 400 naming the limit instead.
MAX_JSON_DEPTH = 128


# ---------------------------------------------------------------- cross-field rules in JSON Schema
# A request Struct's ``json_schema_extra`` states the cross-field checks of its __post_init__
# that JSON Schema can say, next to them; server/openapi.py merges it into /openapi.json.
NULL = {"type": "null"}


def given(name: str) -> dict[str, Any]:
    """Schema: ``name`` is present and not null."""
    return {"required": [name], "properties": {name: {"not": NULL}}}


def equals(name: str, value: Any) -> dict[str, Any]:
    """Schema: ``name`` is present and equal to ``value``."""
    return {"required": [name], "properties": {name: {"const": value}}}


def when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": condition, "then": then}


def only(name: str, *options: dict[str, Any]) -> dict[str, Any]:
    """Schema: ``name``, when present, is null or matches one of ``options``."""
    return {"properties": {name: {"anyOf": [*options, NULL]}}}


class ProtocolError(ValueError):
    """A request that does not match the schema; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: OpenAI's shape. ``schema`` is required (400 naming
    ``response_format`` without it); ``strict`` changes nothing (the schema is always enforced)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    """``{"type": "text"}`` (the default: plain text), ``{"type": "json_object"}`` (any JSON
    object) or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema or its JSON text),
    ``regex``, ``choice``, ``grammar`` (Lark, or GBNF/EBNF) and ``json_object``;
    ``whitespace_pattern`` for the JSON ones."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    grammar: str | None = None


def _check_sampling(req: _SamplingFields) -> None:
    if any(s == "" for s in stop_list(req.stop)):
        raise ValueError("stop strings must be non-empty")
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream=true")
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise ValueError("length_penalty applies to beam search only (use_beam_search)")
        if req.early_stopping is not False:
            raise ValueError("early_stopping applies to beam search only (use_beam_search)")
    if req.prompt_logprobs is not None and req.stream:
        # as vLLM: they come whole with the response, which a stream does not have
        raise ValueError("prompt_logprobs is not supported with stream=true")
    for key in req.logit_bias or {}:
        # ASCII digits only (str.isdigit also takes "²", which int() refuses), and short
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            raise ValueError(f"logit_bias keys must be token ids (digits), got {key[:40]!r}")


Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]
# a token id; /openapi.json bounds it by the served model's vocabulary (server/openapi.py)
TOKEN_ID_MARK = "x-radixkv-token-id"
TokenId = Annotated[int, msgspec.Meta(ge=0, extra_json_schema={TOKEN_ID_MARK: True})]
# logit_bias's keys: token ids as strings (ASCII digits: str.isdigit also takes "²")
TokenIdKey = Annotated[str, msgspec.Meta(pattern="^[0-9]{1,18}$")]
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
CacheSalt = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

# (one if/then/else per condition: schemathesis cannot generate from many separate ones)
SAMPLING_RULES: list[dict[str, Any]] = [
    {  # stream_options and prompt_logprobs each need stream to be the other way
        "if": equals("stream", True),
        "then": only("prompt_logprobs"),
        "else": only("stream_options"),
    },
    {
        "if": equals("use_beam_search", True),
        "then": {  # what SamplingParams refuses with beam search
            "allOf": [
                only("stop", {"type": "array", "maxItems": 0}),
                only("presence_penalty", {"const": 0}),
                only("frequency_penalty", {"const": 0}),
                only("repetition_penalty", {"const": 1}),
                only("logit_bias", {"type": "object", "maxProperties": 0}),
            ]
        },
        "else": {  # beam search's own parameters
            "allOf": [
                only("length_penalty", {"const": 1.0}),
                only("early_stopping", {"const": False}),
            ]
        },
    },
]


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 or 0: off
    min_p: Probability = 0.0
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: (
        NonEmptyStr | Annotated[list[NonEmptyStr], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None
    ) = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] | None = None
    ignore_eos: bool = False
    user: str | None = None
    cache_salt: CacheSalt | None = None
    return_tokens_as_token_ids: bool = False
    # vLLM's: each prompt token's logprob and the k most likely tokens at its position
    prompt_logprobs: NumLogprobs | None = None
    # OpenAI's two penalties, and vLLM's / SGLang's repetition_penalty (engine/logit_adjust.py)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)] = 1.0
    # OpenAI's: token id (as a string) -> bias added to its logit; vLLM's min_tokens
    logit_bias: dict[TokenIdKey, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # vLLM's: scheduling priority, lower first (radixkv serve --schedule-policy priority)
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] = 0
    # Structured outputs (server/structured.py): OpenAI's, and vLLM's extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # a context-free grammar: Lark, or GBNF/EBNF
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's beam search (engine/beam_search.py): n beams (completions: best_of beams, the n
    # best returned), Hugging Face's length_penalty and early_stopping
    use_beam_search: bool = False
    length_penalty: Annotated[float, msgspec.Meta(ge=-10.0, le=10.0)] = 1.0
    early_stopping: bool | Literal["never"] = False

    def beam_width(self) -> int:
        """``SamplingParams.beam_width`` (0: sampling)."""
        return self.n if self.use_beam_search else 0


# the request fields a SamplingParams error can name (its message starts with the name)
SAMPLING_FIELDS = frozenset(_SamplingFields.__struct_fields__) | {"logprobs", "top_logprobs"}

PromptType = (
    NonEmptyStr
    | Annotated[
        list[NonEmptyStr | TokenId | Annotated[list[TokenId], msgspec.Meta(min_length=1)]],
        msgspec.Meta(min_length=1),
    ]
)


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, TOKEN_ID_MARK: True}}


class CompletionRequest(_SamplingFields, kw_only=True):
    # what __post_init__ checks across fields, said in /openapi.json too
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "allOf": [
            *SAMPLING_RULES,
            # one prompt: text, texts, token ids or lists of token ids, never a mixture
            {
                "properties": {
                    "prompt": {
                        "anyOf": [
                            {"type": "string"},
                            {"type": "array", "items": {"type": "string"}},
                            _TOKEN_IDS,
                            {"type": "array", "items": {**_TOKEN_IDS, "minItems": 1}},
                        ]
                    }
                }
            },
            only("suffix"),
            when(
                equals("max_tokens", 0),
                {"allOf": [equals("echo", True), only("min_tokens", {"const": 0})]},
            ),
            when(
                {
                    "required": ["prompt_logprobs_start"],
                    "properties": {"prompt_logprobs_start": {"type": "integer", "minimum": 1}},
                },
                {
                    "anyOf": [
                        given("prompt_logprobs"),
                        {"allOf": [equals("echo", True), given("logprobs")]},
                    ]
                },
            ),
        ]
    }

    prompt: PromptType
    # 0 only with echo: the prompt is scored (echo's logprobs), nothing generated
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    echo: bool = False  # each choice's text (and logprobs) start with its prompt's
    logprobs: NumLogprobs | None = None  # top alternatives per token; 0: the sampled one only
    suffix: str | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] | None = None
    # the first prompt token with a prompt logprob (echo's or prompt_logprobs'); the context
    # before it is served from the prefix cache (SGLang's logprob_start_len)
    prompt_logprobs_start: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = 16  # OpenAI's default for /v1/completions
        _check_sampling(self)
        if self.max_tokens == 0:
            if not self.echo:
                raise ValueError(
                    "max_tokens must be at least 1 (0 is allowed only with echo=true, "
                    "which returns the prompt and generates nothing)"
                )
            if self.min_tokens > 0:
                raise ValueError("min_tokens must be 0 when max_tokens is 0")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            if not self.use_beam_search:
                raise ValueError("best_of is supported with use_beam_search only (else = n)")
            if self.best_of < self.n:
                raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        prompts = self.prompts()  # validates the shape
        if not prompts:
            raise ValueError("prompt must not be empty")
        for p in prompts:
            if len(p) == 0:
                raise ValueError("prompt must not be empty")
        if self.prompt_logprobs_start and self.engine_prompt_logprobs() is None:
            raise ValueError(
                "prompt_logprobs_start needs prompt logprobs: echo with logprobs, or "
                "prompt_logprobs"
            )
        request_constraint(self)  # validates the structured-output fields

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            return list(p)  # type: ignore[arg-type]
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]  # type: ignore[arg-type]
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids, "
            "or a list of token id lists (not a mixture)"
        )

    def engine_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request."""
        return self.logprobs

    def beam_width(self) -> int:
        """With beam search, ``best_of`` beams (default ``n``), the ``n`` best returned."""
        if not self.use_beam_search:
            return 0
        return self.n if self.best_of is None else self.best_of

    def engine_max_tokens(self) -> int:
        """``SamplingParams.max_tokens``: the engine always generates (at least one token), so
        echo's ``max_tokens=0`` runs one whose output is not shown."""
        assert self.max_tokens is not None  # defaulted in __post_init__
        return max(1, self.max_tokens)

    def echo_logprobs(self) -> int | None:
        """Top alternatives per prompt token in the echoed logprobs (None: not shown)."""
        return self.logprobs if self.echo else None

    def engine_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: enough for both the ``prompt_logprobs``
        extension and echo's logprobs (each shows its own number of alternatives)."""
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs()) if k is not None]
        return max(wanted) if wanted else None

    def engine_prompt_logprobs_start(self) -> int:
        """``SamplingParams.prompt_logprobs_start`` (0 unless prompt logprobs are computed)."""
        if self.engine_prompt_logprobs() is None:
            return 0
        return self.prompt_logprobs_start or 0


class TextContentPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    # an agent loop's turns: the assistant's calls, and a tool's result answering one of them
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning, as a reasoning parser returned it (vLLM's field, and
    # DeepSeek's and SGLang's older name): given to the template, which may show it or not
    # (templates read it on assistant turns; on others it is passed and left unread)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if None not in (self.reasoning, self.reasoning_content) and (
            self.reasoning != self.reasoning_content
        ):
            raise ValueError("reasoning and reasoning_content disagree (send one of them)")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "allOf": [
            *SAMPLING_RULES,
            when(
                {
                    "required": ["top_logprobs"],
                    "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                },
                equals("logprobs", True),
            ),
        ]
    }

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # Rendered by the chat template (tool schemas the model is shown; the template's switches,
    # e.g. {"enable_thinking": false} for Qwen3, as vLLM and SGLang take them). Tool calls are
    # parsed out of the reply when the server has a --tool-call-parser (server/tool_calls.py)
    # and tool_choice is "auto" (the default with tools); "none" leaves the reply as text;
    # "required" or {"type": "function", "function": {"name": ...}} force a call by guided
    # decoding (server/structured.py), the reply being the calls' JSON, with or without a parser.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: with a --reasoning-parser, false leaves the reasoning out of the response (the
    # model still reasons: the tokens are generated and counted)
    include_reasoning: bool = True

    def __post_init__(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        _check_sampling(self)
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        request_constraint(self)  # validates tool_choice and the structured-output fields

    def engine_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` for this request."""
        return self.prompt_logprobs

    def engine_prompt_logprobs_start(self) -> int:
        """``SamplingParams.prompt_logprobs_start``: chat scores the whole conversation."""
        return 0

    def wants_tool_calls(self) -> bool:
        """Whether tool calls are to be parsed out of the reply by the server's
        ``--tool-call-parser`` (``tool_choice`` "auto"; forced calls are read without one)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for ``tokenizer.apply_chat_template``: an assistant's
    ``tool_calls`` as sent (the renderer decodes their JSON ``arguments``, for Python callers
    alike); a tool result keeps its ``tool_call_id`` and ``name``."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None and role == "tool":
            msg["name"] = m.name
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:  # templates read either name (Qwen3's: reasoning_content)
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: the token ids the server would run for ``prompt`` (encoded as
    /v1/completions encodes a text prompt) or for ``messages`` (rendered as
    /v1/chat/completions renders them, with ``tools`` and ``chat_template_kwargs``); exactly
    one of the two."""

    # what __post_init__ checks, said in /openapi.json too (server/openapi.py merges it)
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "oneOf": [given("prompt"), given("messages")],
        "allOf": [
            when(
                given("prompt"),
                {
                    "allOf": [
                        only("tools", {"maxItems": 0}),
                        only("chat_template_kwargs", {"maxProperties": 0}),
                    ]
                },
            )
        ],
    }

    model: str
    prompt: NonEmptyStr | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # also each token's text

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise ValueError("tools and chat_template_kwargs apply to messages, not to a prompt")

    def template_messages(self) -> list[dict[str, Any]]:
        assert self.messages is not None  # callers render only a messages request
        return template_messages(self.messages)


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int  # the server's context length: prompt + output must fit in it
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /detokenize``: the text of token ids (special tokens kept)."""

    model: str
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ScoreRequest(msgspec.Struct, kw_only=True):
    """SGLang's ``POST /v1/score``: for each item, the probability of each of
    ``label_token_ids`` as the next token after ``query + item`` (``item + query`` with
    ``item_first``); with ``apply_softmax`` renormalised over the labels. Query and items are
    both text (concatenated, then tokenized) or both token ids. ``model`` names the base
    model or a loaded LoRA adapter, as for generation."""

    model: str
    query: NonEmptyStr | Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    items: (
        NonEmptyStr
        | Annotated[
            list[NonEmptyStr | Annotated[list[TokenId], msgspec.Meta(min_length=1)]],
            msgspec.Meta(min_length=1),
        ]
    )
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "allOf": [  # items are of the query's kind
            when(
                {"properties": {"query": {"type": "string"}}},
                {
                    "properties": {
                        "items": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "string"}},
                            ]
                        }
                    }
                },
            ),
            when(
                {"properties": {"query": {"type": "array"}}},
                {"properties": {"items": {"type": "array", "items": {"type": "array"}}}},
            ),
        ]
    }

    label_token_ids: Annotated[
        list[TokenId], msgspec.Meta(min_length=1, extra_json_schema={"uniqueItems": True})
    ]
    apply_softmax: bool = False
    item_first: bool = False
    cache_salt: str | None = None  # as for generation: a tenant's own prefix-cache namespace

    def __post_init__(self) -> None:
        text = isinstance(self.query, str)
        items = [self.items] if isinstance(self.items, str) else self.items
        if not all(isinstance(it, str) == text for it in items):
            raise ValueError(
                "items must be texts when the query is text, token-id lists when it is token ids"
            )
        if len(set(self.label_token_ids)) != len(self.label_token_ids):
            raise ValueError(f"label_token_ids has repeated ids: {self.label_token_ids}")


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/load_lora_adapter``: load the PEFT adapter folder ``lora_path`` (on the
    server's machine) and serve it as the model ``lora_name``."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving the adapter ``lora_name``. (vLLM
    also takes its internal ``lora_int_id``; adapters here are known by name only.)"""

    lora_name: NonEmptyStr


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


_AT_PATH = re.compile(r"- at `\$\.?([^`]*)`")
_AT_KEY = re.compile(r"- at `key` in `\$\.?([^`]*)`")  # a dict's key: name the dict
_MISSING = re.compile(r"missing required field `([^`]*)`")
_FIRST_WORD = re.compile(r"[a-z_]+")

R = TypeVar("R", bound=msgspec.Struct)


def _unwrap(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _integral(value: Any, t: mi.Type) -> Any:
    """An integral float (``1.0``, ``2e3``) as an int where ``t`` takes an int and no float:
    JSON Schema's ``integer`` includes them, msgspec's ``int`` does not."""
    if type(value) is not float or not value.is_integer():
        return value
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    kinds = {type(_unwrap(m)) for m in members}
    return int(value) if mi.IntType in kinds and mi.FloatType not in kinds else value


def _prune(value: Any, t: mi.Type, path: str, unknown: list[str]) -> Any:
    """``value`` (decoded JSON) with unknown keys dropped (their paths appended to ``unknown``),
    nulls of optional fields dropped and integral floats of int fields made ints, at every
    depth the Struct types describe."""
    t = _unwrap(t)
    if isinstance(t, mi.UnionType):  # pick the member matching the JSON value's shape
        for member in map(_unwrap, t.types):
            if (isinstance(value, dict) and isinstance(member, mi.StructType)) or (
                isinstance(value, list) and isinstance(member, mi.ListType)
            ):
                return _prune(value, member, path, unknown)
        return _integral(value, t)
    if isinstance(t, mi.IntType):
        return _integral(value, t)
    if isinstance(t, mi.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f for f in t.fields}
        out = {}
        for key, v in value.items():
            f = fields.get(key)
            if f is None:
                unknown.append(f"{path}{key}")
            elif v is not None or f.required:
                out[key] = _prune(v, f.type, f"{path}{key}.", unknown)
        return out
    if isinstance(t, mi.ListType) and isinstance(value, list):
        item_path = path[:-1] + "[]." if path else "[]."
        return [_prune(v, t.item_type, item_path, unknown) for v in value]
    return value


_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(body: bytes) -> int:
    """How deeply the arrays and objects of a JSON text nest (exact for valid JSON), without
    parsing it, in a few C-speed passes: escaped backslashes, then escaped quotes are dropped,
    so every quote left opens or closes a string; brackets outside strings are counted."""
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    outside = np.cumsum(text == ord('"'), dtype=np.int64) % 2 == 0
    steps = _STEP[text[outside]]
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.any() else 0


def decode_request(
    body: bytes, kind: type[R], *, strict: bool = False, ignored: list[str] | None = None
) -> R:
    """Decode and validate a JSON request body; raises ProtocolError (never returns a bad Struct).

    Unknown fields (named like ``foo``, ``stream_options.foo``, ``messages[].foo``) are dropped
    and appended to ``ignored`` when given, or, with ``strict``, rejected. A body nested
    deeper than ``MAX_JSON_DEPTH`` is rejected before it is parsed."""
    # fewer brackets than the limit cannot nest deeper (the common case: no second pass)
    depth = 0 if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH else json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise ProtocolError(
            f"Invalid JSON body: nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}"
        )
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"Invalid JSON body: {e}") from None
    except RecursionError:  # json_depth reads valid JSON exactly; this is invalid JSON
        raise ProtocolError(
            f"Invalid JSON body: nested deeper than the limit of {MAX_JSON_DEPTH}"
        ) from None
    unknown: list[str] = []
    data = _prune(raw, mi.type_info(kind), "", unknown)
    if unknown and strict:
        raise ProtocolError(
            f"Unknown field `{unknown[0]}` (this server rejects unknown fields: --strict-api)",
            unknown[0],
        )
    if ignored is not None:
        ignored.extend(unknown)
    try:
        return msgspec.convert(data, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = None
        for pattern in (_AT_PATH, _AT_KEY, _MISSING):
            m = pattern.search(msg)
            if m:
                # a dict value's path ends in [...] (msgspec): name the dict
                param = m.group(1).replace("[...]", "") or None
                break
        if param is None:  # a __post_init__ check: its message starts with the field's name
            m = _FIRST_WORD.match(msg)
            if m and m.group(0) in kind.__struct_fields__:
                param = m.group(0)
        raise ProtocolError(msg, param) from None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # with a --reasoning-parser, on chat: the replies' tokens up to the end of their reasoning
    completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ScoreResponse(msgspec.Struct):
    scores: list[list[float]]  # per item, the labels' probabilities in label_token_ids order
    model: str
    usage: Usage
    object: str = "scoring"


class CompletionLogprobs(msgspec.Struct):
    """The legacy completions shape: parallel lists, one entry per token of the choice's text
    (with echo: the prompt's tokens first, the first of them null: nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's ``prompt_logprobs`` entry for one token at one prompt position."""

    logprob: float
    rank: int  # 1: the most likely token at that position
    decoded_token: str


# one entry per prompt token: null for the first (nothing precedes it), then token id (as a
# string) -> its logprob, the prompt's own token first, then the k most likely
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    # only in whole responses (null unless asked for), never in stream chunks
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType | None = msgspec.UNSET
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that matched


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None
    refusal: list[ChatTokenLogprob] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON, as OpenAI's API sends it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ToolCallDelta(msgspec.Struct):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(msgspec.Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | None = None
    # with a --reasoning-parser: the reply's reasoning (server/reasoning.py); vLLM's name
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that matched


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, for the one prompt


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: str | int | None = None  # as in ChatChoice, on the choice's last chunk


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    """One entry of ``GET /v1/models``, as vLLM writes it: the base model has ``root`` = its
    own id and no ``parent``; a LoRA adapter has ``root`` = the folder it was loaded from and
    ``parent`` = the base model's id. ``max_model_len``: the context length (base model only,
    as in vLLM)."""

    id: str
    created: int
    owned_by: str = "radixkv"
    object: str = "model"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class Status(msgspec.Struct):
    status: str


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
