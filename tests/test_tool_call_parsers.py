"""The mistral, pythonic and qwen3_coder tool call formats (server/tool_calls.py): whole replies
(calls, content around them, unicode, malformed calls left as content), streams fed in every
split and in random chunks giving what the whole reply gives, and each parser end to end
through a live server whose model is scripted to write a reply (mistral's with
``[TOOL_CALLS]`` a special token, which must survive decoding)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from server_helpers import MODEL, checked_client

import radixkv.engine.engine as engine_mod
from radixkv.engine.async_engine import AsyncEngine
from radixkv.model.loader import load_model
from radixkv.model.tiny import SPECIAL_TOKENS, TINY_CHAT_TEMPLATE
from radixkv.model.tokenizer import ByteTokenizer
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState
from radixkv.server.tool_calls import (
    TOOL_CALL_PARSERS,
    NativeParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
    parse_tool_calls,
)

ARGS = {"city": "Paris", "unit": "C"}
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _named(calls: list[ToolCall]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_smollm2_call_arrays() -> None:
    """SmolLM2 writes its calls as a JSON array in one block (what SmolLM2-135M-Instruct
    wrote, greedy, after one example turn); an empty array, or one holding anything but
    calls, leaves the reply content."""
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert (content, _named(calls)) == (None, [("get_weather", {"city": "Tokyo"})])
    two = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]'
    assert _named(parse_tool_calls("Sure. " + two + "</tool_call>", "hermes")[1]) == [
        ("a", {}),
        ("b", {"x": 1}),
    ]
    for text in ("<tool_call>[]</tool_call>", '<tool_call>[{"name": "a"}, 3]</tool_call>',
                 "<tool_call>[not json]</tool_call>"):  # fmt: skip
        assert parse_tool_calls(text, "hermes") == (text, [])


def test_every_parser_is_offered() -> None:
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder")
    for name in TOOL_CALL_PARSERS:
        assert ServerConfig(tool_call_parser=name).tool_call_parser == name


# ------------------------------------------------------------------ mistral
PRE_V11 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (PRE_V11, None, [("get_weather", ARGS)]),
        # arguments before the name, a name inside the arguments, no space after the marker
        (
            '[TOOL_CALLS][{"arguments": {"name": "Jo"}, "name": "age"}]',
            None,
            [("age", {"name": "Jo"})],
        ),
        (
            'Let me check. [TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, '
            '{"name": "now", "arguments": {}}]',
            "Let me check.",
            [("add", {"a": 3.5, "b": 4}), ("now", {})],
        ),
        # one object without the array; arguments already a JSON string
        ('[TOOL_CALLS]{"name": "f", "arguments": "{\\"a\\": 1}"}', None, [("f", {"a": 1})]),
        # v11+: NAME[ARGS]{...}, once per call; [ARGS] may be missing; v13's [CALL_ID]
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}',
            None,
            [("get_weather", ARGS)],
        ),
        (
            'Sure.\n[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]sub{"b": 2}',
            "Sure.",
            [("add", {"a": 1}), ("sub", {"b": 2})],
        ),
        (
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"tz": "Europe/Paris"}',
            None,
            [("get_time", {"tz": "Europe/Paris"})],
        ),
        # text after a call's JSON is content; unicode is kept as written
        (
            '[TOOL_CALLS]translate[ARGS]{"text": "héllo wörld ☃", "to": "日本語"}\nVoilà.',
            "Voilà.",
            [("translate", {"text": "héllo wörld ☃", "to": "日本語"})],
        ),
    ],
)
def test_mistral_calls(text: str, content: str | None, calls: list[Any]) -> None:
    got_content, got = parse_tool_calls(text, "mistral")
    assert got_content == content and _named(got) == calls
    assert all(MISTRAL_ID.fullmatch(c.id) for c in got)  # what Mistral's templates accept
    assert len({c.id for c in got}) == len(got)
    assert all("\\u" not in c.arguments for c in got)  # ensure_ascii=False


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("Paris is sunny.", "Paris is sunny."),
        ("[not a marker] {}", "[not a marker] {}"),
        ("[TOOL_CALLS] not json at all", " not json at all"),
        ('[TOOL_CALLS][{"arguments": {}}]', '[{"arguments": {}}]'),  # no name
        ('[TOOL_CALLS][{"name": "f", "arguments": [1]}]', '[{"name": "f", "arguments": [1]}]'),
        ("[TOOL_CALLS][]", "[]"),
        ('[TOOL_CALLS]f[ARGS]{"a": ', 'f{"a": '),  # cut off
        ('[TOOL_CALLS]f[ARGS]["a"]', 'f["a"]'),  # arguments not an object
        ('[TOOL_CALLS]f[ARGS]{"a": NaN}', 'f{"a": NaN}'),  # not JSON
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]oops', 'f{"a": 1}oops'),  # one bad: all text
        ('use [ARGS] here[TOOL_CALLS]f{"a": 1}', 'use  heref{"a": 1}'),  # a marker before
    ],
)
def test_mistral_malformed_calls_are_content(text: str, content: str) -> None:
    # the reply's text without the markers: what the client reads from a request this parser
    # does not read (decoded skipping special tokens)
    assert parse_tool_calls(text, "mistral") == (content, [])


# ------------------------------------------------------------------ pythonic
@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('[get_weather(city="Paris", unit="C")]', [("get_weather", ARGS)]),
        (
            '[get_weather(city="Paris", unit="C"), get_time()]',
            [("get_weather", ARGS), ("get_time", {})],
        ),
        (
            '<|python_start|>[get_weather(city="Paris", unit="C")]<|python_end|>',
            [("get_weather", ARGS)],
        ),
        ('  \n[get_time(tz="UTC")]\n', [("get_time", {"tz": "UTC"})]),
        (
            "[f(i=-3, x=2.5e3, t=True, n=None, s='it\\'s', l=[1, (2, 3)], "
            "d={'k': {'deep': [False, 'é']}})]",
            [
                (
                    "f",
                    {
                        "i": -3,
                        "x": 2500.0,
                        "t": True,
                        "n": None,
                        "s": "it's",
                        "l": [1, [2, 3]],
                        "d": {"k": {"deep": [False, "é"]}},
                    },
                )
            ],
        ),
        ('[search(query="東京 天気 ☔")]', [("search", {"query": "東京 天気 ☔"})]),
    ],
)
def test_pythonic_calls(text: str, calls: list[Any]) -> None:
    content, got = parse_tool_calls(text, "pythonic")
    assert content is None and _named(got) == calls
    assert all(c.id.startswith("call_") for c in got)
    assert all("\\u" not in c.arguments for c in got)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is sunny.",
        "[1, 2, 3]",  # a list, not of calls
        "[]",
        '[get_weather("Paris")]',  # positional argument
        "[get_weather(city=paris)]",  # a name as a value
        "[get_weather(city=lookup())]",  # a call as a value
        "[f(a=1 + 2)]",  # an expression
        "[f(a=1j)]",  # complex: not JSON
        "[f(a={1, 2})]",  # a set
        "[f(a=b'x')]",  # bytes
        "[f(a=1e999)]",  # infinity: not JSON
        "[f(**kw)]",
        "[f(a=1, a=2)]",  # a keyword twice
        "[{1: 2}]",
        "[os.system(cmd='rm -rf /')]",  # an attribute, not a function name
        "[f(a=1)] and more",  # not the whole reply
        "Calling [f(a=1)]",
        "[f(a=1)",  # cut off
        "[__import__('os').system('x')]",
        '[f(s=f"{x}")]',  # an f-string
        "(f(a=1),)",
        "<|python_start|>not code<|python_end|>",
    ],
)
def test_pythonic_what_is_not_calls_stays_content(text: str) -> None:
    assert parse_tool_calls(text, "pythonic") == (text, [])


# ------------------------------------------------------------------ qwen3_coder
def _qwen(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = _qwen("get_weather", city="Paris", unit="C")
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "days": {"type": "integer"},
                    "budget": {"type": "number"},
                    "flexible": {"type": "boolean"},
                    "stops": {"type": "array", "items": {"type": "string"}},
                    "prefs": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "level": {"enum": ["1", "2"]},
                    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                },
            },
        },
    }
]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (WEATHER, None, [("get_weather", ARGS)]),
        (
            f"I'll check both.\n{WEATHER}\n{_qwen('get_time')}\nOne moment.",
            "I'll check both.\n\n\nOne moment.",
            [("get_weather", ARGS), ("get_time", {})],
        ),
        # without a schema a VALUE is JSON where it parses, else a string; one newline either
        # side is the format's
        (
            _qwen(
                "f",
                n="42",
                x="-1.5",
                b="true",
                z="null",
                l='[1, "a"]',
                o='{"k": "v"}',
                q='"quoted"',
                s="hello world",
                m="line 1\nline 2\n",
                c="def f():\n    return {'a': 1}",
            ),
            None,
            [
                (
                    "f",
                    {
                        "n": 42,
                        "x": -1.5,
                        "b": True,
                        "z": None,
                        "l": [1, "a"],
                        "o": {"k": "v"},
                        "q": "quoted",
                        "s": "hello world",
                        "m": "line 1\nline 2\n",
                        "c": "def f():\n    return {'a': 1}",
                    },
                )
            ],
        ),
        # a bare <function=...> block; the last </tool_call> missing at the end; no
        # </parameter> before the next parameter or the function's end
        ("<function=now>\n</function>", None, [("now", {})]),
        ("<tool_call>\n<function=now>\n</function>\n", None, [("now", {})]),
        (
            "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\n2\n</function>",
            None,
            [("f", {"a": "x", "b": 2})],
        ),
        (
            _qwen("say", text="こんにちは ☃ “quotes”"),
            None,
            [("say", {"text": "こんにちは ☃ “quotes”"})],
        ),
    ],
)
def test_qwen3_coder_calls(text: str, content: str | None, calls: list[Any]) -> None:
    got_content, got = parse_tool_calls(text, "qwen3_coder")
    assert got_content == content and _named(got) == calls
    assert all("\\u" not in c.arguments for c in got)


def test_qwen3_coder_values_follow_the_tool_schemas() -> None:
    text = _qwen(
        "plan",
        title="42",  # a string stays one though it looks like a number
        days="3",
        budget="99.5",
        flexible="True",
        stops="['Lyon', 'Nice']",  # a Python literal is read too
        prefs='{"window": true}',
        note="null",
        level="1",
        maybe="7",
        extra="[1]",  # no schema: JSON
    )
    parser = NativeParser("qwen3_coder", TOOLS)
    _, calls = parse_tool_calls(text, parser)
    assert _named(calls) == [
        (
            "plan",
            {
                "title": "42",
                "days": 3,
                "budget": 99.5,
                "flexible": True,
                "stops": ["Lyon", "Nice"],
                "prefs": {"window": True},
                "note": None,
                "level": "1",
                "maybe": 7,
                "extra": [1],
            },
        )
    ]
    # without the tools the same reply reads as JSON-or-string
    _, plain = parse_tool_calls(text, "qwen3_coder")
    assert json.loads(plain[0].arguments)["title"] == 42
    # a VALUE that is not of its type stays the text the model wrote
    bad = _qwen("plan", days="three", budget="lots", flexible="maybe", prefs="[1]")
    _, calls = parse_tool_calls(bad, parser)
    assert json.loads(calls[0].arguments) == {
        "days": "three",
        "budget": "lots",
        "flexible": "maybe",
        "prefs": "[1]",
    }
    # other tools' schemas, or junk in tools, change nothing for an unknown function
    junk = NativeParser("qwen3_coder", [{"type": "function"}, "x", *TOOLS])  # type: ignore[list-item]
    _, calls = parse_tool_calls(_qwen("other", days="3"), junk)
    assert json.loads(calls[0].arguments) == {"days": 3}


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>\n{"name": "f"}\n</tool_call>',  # hermes JSON, not this format
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # no </function>
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # no name
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        f"{WEATHER}\n<tool_call>\n<function=g>",  # one bad block: all text
        "<tool_call>\n<function=f>\n</function>\ntext\n<function=g>",
        "<tool_call>\n<function=f>\n</function>\nnot closed, then text",
        "<function=f>\n<parameter=a>\nno end",
    ],
)
def test_qwen3_coder_what_is_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, "qwen3_coder") == (text, [])


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tool call parser"):
        parse_tool_calls("x", NativeParser("gorilla"))
    with pytest.raises(ValueError, match="unknown tool call parser"):
        ToolCallStream("gorilla")


# ------------------------------------------------------------------ streaming
# per parser, replies with calls, content around them, malformed calls and plain text
REPLIES: dict[str, list[str]] = {
    "mistral": [
        PRE_V11,
        'Let me look.\n[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
        "[TOOL_CALLS]now[ARGS]{} and then ☃",
        "[TOOL_CALLS] not json",
        "Arrays like [1, 2] and [TOOL or [T] pass as text",
        "Plain words, ünïcödé.",
    ],
    "pythonic": [
        '[get_weather(city="Paris", unit="C"), get_time()]',
        '<|python_start|>[say(text="日本")]<|python_end|>',
        "  [f(x)]",
        "<|python_s but not a call",
        "Sunny [f(a=1)]",
    ],
    "qwen3_coder": [
        f"Checking.\n{WEATHER}\n{_qwen('plan', days='3')}\nDone ☃",
        "<function=now>\n</function>",
        "a <b> and <tool and <func but <tool_call> not a call",
        "Use the <function= tag like so.",
        "Nothing special.",
    ],
    "hermes": [
        'Let me look.<tool_call>\n{"name": "f", "arguments": {"a": "é"}}\n</tool_call> ok',
        "a <b> and <tool but not a call",
        '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>',
    ],
    "llama3_json": ['{"name": "f", "parameters": {}}', "{ not a call", "Sunny."],
}
CASES = [(p, t) for p, texts in REPLIES.items() for t in texts]
_MARKERS = ("[TOOL_CALLS]", "[ARGS]", "<tool_call>", "<function=", "<|python_start|>")


def _stream(parser: ToolParser, chunks: list[str]) -> tuple[list[str], str, list[ToolCall]]:
    s = ToolCallStream(parser)
    sent = [s.feed(c) for c in chunks]
    rest, calls = s.finish()
    return sent, rest, calls


def _check_stream(parser: ToolParser, text: str, cuts: list[int]) -> None:
    """The reply fed in the chunks ``cuts`` make gives the whole parse's content and calls."""
    bounds = [0, *sorted(set(cuts)), len(text)]
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    sent, rest, calls = _stream(parser, chunks)
    content, whole = parse_tool_calls(text, parser)
    streamed = "".join(sent) + rest
    assert _named(calls) == _named(whole), (chunks, calls)
    if whole:  # as it went out: whitespace before a call was sent before it was seen
        assert streamed.strip() == (content or "")
        # nothing of a call went out before it was known not to be one
        assert not any(m in "".join(sent) for m in _MARKERS)
    else:
        assert streamed == content
    # text goes out in order: what was sent is the start of what the client ends up with
    assert streamed.startswith("".join(sent))


