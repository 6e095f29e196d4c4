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


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


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


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **extra: Any,
) -> str:
    """Render ``template`` for ``messages`` (each a dict with at least ``role`` and ``content``)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("messages must be a list of dicts")
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ChatTemplateError(f"message {i} has no 'role'")
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        )
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from exc
