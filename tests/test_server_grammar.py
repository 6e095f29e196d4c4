"""Context-free grammars over HTTP: vLLM's ``guided_grammar`` (completions and chat) and
``structured_outputs.grammar``, Lark and GBNF, whole and streamed; every reply is a sentence of its
grammar (or a prefix of one, cut by ``max_tokens``) as the recognisers of grammar_helpers.py say;
a grammar that does not compile is a 400 naming its field before any prompt is submitted; a
grammar with another constraint is a 400; the server is clean afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from grammar_helpers import ARITH, GBNF, PARENS, classify
from server_helpers import MODEL, assert_clean, checked_client, in_loop, live_server

from radixkv.server import protocol as P
from radixkv.server.background import BackgroundServer
from radixkv.server.state import ServerState
from radixkv.server.structured import request_constraint

MESSAGES = [{"role": "user", "content": "Write some brackets."}]


def test_grammar_fields_become_the_engines_constraint() -> None:
    def constraint(body: dict[str, Any], kind: Any = P.CompletionRequest) -> Any:
        base = {"model": "m", "prompt": "hi"} if kind is P.CompletionRequest else {"model": "m"}
        return request_constraint(P.decode_request(json.dumps({**base, **body}).encode(), kind))

    c = constraint({"guided_grammar": PARENS})
    assert c.guided.grammar == PARENS and c.param == "guided_grammar" and c.tool_choice is None
    c = constraint({"structured_outputs": {"grammar": GBNF}})
    assert c.guided.grammar == GBNF and c.param == "structured_outputs"
    c = constraint({"messages": MESSAGES, "guided_grammar": ARITH}, P.ChatCompletionRequest)
    assert c.guided.grammar == ARITH and c.param == "guided_grammar"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_grammar": ""}, "guided_grammar", ["non-empty"]),
        ({"guided_grammar": PARENS, "guided_regex": "a"}, "guided_regex", ["guided_grammar"]),
        (
            {"guided_grammar": PARENS, "response_format": {"type": "json_object"}},
            "response_format",
            ["guided_grammar"],
        ),
        (
            {"guided_grammar": PARENS, "structured_outputs": {"regex": "a"}},
            "guided_grammar",
            ["structured_outputs"],
        ),
        ({"structured_outputs": {"grammar": PARENS, "choice": ["a"]}}, "structured_outputs", []),
        (
            {"guided_grammar": PARENS, "guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            ["guided_grammar"],
        ),
    ],
)
def test_decoder_rejects(body: dict[str, Any], param: str, words: list[str]) -> None:
    for kind, base in (
        (P.CompletionRequest, {"prompt": "hi"}),
        (P.ChatCompletionRequest, {"messages": MESSAGES}),
    ):
        with pytest.raises(P.ProtocolError) as e:
            P.decode_request(json.dumps({"model": "m", **base, **body}).encode(), kind)
        assert e.value.param == param, e.value.message
        assert all(w in e.value.message for w in words), e.value.message


# ------------------------------------------------------------------ a radixkv-tiny server


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(max_model_len=1024) as s:
        yield s
        assert_clean(s[1])


@pytest.fixture(scope="module")
def http(tiny: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny[0].url, timeout=120) as c:
        yield c


def _post(http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _texts(r: dict[str, Any]) -> list[tuple[str, str]]:
    choices = sorted(r["choices"], key=lambda c: c["index"])
    return [
        (c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in choices
    ]


def _check(grammar: str, text: str, finish: str) -> str:
    kind = classify(grammar, text)
    if finish == "stop":
        assert kind == "complete", text
    else:
        assert finish == "length" and kind in ("complete", "prefix"), (finish, text)
    return kind


def test_completions_and_chat_replies_are_sentences(http: httpx.Client) -> None:
    finishes = []
    for grammar, field in ((PARENS, "guided_grammar"), (GBNF, "structured_outputs")):
        value: Any = grammar if field == "guided_grammar" else {"grammar": grammar}
        for path, base in (
            ("/v1/completions", {"prompt": ["Brackets:", "["]}),
            ("/v1/chat/completions", {"messages": MESSAGES}),
        ):
            body = {**base, field: value, "n": 3, "seed": 2, "max_tokens": 60}
            for text, finish in _texts(_post(http, body, path)):
                _check(grammar, text, finish)
                finishes.append(finish)
    assert len(finishes) == 2 * (2 * 3 + 3)
    assert finishes.count("stop") >= 4, finishes  # these grammars end by themselves
    # greedy, and the arithmetic one (ended by "=")
    r = _post(http, {"prompt": "1+1", "guided_grammar": ARITH, "temperature": 0, "max_tokens": 40})
    _check(ARITH, *_texts(r)[0])


def test_max_tokens_cuts_a_reply_to_a_prefix(http: httpx.Client) -> None:
    body = {"prompt": "Sum: 12+", "guided_grammar": ARITH, "n": 4, "seed": 6, "max_tokens": 4}
    r = _post(http, body)
    kinds = [_check(ARITH, text, finish) for text, finish in _texts(r)]
    assert "prefix" in kinds  # cut before its end: "length", and not a sentence yet
    for c in r["choices"]:
        if c["finish_reason"] == "length":
            assert len(c["text"]) == 4  # byte tokens
    assert r["usage"]["completion_tokens"] == sum(len(t) for t, _ in _texts(r))


def test_streamed_grammar_reply_is_the_whole_one(http: httpx.Client) -> None:
    body = {"prompt": "(", "guided_grammar": GBNF, "n": 2, "seed": 9, "max_tokens": 60}
    with http.stream("POST", "/v1/completions", json={"model": MODEL, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for line in lines[:-1]:
        for c in json.loads(line.removeprefix("data: "))["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finish[c["index"]] = c["finish_reason"]
    assert len(lines) > 4  # streamed in pieces
    whole = _texts(_post(http, body))
    for i, (text, reason) in enumerate(whole):
        assert texts[i] == text and finish[i] == reason  # the same seed: the same reply
        _check(GBNF, text, reason)


def test_openai_client_extra_body(tiny: tuple[BackgroundServer, ServerState]) -> None:
    with checked_client(tiny) as client:
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=60,
            seed=1,
            extra_body={"guided_grammar": PARENS},
        )
        c = r.choices[0]
        _check(PARENS, c.message.content or "", c.finish_reason)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_grammar": "start: expr\n"}, "guided_grammar", ["grammar", "expr"]),
        ({"guided_grammar": 'start: "a" (\n'}, "guided_grammar", ["grammar"]),
        ({"guided_grammar": 'root ::= "a" (\n'}, "guided_grammar", ["GBNF"]),
        ({"guided_grammar": 'answer ::= "a"\n'}, "guided_grammar", ["root"]),
        ({"structured_outputs": {"grammar": 'item: "a"\n'}}, "structured_outputs", ["start"]),
    ],
)
def test_bad_grammar_is_400_before_anything_runs(
    tiny: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    body: dict[str, Any],
    param: str,
    words: list[str],
) -> None:
    st = tiny[1]
    queued = in_loop(st, st.engine.stats).num_requests
    for path, base in (
        ("/v1/completions", {"prompt": ["x", "y"]}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ):
        for stream in (False, True):
            r = http.post(
                path, json={"model": MODEL, **base, **body, "stream": stream, "max_tokens": 5}
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            assert err["message"].startswith(param), err
            assert all(w in err["message"] for w in words), err
    # compiled before submission: no prompt of them reached the engine
    assert in_loop(st, st.engine.stats).num_requests == queued


def test_two_constraints_are_400_and_beams_follow_a_grammar(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "guided_grammar": PARENS, "guided_choice": ["a"]},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "guided_choice" and "guided_grammar" in err["message"]
    # beam search takes a grammar: every beam walks it, each choice a different sentence
    body = {"model": MODEL, "prompt": "x", "guided_grammar": PARENS, "use_beam_search": True}
    r = http.post("/v1/completions", json={**body, "n": 2, "max_tokens": 40})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(set(texts)) == 2
    for c in r.json()["choices"]:
        want = "complete" if c["finish_reason"] == "stop" else "prefix"
        assert classify(PARENS, c["text"]) == want, c


def test_server_is_clean_after_grammar_requests(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    for _ in range(2):
        bad = {"model": MODEL, "prompt": ["a", "b"], "guided_grammar": "start: x\n"}
        assert http.post("/v1/completions", json=bad).status_code == 400
        r = _post(http, {"prompt": ["a", "b"], "guided_grammar": PARENS, "max_tokens": 8})
        for text, finish in _texts(r):
            _check(PARENS, text, finish)
    assert_clean(tiny[1])
