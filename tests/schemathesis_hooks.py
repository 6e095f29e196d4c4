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
  ``max_tokens`` is kept small, which also keeps the run short.

Most requests also get the served model's name (a random one only ever reaches the 404).
"""

from __future__ import annotations

from typing import Any

import schemathesis

MODEL = "radixkv-tiny"
CONSTRAINTS = (
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern", "structured_outputs", "tool_choice", "tools",
)  # fmt: skip
LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def _set(body: dict[str, Any], key: str) -> bool:
    return body.get(key) is not None


@schemathesis.hook
def filter_body(ctx: Any, body: Any) -> bool:
    if not isinstance(body, dict):
        return True
    if any(_set(body, k) for k in CONSTRAINTS):
        return False
    if _set(body, "max_tokens") and _set(body, "max_completion_tokens"):
        return False
    if _set(body, "best_of"):
        return False
    for m in body.get("messages") or []:
        if isinstance(m, dict) and _set(m, "reasoning") and _set(m, "reasoning_content"):
            return False
    return not isinstance(body.get("input"), list)  # Responses input items


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = MODEL
    for k in LENGTHS:
        if isinstance(body.get(k), int) and body[k] > 4:
            body[k] = 4
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
        body["min_tokens"] = 0 if body.get("max_tokens") == 0 else 1
    for m in body.get("messages") or []:
        if isinstance(m, dict) and m.get("role") == "tool":
            m["role"] = "user"  # radixkv-tiny's chat template has no tool turns
    return body
