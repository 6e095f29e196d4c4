"""Rendering of Hugging Face style Jinja chat templates (sandboxed, HF's whitespace options)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is malformed, or rejected the messages (``raise_exception`` in the template)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' arguments and defaults (non-ASCII kept, keys in their order), not Jinja's
    # built-in tojson, which HTML-escapes and sorts keys: templates such as Qwen's and Llama 3.1's
    # print tool schemas with it, and the model was trained on transformers' rendering
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=None if separators is None else tuple(separators),
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    # the same environment options and helpers Hugging Face templates are written against
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# Variables the renderer sets itself; ``chat_template_kwargs`` may not replace them.
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: keys set to None dropped, and an assistant's
    ``tool_calls`` (OpenAI's shape) with ``function.arguments`` decoded from its JSON string
    to an object, as transformers documents, so a template's ``tojson`` writes it once (not as
    a string inside a string). Arguments that are not a JSON object string stay as given."""
    out = {k: v for k, v in m.items() if v is not None}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_object_arguments(c) for c in calls]
    return out


def _object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    **extra: Any,
) -> str:
    """Render ``template`` for ``messages`` (each a dict with at least ``role``).

    The template sees ``messages``, ``add_generation_prompt``, ``tools`` and ``documents`` (None
    when not given, as in transformers), ``extra`` (the tokenizer's ``bos_token``,
    ``eos_token``) and ``chat_template_kwargs`` (template switches such as Qwen3's
    ``enable_thinking``; they may override ``extra`` but not the four above)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of dicts")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ChatTemplateError(f"message {i} has no 'role'")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise ChatTemplateError("tools must be a list of JSON objects (dicts)")
    # keys set to None are dropped, as transformers does, so `message.x is defined` agrees
    messages = [_template_message(m) for m in messages]
    kwargs = dict(chat_template_kwargs or {})
    if not all(isinstance(k, str) for k in kwargs):
        raise ChatTemplateError("chat_template_kwargs keys must be strings")
    clash = sorted(RESERVED & kwargs.keys())
    if clash:
        raise ChatTemplateError(
            f"chat_template_kwargs may not set {', '.join(clash)} (pass them as arguments)"
        )
    try:
        return _compile(template).render(
            **{**extra, **kwargs},
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
        )
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
    except (TypeError, ValueError) as exc:  # a filter given bad arguments (tojson(indent="x"))
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
