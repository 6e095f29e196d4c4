"""Schemathesis hooks for fuzzing a radixkv-tiny server with every check (``--checks all``):
tests/test_server_openapi.py loads them into ``schemathesis run`` (SCHEMATHESIS_HOOKS), as
``nox -s schemathesis`` does with more examples.

/openapi.json states every rule JSON Schema can say, cross-field ones included, so schema-valid
requests are accepted and schema-invalid ones refused. What it cannot say is left out of the
generated requests here, each for its reason:

- a constraint's language (``guided_regex``, ``guided_grammar``, ``guided_json``,
  ``response_format``'s schema, ``structured_outputs``) must compile, and ``tool_choice`` must
  name one of ``tools``: validity that is not a shape;
- comparisons between fields (``max_tokens`` = ``max_completion_tokens``, a message's
  ``reasoning`` = ``reasoning_content``, ``best_of`` = ``n`` or at least ``n``, ``min_tokens`` at
  most ``max_tokens``) have no JSON Schema keyword (``best_of``'s could be spelled out value by
  value, which schemathesis cannot generate from);
- Responses input items and tools are checked item by item in server/responses.py;
- a prompt must fit the context with its ``max_tokens``, which depends on how it tokenizes:
  ``max_tokens`` is kept small (at most 4), which also keeps the run short.

Most requests also get the served model's name (a random one only ever reaches the 404).
"""

from __future__ import annotations

from typing import Any

import schemathesis

MODEL = "radixkv-tiny"
CONSTRAINTS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "structured_outputs", "tool_choice", "tools", "best_of",
)  # fmt: skip
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def schema_valid_only(body: dict[str, Any]) -> None:
    """Take out of a schema-valid body what the schema cannot state (the module doc)."""
    for k in CONSTRAINTS:
        if body.get(k) is not None:
            body[k] = None
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        body["max_completion_tokens"] = None
    for m in body.get("messages") or []:
        if isinstance(m, dict) and None not in (m.get("reasoning"), m.get("reasoning_content")):
            m["reasoning_content"] = None
        if isinstance(m, dict) and m.get("role") == "tool":
            m["role"] = "user"  # radixkv-tiny's chat template has no tool turns
    if isinstance(body.get("input"), list):  # Responses input items
        body["input"] = "Hello"
    for k in LENGTHS:
        if _number(body.get(k)) and body[k] > 4:
            body[k] = 4
    if _number(body.get("min_tokens")) and body["min_tokens"] > 1:
        body["min_tokens"] = 0 if body.get("max_tokens") == 0 else 1


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: Any) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = MODEL  # most requests for the served model: past the 404
    meta = getattr(case, "_meta", None)
    if meta is not None and meta.generation.mode == schemathesis.GenerationMode.POSITIVE:
        schema_valid_only(body)
