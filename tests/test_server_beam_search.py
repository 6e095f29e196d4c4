"""Beam search over HTTP (vLLM's ``use_beam_search``): the server returns the engine's best
hypotheses, whole or as one chunk per choice when streamed, on completions (``n`` of
``best_of`` beams) and chat, with their logprobs when asked; combinations the engine refuses
are a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from server_helpers import MODEL, checked_client, live_server

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.server.background import BackgroundServer
from radixkv.server.state import ServerState

PROMPT = "def read_lines(path):\n"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server() as s:
        yield s


@pytest.fixture
def client(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    with checked_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def beams() -> list[tuple[str, int]]:
    """The engine's 2 best of 4 beams for PROMPT, 10 tokens: (text, token count)."""
    with Engine(MODEL) as engine:
        out = engine.generate(
            [PROMPT], SamplingParams(beam_width=4, n=2, max_tokens=10), use_tqdm=False
        )
    return [(o.text, len(o.token_ids)) for o in out[0].outputs]


@pytest.fixture(scope="module")
def beam_logprobs() -> list[list[tuple[str, float, dict[str, float]]]]:
    """The same search with logprobs=2: per choice, per token (text, logprob, top 2)."""
    with Engine(MODEL) as engine:
        out = engine.generate(
            [PROMPT], SamplingParams(beam_width=4, n=2, max_tokens=10, logprobs=2), use_tqdm=False
        )
    choices = []
    for o in out[0].outputs:
        assert o.logprobs is not None
        rows = []
        for tok, entry in zip(o.token_ids, o.logprobs):
            top = {e.decoded_token: e.logprob for t, e in entry.items() if e.rank <= 2}
            rows.append((entry[tok].decoded_token, entry[tok].logprob, top))
        choices.append(rows)
    return choices


@pytest.fixture(scope="module")
def expected(beams: list[tuple[str, int]]) -> list[str]:
    return [text for text, _ in beams]


def test_completions_return_the_best_of_the_beams(
    client: openai.OpenAI, beams: list[tuple[str, int]], expected: list[str]
) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        n=2,
        best_of=4,
        temperature=0.7,  # not used by beam search
        extra_body={"use_beam_search": True},
    )
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    assert len(set(expected)) == 2
    assert {c.finish_reason for c in r.choices} <= {"length", "stop"}
    assert r.usage.completion_tokens == sum(n for _, n in beams)


def test_a_streamed_beam_search_sends_each_choice_whole(
    client: openai.OpenAI, expected: list[str]
) -> None:
    texts = {0: "", 1: ""}
    chunks = 0
    for chunk in client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        n=2,
        best_of=4,
        stream=True,
        extra_body={"use_beam_search": True},
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            chunks += bool(c.text)
    assert [texts[0], texts[1]] == expected
    assert chunks == 2


def test_chat_takes_n_beams(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=8,
        n=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"},
    )
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) == 3


def test_chat_beams_follow_a_json_schema(client: openai.OpenAI) -> None:
    """``response_format`` applies to every beam: each choice is a different object valid
    under the schema."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me JSON:"}],
        max_tokens=40,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        extra_body={"use_beam_search": True},
    )
    texts = [c.message.content or "" for c in r.choices]
    assert len(set(texts)) == 3
    for c, text in zip(r.choices, texts):
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool), text
        assert c.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_beams_carry_their_logprobs(
    client: openai.OpenAI,
    beam_logprobs: list[list[tuple[str, float, dict[str, float]]]],
    stream: bool,
) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, n=2, best_of=4, logprobs=2)
    got: dict[int, tuple[list[str], list[float], list[dict[str, float]]]] = {}
    if stream:
        for chunk in client.completions.create(
            **kwargs, stream=True, extra_body={"use_beam_search": True}
        ):
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.tokens:
                    assert c.index not in got  # each choice comes whole, once
                    lp = c.logprobs
                    got[c.index] = (lp.tokens, lp.token_logprobs, lp.top_logprobs)
    else:
        r = client.completions.create(**kwargs, extra_body={"use_beam_search": True})
        for c in r.choices:
            lp = c.logprobs
            got[c.index] = (lp.tokens, lp.token_logprobs, lp.top_logprobs)
    assert sorted(got) == [0, 1]
    for i, rows in enumerate(beam_logprobs):
        tokens, values, tops = got[i]
        assert tokens == [t for t, _, _ in rows]
        assert values == pytest.approx([v for _, v, _ in rows], abs=1e-5)
        for top, (_, _, want) in zip(tops, rows):
            assert top.keys() >= want.keys()
            assert [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-5)


def test_chat_beams_carry_their_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=6,
        n=2,
        logprobs=True,
        top_logprobs=3,
        extra_body={"use_beam_search": True},
    )
    for c in r.choices:
        content = c.logprobs.content
        assert "".join(t.token for t in content) == c.message.content
        for t in content:
            assert len(t.top_logprobs) == 3
            assert t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob - 1e-6


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True, "stop": ["x"]}, "use_beam_search"),
        ({"use_beam_search": True, "presence_penalty": 1.0}, "use_beam_search"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"use_beam_search": True, "n": 2, "best_of": 1}, "best_of"),
    ],
)
def test_refused_combinations_name_the_field(
    client: openai.OpenAI, extra: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=extra)
    assert e.value.body["param"] == param  # type: ignore[index]
