"""Structured outputs: the request fields that constrain a reply, as the engine's
``GuidedDecodingParams`` (engine/guided.py compiles them against the vocabulary).

The sources, at most one per request:

- OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (a value the schema
  accepts; ``strict`` changes nothing: the schema is always enforced); ``{"type": "text"}`` is
  the default, no constraint;
- vLLM's ``guided_json`` (a schema, or its JSON text), ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (a context-free grammar: Lark, or GBNF/EBNF with ``root ::= ...``), with
  ``guided_whitespace_pattern`` for the JSON ones (also with ``response_format`` or forced tool
  calls);
- vLLM's ``structured_outputs`` object: exactly one of ``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``, and ``whitespace_pattern``;
- chat's ``tool_choice`` forcing a call (vLLM's way): a named function constrains the reply to
  its ``parameters`` schema; ``"required"`` to a JSON array (at least one element, at most one
  with ``parallel_tool_calls: false``) of ``{"name": <a tool's name>, "parameters": <its
  schema>}`` objects. The reply is returned as tool calls (server/tool_calls.py).

Every error here is a ValueError whose message starts with the request field it is about, so
the decoder names it as the 400's ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixkv.engine.params import GuidedDecodingParams
from radixkv.server.tool_calls import ForcedToolChoice

# what a conflict error lists as the possible sources
_SOURCES = (
    "response_format (json_object, json_schema), guided_json / guided_regex / guided_choice / "
    "guided_grammar, structured_outputs, and tool_choice forcing a call"
)
_NO_OBJECT_ARGS: dict[str, Any] = {"type": "object", "properties": {}}  # vLLM's, for no parameters


@dataclass(frozen=True)
class Constraint:
    """What a request constrains its reply to.

    Attributes:
        guided: the engine's parameters.
        param: the request field it came from (named by a 400 when the engine cannot compile
            it: ``tools`` for forced calls, whose schemas come from there).
        tool_choice: the reply is forced tool calls, read this way; None: plain content.
    """

    guided: GuidedDecodingParams
    param: str
    tool_choice: ForcedToolChoice | None = None


def _tool_function(tool: object, i: int) -> dict[str, Any]:
    """``tools[i]``'s ``function`` object, checked as far as forcing needs it."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or fn is None:
        raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}].function needs a name (a non-empty string)")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
    return fn


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return dict(params) if params else dict(_NO_OBJECT_ARGS)


def forced_tool_schema(
    tools: list[dict[str, Any]] | None, tool_choice: object, parallel_tool_calls: bool | None
) -> tuple[ForcedToolChoice, dict[str, Any]] | None:
    """How the reply is read and the schema it is constrained to, when ``tool_choice`` forces
    a call; None for ``"auto"``, ``"none"`` and not given. ValueError (naming ``tool_choice`` or
    ``tools``) for a choice that cannot be forced."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    name: str | None = None
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if (
            tool_choice.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise ValueError(
                'tool_choice must be "auto", "none", "required" or '
                f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}'[:300]
            )
        name = fn["name"]
    elif tool_choice != "required":
        raise ValueError(
            f'tool_choice must be "auto", "none", "required" or a named function, '
            f"got {tool_choice!r}"[:300]
        )
    what = "required" if name is None else f"naming function {name!r}"
    if not tools:
        raise ValueError(f"tool_choice {what} needs tools to call (none given)")
    fns = [_tool_function(t, i) for i, t in enumerate(tools)]
    if name is not None:
        match = next((f for f in fns if f["name"] == name), None)
        if match is None:
            known = ", ".join(repr(f["name"]) for f in fns)
            raise ValueError(
                f"tool_choice names function {name!r}, which is not among tools ({known})"
            )
        return ForcedToolChoice(name), _parameters(match)
    # "required": an array of calls, each naming one tool and holding its arguments; the
    # tools' $defs go to the root, where their "#/$defs/..." references point
    defs: dict[str, Any] = {}
    options = []
    for i, fn in enumerate(fns):
        params = _parameters(fn)
        own = params.pop("$defs", None) or {}
        if not isinstance(own, dict):
            raise ValueError(f"tools[{i}].function.parameters: $defs must be an object")
        for key, value in own.items():
            if key in defs and defs[key] != value:
                raise ValueError(
                    f"tools[{i}].function.parameters: $defs {key!r} differs from another "
                    "tool's, and forcing a call puts them in one schema"
                )
            defs[key] = value
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [fn["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": options}, "minItems": 1}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return ForcedToolChoice(None), schema


def _structured_outputs(so: Any) -> dict[str, Any]:
    """``structured_outputs`` as GuidedDecodingParams keyword arguments."""
    given = {
        k: v
        for k, v in (
            ("json", so.json),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object or None),
            ("whitespace_pattern", so.whitespace_pattern),
        )
        if v is not None
    }
    try:  # the engine's rules: exactly one language, whitespace for JSON only
        GuidedDecodingParams(**given)
    except ValueError as e:
        raise ValueError(f"structured_outputs: {e}") from None
    return given


def request_constraint(req: Any) -> Constraint | None:
    """The constraint of a completions or chat request (None: free text). ValueError, its
    message starting with the field's name, for a bad or unsupported one, or more than one."""
    sources: list[tuple[str, dict[str, Any]]] = []  # (request field, GuidedDecodingParams kw)
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            sources.append(("response_format", {"json_object": True}))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise ValueError(
                    'response_format of type "json_schema" needs json_schema.schema: '
                    '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
                )
            sources.append(("response_format", {"json": rf.json_schema.schema}))
        else:
            raise ValueError(
                f"response_format type {rf.type!r} is not supported: "
                "text, json_object or json_schema"[:300]
            )
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field)
        if value is not None:
            sources.append((field, {key: value}))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    forced = None
    tools_choice = getattr(req, "tool_choice", None)
    if tools_choice is not None:
        found = forced_tool_schema(req.tools, tools_choice, req.parallel_tool_calls)
        if found is not None:
            forced, schema = found
            sources.append(("tool_choice", {"json": schema}))
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise ValueError(f"{names} each constrain the output: give at most one of {_SOURCES}")
    ws = req.guided_whitespace_pattern
    if not sources:
        if ws is not None:
            raise ValueError(
                "guided_whitespace_pattern applies to JSON output (guided_json, response_format "
                "json_object or json_schema, a forced tool call); none was asked for"
            )
        return None
    param, kw = sources[0]
    if ws is not None:
        if param == "structured_outputs":
            raise ValueError(
                "guided_whitespace_pattern does not apply to structured_outputs: "
                "use structured_outputs.whitespace_pattern"
            )
        if "json" not in kw and "json_object" not in kw:
            raise ValueError(f"guided_whitespace_pattern applies to JSON output, not to {param}")
        kw = {**kw, "whitespace_pattern": ws}
    try:
        guided = GuidedDecodingParams(**kw)
    except ValueError as e:
        raise ValueError(f"{param}: {e}") from None
    return Constraint(guided, "tools" if forced is not None else param, forced)