@pytest.mark.parametrize(("parser", "text"), CASES)
def test_streams_split_anywhere_give_the_whole_parse(parser: str, text: str) -> None:
    for cut in range(len(text) + 1):  # every split in two
        _check_stream(parser, text, [cut])
    for step in (1, 2, 3, 5, 7):  # and even chunks
        _check_stream(parser, text, list(range(step, len(text), step)))


@given(data=st.data(), case=st.sampled_from(CASES))
def test_streams_in_random_chunks_give_the_whole_parse(data: st.DataObject, case: Any) -> None:
    parser, text = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    _check_stream(parser, text, cuts)


def test_streams_hold_back_a_possible_call_and_no_more() -> None:
    s = ToolCallStream("mistral")
    assert s.feed("Hello [") == "Hello "  # "[" may begin [TOOL_CALLS]
    assert s.feed("1] [TOOL_") == "[1] "
    assert s.feed("CALLS]f[ARGS]{}") == ""
    rest, calls = s.finish()
    assert rest == "" and _named(calls) == [("f", {})]
    s = ToolCallStream("qwen3_coder")
    assert s.feed("Text <func") == "Text "
    assert s.feed("tion=f>\n</function>") == ""
    assert s.finish()[1][0].name == "f"
    s = ToolCallStream("pythonic")
    assert s.feed("  ") == "" and s.feed("[f(a=1)") == ""  # opens like a call: held whole
    assert s.finish() == ("  [f(a=1)", [])
    s = ToolCallStream("pythonic")
    assert s.feed("<|py") == ""
    assert s.feed("thon and more") == "<|python and more"


