"""OpenAI-compatible request and response shapes (msgspec Structs).

Requests are decoded strictly: unknown fields, wrong JSON types and out-of-range values are
rejected by ``decode_request`` with a ``ProtocolError`` naming the offending parameter, which the
app turns into an OpenAI-shaped 400. Range checks live in ``__post_init__`` so a Struct that
exists is a valid one. Responses are Structs too, encoded with ``msgspec.json``.

Extensions beyond OpenAI's schema (accepted, documented): ``cache_salt`` (narrows prefix-cache
sharing within the caller's tenant), ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``chat_template_kwargs``.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar

import msgspec

# Bounds that keep one request from monopolising the server; the engine checks the context length.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1 - MAX_N  # sample i uses seed + i


class ProtocolError(ValueError):
    """A request that does not match the schema; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


def _check_sampling(req: _SamplingFields) -> None:
    if req.max_tokens is not None and req.max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if not 0.0 <= req.temperature <= 2.0:
        raise ValueError("temperature must be in [0, 2]")
    if not 0.0 < req.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    if req.top_k is not None and req.top_k < -1:
        raise ValueError("top_k must be -1 (disabled) or >= 0")
    if not 1 <= req.n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}]")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, {MAX_SEED}]")
    stops = stop_list(req.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise ValueError("stop_token_ids must be non-negative")
    if req.cache_salt is not None and not 1 <= len(req.cache_salt) <= 256:
        raise ValueError("cache_salt must be 1..256 characters")
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options is only allowed with stream=true")


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    cache_salt: str | None = None
    # Accepted only at their neutral values: the engine has no penalties or logprobs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def _check_unsupported(self) -> None:
        if self.presence_penalty != 0.0:
            raise ValueError("presence_penalty is not supported (must be 0)")
        if self.frequency_penalty != 0.0:
            raise ValueError("frequency_penalty is not supported (must be 0)")


PromptType = str | list[str | int | list[int]]


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptType
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is None:
            self.max_tokens = 16  # OpenAI's default for /v1/completions
        _check_sampling(self)
        self._check_unsupported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.logprobs is not None:
            raise ValueError("logprobs is not supported")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        prompts = self.prompts()  # validates the shape
        if not prompts:
            raise ValueError("prompt must not be empty")
        for p in prompts:
            if len(p) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError("token ids must be non-negative")

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


class TextContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # Rendered by the chat template (tool schemas the model is shown; the template's switches,
    # e.g. {"enable_thinking": false} for Qwen3, as vLLM and SGLang take them). The reply is
    # plain text: tool calls are not parsed out of it.
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens disagree")
            self.max_tokens = self.max_completion_tokens
        _check_sampling(self)
        self._check_unsupported()
        if not self.messages:
            raise ValueError("messages must not be empty")

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts for ``tokenizer.apply_chat_template``."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
        return out


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


_AT_PATH = re.compile(r"- at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")

R = TypeVar("R", CompletionRequest, ChatCompletionRequest)


def decode_request(body: bytes, kind: type[R]) -> R:
    """Decode and validate a JSON request body; raises ProtocolError (never returns a bad Struct)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = None
        for pattern in (_AT_PATH, _UNKNOWN, _MISSING):
            m = pattern.search(msg)
            if m:
                param = m.group(1) or None
                break
        raise ProtocolError(msg, param) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"Invalid JSON body: {e}") from None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: str = "text_completion"


class ChatResponseMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "radixkv"
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