# ------------------------------------------------------------------ end to end
# radixkv-tiny's reserved special tokens renamed as Mistral's: [TOOL_CALLS] is one token,
# dropped by a decode that skips special tokens
MISTRAL_SPECIALS = tuple(
    {"<|reserved_0|>": "[TOOL_CALLS]", "<|reserved_1|>": "[ARGS]"}.get(t, t) for t in SPECIAL_TOKENS
)
WEATHER_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string"},
                    "days": {"type": "integer"},
                },
            },
        },
    }
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    """A radixkv-tiny server whose tokenizer has Mistral's markers as special tokens (the
    vocabulary's size unchanged); each test picks its parser."""
    loaded = load_model(MODEL)
    tok = ByteTokenizer(
        MISTRAL_SPECIALS,
        eos_tokens=("<|eos|>", "<|end|>"),
        bos_token="<|bos|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )
    assert tok.vocab_size == loaded.tokenizer.vocab_size
    engine = AsyncEngine(dataclasses.replace(loaded, tokenizer=tok), num_pages=2048)
    app = build_app(engine, ServerConfig(), owns_engine=True)
    with BackgroundServer(app) as srv:
        yield srv, app.state.radixkv


def _script(st_: ServerState, monkeypatch: pytest.MonkeyPatch, reply: str) -> list[int]:
    """The model scripted to write ``reply`` then EOS, for every request from now on (one at
    a time: each ends with the script's EOS, and the next starts it again); returns the
    reply's ids."""
    core = st_.engine.engine
    ids = core.tokenizer.encode(reply, add_special_tokens=False)
    script = [*ids, min(core.eos_token_ids)]
    pos = [0]

    def sample(logits: torch.Tensor, params: Any, generators: Any) -> list[int]:
        tok = script[pos[0] % len(script)]
        pos[0] += 1
        return [tok] * logits.shape[0]

    monkeypatch.setattr(engine_mod, "sample", sample)
    return ids


def _ask(client: Any, stream: bool, **kw: Any) -> tuple[str | None, list[Any], str | None]:
    """(content, tool calls as (id, name, arguments), finish_reason) of one chat request."""
    args = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], **kw}
    if not stream:
        choice = client.chat.completions.create(max_tokens=200, **args).choices[0]
        calls = [
            (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
        ]
        return choice.message.content, calls, choice.finish_reason
    chunks = [
        c for c in client.chat.completions.create(max_tokens=200, stream=True, **args) if c.choices
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    calls = [(tc.id, tc.function.name, tc.function.arguments) for tc in deltas]
    return text, calls, chunks[-1].choices[0].finish_reason


def _use(st_: ServerState, monkeypatch: pytest.MonkeyPatch, parser: str) -> None:
    monkeypatch.setattr(st_, "config", dataclasses.replace(st_.config, tool_call_parser=parser))


def test_mistral_end_to_end_keeps_the_marker_through_decoding(
    server: tuple[BackgroundServer, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    st_ = server[1]
    _use(st_, monkeypatch, "mistral")
    reply = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
    ids = _script(st_, monkeypatch, reply)
    tok = st_.engine.engine.tokenizer
    # the markers are one special token each, gone from a decode that skips special tokens
    assert ids.count(tok.encode("[TOOL_CALLS]", add_special_tokens=False)[0]) == 1
    skipped = tok.decode(ids, skip_special_tokens=True)
    assert skipped == 'Sure.get_weather{"city": "Paris", "unit": "C"}'
    with checked_client(server) as client:
        for stream in (False, True):
            content, calls, finish = _ask(client, stream, tools=WEATHER_TOOLS)
            assert content == "Sure." and finish == "tool_calls", stream
            ((call_id, name, arguments),) = calls
            assert name == "get_weather" and json.loads(arguments) == ARGS
            assert MISTRAL_ID.fullmatch(call_id)
        # a request the parser does not read decodes as ever: special tokens skipped
        content, calls, finish = _ask(client, False, tools=WEATHER_TOOLS, tool_choice="none")
        assert (content, calls, finish) == (skipped, [], "stop")
        content, calls, finish = _ask(client, True)  # no tools
        assert (content, calls, finish) == (skipped, [], "stop")
        # a reply that is no call reads as the client would have read it: markers left out
        _script(st_, monkeypatch, "Hmm [TOOL_CALLS] nothing [ARGS]")
        for stream in (False, True):
            assert _ask(client, stream, tools=WEATHER_TOOLS) == ("Hmm  nothing ", [], "stop")


def test_pythonic_end_to_end(
    server: tuple[BackgroundServer, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    st_ = server[1]
    _use(st_, monkeypatch, "pythonic")
    _script(st_, monkeypatch, '[get_weather(city="Paris", unit="C"), get_time(tz="UTC")]')
    with checked_client(server) as client:
        for stream in (False, True):
            content, calls, finish = _ask(client, stream, tools=WEATHER_TOOLS)
            assert not content and finish == "tool_calls"
            assert [(n, json.loads(a)) for _, n, a in calls] == [
                ("get_weather", ARGS),
                ("get_time", {"tz": "UTC"}),
            ]
            assert len({i for i, _, _ in calls}) == 2
        # not calls: the reply is content, streamed or not
        _script(st_, monkeypatch, "[get_weather(city=here)]")
        for stream in (False, True):
            assert _ask(client, stream, tools=WEATHER_TOOLS) == (
                "[get_weather(city=here)]",
                [],
                "stop",
            )


def test_qwen3_coder_end_to_end_types_values_by_the_request_tools(
    server: tuple[BackgroundServer, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    st_ = server[1]
    _use(st_, monkeypatch, "qwen3_coder")
    # "75001" is a string by the schema, "3" an integer; without the tools both are numbers
    _script(st_, monkeypatch, f"Checking.\n{_qwen('get_weather', city='75001', days='3')}")
    with checked_client(server) as client:
        for stream in (False, True):
            content, calls, finish = _ask(client, stream, tools=WEATHER_TOOLS)
            assert content is not None and content.strip() == "Checking."
            assert finish == "tool_calls"
            assert [(n, json.loads(a)) for _, n, a in calls] == [
                ("get_weather", {"city": "75001", "days": 3})
            ]
            assert "<tool_call>" not in content
