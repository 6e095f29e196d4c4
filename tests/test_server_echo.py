"""``echo`` on /v1/completions (with logprobs, streamed, ``max_tokens=0``), lm-eval-harness's
loglikelihood request, and vLLM's ``prompt_logprobs`` on both generation routes.

Three layers: the rendering of scripted engine outputs (what a stream sends while the engine's
prompt logprobs are not computed yet); a radixkv-tiny server (text: string and token prompts,
n > 1, several prompts, streams, errors); and a small random Llama served next to its
transformers twin, whose ``log_softmax`` of the logits is the reference for every prompt
logprob the server returns.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import torch
from _model_hf_builders import hf_logits
from engine_helpers import make_small_llama
from server_helpers import MODEL, assert_clean, live_server

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.server import protocol as P
from radixkv.server import render as R
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.state import ServerState
from radixkv.server.submission import Echo, Submission

ATOL = 1e-4
SMALL = "small-llama"


# ------------------------------------------------------------------ helpers


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed completion (``[DONE]`` checked, not returned)."""
    chunks: list[dict[str, Any]] = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def _joined(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per choice index: the stream's text, logprob lists and finish, put together."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        assert "prompt_logprobs" not in json.dumps(chunk)  # whole responses only
        for c in chunk["choices"]:
            acc = out.setdefault(
                c["index"],
                {"text": "", "finish_reason": None, "first": c, "logprobs": None},
            )
            acc["text"] += c["text"]
            if c["finish_reason"] is not None:
                assert acc["finish_reason"] is None  # finishes once
                acc["finish_reason"] = c["finish_reason"]
            if c["logprobs"] is not None:
                lp = acc["logprobs"] or {k: [] for k in c["logprobs"]}
                for k, v in c["logprobs"].items():
                    lp[k] += v
                acc["logprobs"] = lp
    return out


def _post(http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


# ------------------------------------------------------------------ rendering (scripted engine)


def _entry(tok: int, lp: float, rank: int, *alts: tuple[int, float]) -> dict[int, Logprob]:
    entry = {tok: Logprob(lp, rank, f"<{tok}>")}
    for r, (t, v) in enumerate(alts, start=1):
        entry.setdefault(t, Logprob(v, r, f"<{t}>"))
    return entry


PROMPT_IDS = [7, 8, 9]
# the engine's prompt logprobs: none for the first token; token 9 is not the most likely
PROMPT_LPS: list[dict[int, Logprob] | None] = [
    None,
    _entry(8, -0.5, 1, (8, -0.5), (3, -1.5)),
    _entry(9, -2.0, 3, (4, -0.25), (5, -1.0)),
]


def _output(
    text: str,
    tokens: list[int],
    *,
    prompt_lps: bool,
    finish: str | None = None,
) -> RequestOutput:
    lps = [_entry(t, -0.125 * (i + 1), 1) for i, t in enumerate(tokens)]
    c = CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=finish, logprobs=lps)
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=PROMPT_IDS,
        text=text,
        token_ids=tokens,
        finish_reason=finish,
        num_cached_tokens=0,
        metrics=RequestMetrics(arrival_time=0.0),
        outputs=[c],
        finished=finish is not None,
        prompt_logprobs=PROMPT_LPS if prompt_lps else None,
    )


class ScriptedEngine:
    """Stands in for an AsyncEngine: every request gets the same scripted outputs, the first
    of them (a prefill chunk) without prompt logprobs, as the engine may stream them."""

    def __init__(self, *, finish: str = "length") -> None:
        self.script = [
            _output("", [], prompt_lps=False),
            _output("x", [20], prompt_lps=True),
            _output("xy", [20, 21], prompt_lps=True, finish=finish),
        ]

    async def generate(
        self, prompt: list[int], params: SamplingParams, **kw: Any
    ) -> AsyncIterator[RequestOutput]:
        for out in self.script:
            await asyncio.sleep(0)
            yield out


def _run_scripted(
    fmt: R.LogprobFormat | None, *, echo_only: bool = False, finish: str = "length"
) -> tuple[list[list[R.Delta]], P.CompletionResponse]:
    """Each engine output's stream deltas, and the whole response built after the last."""

    async def go() -> tuple[list[list[R.Delta]], P.CompletionResponse]:
        engine: Any = ScriptedEngine(finish=finish)
        params = SamplingParams(max_tokens=2, logprobs=None if fmt is None else fmt.num_top)
        sub = Submission(
            engine,
            [PROMPT_IDS],
            params,
            namespace=None,
            request_id="t",
            echo=[Echo("abc", "<7>")],
            echo_only=echo_only,
        )
        try:
            steps = []
            while not sub.finished:
                i, _ = await sub.next_event()
                steps.append(R.take_deltas(sub, i, None, fmt))
            return steps, R.completion_response(sub, "id", "m", 0, fmt, 1)
        finally:
            await sub.close()

    return asyncio.run(go())


def test_stream_holds_the_echo_until_the_prompt_logprobs_exist() -> None:
    fmt = R.LogprobFormat(num_top=1)
    steps, whole = _run_scripted(fmt)
    assert steps[0] == []  # a prefill chunk without prompt logprobs: nothing may go yet
    (first,) = steps[1]
    assert first.text == "abcx" and first.finish_reason is None
    assert first.logprobs is not None
    assert [t.token for t in first.logprobs] == ["<7>", "<8>", "<9>", "<20>"]
    assert [t.logprob for t in first.logprobs] == [None, -0.5, -2.0, -0.125]
    assert [t.text_offset for t in first.logprobs] == [0, 3, 6, 9]
    (last,) = steps[2]
    assert last.text == "y" and last.finish_reason == "length"
    assert last.logprobs is not None and [t.text_offset for t in last.logprobs] == [13]
    # the whole response is the stream put together
    (choice,) = whole.choices
    assert choice.text == "abcxy" and choice.logprobs is not None
    streamed = R.completion_logprobs(first.logprobs + last.logprobs)
    assert choice.logprobs == streamed
    assert choice.logprobs.top_logprobs[:3] == [
        None,
        {"<8>": -0.5},  # the token is the most likely: one entry
        {"<4>": -0.25, "<9>": -2.0},  # the top one, then the prompt's token
    ]


def test_echo_without_logprobs_goes_out_at_once() -> None:
    steps, whole = _run_scripted(None)
    assert [(d.text, d.logprobs) for d in steps[0]] == [("abc", None)]
    assert "".join(d.text for s in steps for d in s) == whole.choices[0].text == "abcxy"


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_echo_only_hides_the_generated_token(finish: str) -> None:
    fmt = R.LogprobFormat(num_top=0, as_token_ids=True)
    steps, whole = _run_scripted(fmt, echo_only=True, finish=finish)
    sent = [d for s in steps for d in s]
    assert "".join(d.text for d in sent) == "abc"
    assert [d.finish_reason for d in sent][-1] == "length"
    (choice,) = whole.choices
    assert choice.text == "abc" and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["token_id:7", "token_id:8", "token_id:9"]
    assert whole.usage is not None and whole.usage.completion_tokens == 0


def test_prompt_logprobs_shape_and_top_k() -> None:
    out = _output("", [], prompt_lps=True)
    shown = R.prompt_logprobs(out, 1)
    assert shown is not None and shown[0] is None
    encoded = json.loads(P.encode(shown))
    assert encoded[1] == {"8": {"logprob": -0.5, "rank": 1, "decoded_token": "<8>"}}
    # the prompt's own token first, then the k most likely
    assert list(encoded[2]) == ["9", "4"]
    assert list(json.loads(P.encode(R.prompt_logprobs(out, 2)))[2]) == ["9", "4", "5"]
    assert list(json.loads(P.encode(R.prompt_logprobs(out, 0)))[2]) == ["9"]
    ninf = [None, PROMPT_LPS[1], {9: Logprob(-math.inf, 99, "<9>")}]
    clamped = R.prompt_logprobs(msgspec.structs.replace(out, prompt_logprobs=ninf), 0)
    assert clamped is not None and clamped[2] is not None
    assert clamped[2]["9"].logprob == -9999.0  # JSON has no -inf
    assert R.prompt_logprobs(_output("", [], prompt_lps=False), 1) is None


# ------------------------------------------------------------------ radixkv-tiny: text


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def http(tiny: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny[0].url, timeout=60) as c:
        yield c


def test_echo_text_is_prompt_then_completion(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = tiny[1]
    base = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    prompts = ["The cache holds", "Pages of keys: \u00e9t\u00e9"]
    plain = _post(http, {**base, "prompt": prompts})
    echoed = _post(http, {**base, "prompt": prompts, "echo": True})
    assert len(echoed["choices"]) == 2
    for p, a, b in zip(prompts, plain["choices"], echoed["choices"]):
        assert b["text"] == p + a["text"] and len(a["text"]) > 0
    assert echoed["usage"]["completion_tokens"] == 10  # echo adds no completion tokens
    # a token-id prompt echoes its text, decoded as the engine decodes output text
    ids = st.tokenizer.encode(prompts[0])
    assert ids[0] == st.tokenizer.bos_token_id  # ... which leaves the BOS out
    by_ids = _post(http, {**base, "prompt": ids, "echo": True})
    assert by_ids["choices"][0]["text"] == echoed["choices"][0]["text"]
    # n > 1 and several token prompts: every choice starts with its own prompt
    ids2 = st.tokenizer.encode("Another one")
    body = {**base, "prompt": [ids, ids2], "n": 2, "temperature": 1.0, "seed": 3, "echo": True}
    r = _post(http, body)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        head = prompts[0] if c["index"] < 2 else "Another one"
        assert c["text"].startswith(head) and len(c["text"]) > len(head)


def test_echo_only_max_tokens_zero(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = tiny[1]
    body = {"model": MODEL, "prompt": "Score me", "max_tokens": 0, "echo": True}
    r = _post(http, body)
    (c,) = r["choices"]
    assert c["text"] == "Score me" and c["finish_reason"] == "length"
    n = len(st.tokenizer.encode("Score me"))
    u = r["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (n, 0, n)
    joined = _joined(_stream(http, {**body, "stream_options": {"include_usage": True}}))
    assert joined[0]["text"] == "Score me" and joined[0]["finish_reason"] == "length"
    # the context check counts the one token the engine runs: 255 prompt tokens fit in 256
    fits = [65] * 255
    r = _post(http, {**body, "prompt": fits, "logprobs": 0})
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 255
    err = _error(http.post("/v1/completions", json={**body, "prompt": [*fits, 65]}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert "1 in the completion" in err["message"]
    assert_clean(st)


def test_echo_logprobs_layout(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    st = tiny[1]
    prompt = "Shared prefixes are cheap"
    ids = st.tokenizer.encode(prompt)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 2,
    }
    r = _post(http, body)
    (c,) = r["choices"]
    lp = c["logprobs"]
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 4
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + 4
    assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids) + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    texts = [st.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert lp["tokens"][: len(ids)] == texts  # "<|bos|>" first: special tokens kept
    # offsets run on across the prompt's tokens into the completion's
    offsets = [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    plain = _post(http, {**body, "echo": False, "logprobs": None})["choices"][0]
    assert c["text"] == prompt + plain["text"]
    for tok, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[tok] == v and 1 <= len(top) <= 3  # the token plus the 2 most likely
        assert list(top.values()) == sorted(top.values(), reverse=True)
    # the engine's own prompt logprobs, straight from Engine.generate
    ref = _engine_prompt_logprobs(ids, 2)
    for j in range(1, len(ids)):
        assert lp["token_logprobs"][j] == pytest.approx(ref[j][ids[j]].logprob, abs=ATOL)
        assert set(lp["top_logprobs"][j]) == {x.decoded_token for x in ref[j].values()}
    # return_tokens_as_token_ids names prompt tokens too
    r = _post(http, {**body, "return_tokens_as_token_ids": True})
    tokens = r["choices"][0]["logprobs"]["tokens"]
    assert tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert_clean(st)


def _engine_prompt_logprobs(ids: list[int], k: int) -> list[dict[int, Logprob]]:
    """Prompt logprobs of ``ids`` from ``Engine.generate`` on a fresh radixkv-tiny engine."""
    eng = Engine(MODEL, num_pages=256)
    (out,) = eng.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k), use_tqdm=False
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [e or {} for e in out.prompt_logprobs]


def test_streamed_echo_equals_whole_response(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": ["Radix trees share", "A cache", "Pages"],
        "max_tokens": 6,
        "n": 2,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 1,
    }
    whole = _post(http, body)
    chunks = _stream(http, body)
    joined = _joined(chunks)
    assert sorted(joined) == [c["index"] for c in whole["choices"]] == list(range(6))
    for c in whole["choices"]:
        s = joined[c["index"]]
        assert s["text"] == c["text"] and s["finish_reason"] == c["finish_reason"]
        got, want = s["logprobs"], c["logprobs"]
        assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-5)
        assert [t and set(t) for t in got["top_logprobs"]] == [
            t and set(t) for t in want["top_logprobs"]
        ]
        # the prompt went out in the choice's first chunk, before any generated text
        prompt = body["prompt"][c["index"] // 2]
        assert s["first"]["text"].startswith(prompt)
        assert s["first"]["logprobs"]["token_logprobs"][0] is None
    # without logprobs too
    body.pop("logprobs")
    whole = _post(http, body)
    joined = _joined(_stream(http, body))
    assert [joined[c["index"]]["text"] for c in whole["choices"]] == [
        c["text"] for c in whole["choices"]
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"echo": True, "suffix": "!"}, "suffix"),
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": P.MAX_LOGPROBS + 1}, "prompt_logprobs"),
        ({"prompt_logprobs": "3"}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_echo_and_prompt_logprobs_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    assert _error(http.post("/v1/completions", json=body))["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 99}, "prompt_logprobs"),
        ({"prompt_logprobs": [1]}, "prompt_logprobs"),
        ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_chat_prompt_logprobs_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    assert _error(http.post("/v1/chat/completions", json=body))["param"] == param


def test_server_keeps_serving_after_bad_requests(
    tiny: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    for _ in range(3):
        for bad in (
            {"max_tokens": 0},
            {"prompt_logprobs": -3},
            {"prompt_logprobs": 1, "stream": True},
        ):
            _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **bad}))
        r = _post(
            http, {"model": MODEL, "prompt": "ok", "max_tokens": 0, "echo": True, "logprobs": 0}
        )
        assert r["choices"][0]["text"] == "ok"
    assert_clean(tiny[1])


# ------------------------------------------------------------------ values: a Llama and its twin


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-echo"))


@pytest.fixture(scope="module")
def llama(small: tuple[Any, Any]) -> Iterator[tuple[httpx.Client, ServerState]]:
    engine = AsyncEngine(small[1], page_size=4, num_pages=600)
    app = build_app(engine, ServerConfig(model_name=SMALL), owns_engine=True)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c, app.state.radixkv


@torch.no_grad()
def _ref(hf: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row j is log P(. | ids[:j]) from transformers (row 0 unused)."""
    lp = torch.log_softmax(hf_logits(hf, ids), dim=-1)
    return torch.cat([torch.full_like(lp[:1], math.nan), lp[:-1]])


PROMPTS = [list(range(40, 77)), [*range(40, 60), 5, 9, 200, 31], [3, 4]]


def test_echo_logprobs_equal_transformers(
    small: tuple[Any, Any], llama: tuple[httpx.Client, ServerState]
) -> None:
    hf, _ = small
    http, st = llama
    body = {
        "model": SMALL,
        "prompt": PROMPTS,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "echo": True,
        "logprobs": 3,
        "return_tokens_as_token_ids": True,
    }
    for _ in range(2):  # the second time the prompts' pages are cached: same values
        r = _post(http, body)
        for ids, c in zip(PROMPTS, r["choices"]):
            lp = c["logprobs"]
            toks = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            assert toks[: len(ids)] == ids and len(toks) == len(ids) + 3
            ref = _ref(hf, toks)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            for j in range(1, len(toks)):
                assert abs(lp["token_logprobs"][j] - ref[j, toks[j]].item()) <= ATOL, j
                top = {
                    int(t.removeprefix("token_id:")): v for t, v in lp["top_logprobs"][j].items()
                }
                best = ref[j].topk(3).indices.tolist()
                assert set(top) == set(best) | {toks[j]}
                for t, v in top.items():
                    assert abs(v - ref[j, t].item()) <= ATOL
    assert_clean(st)


def test_lm_eval_loglikelihood_request(
    small: tuple[Any, Any], llama: tuple[httpx.Client, ServerState]
) -> None:
    """lm-eval-harness's ``local-completions`` loglikelihood: context + continuation as token
    ids, one generated token; it reads ``token_logprobs[ctxlen:-1]`` and ``top_logprobs``."""
    hf, _ = small
    http, _ = llama
    pairs = [
        (list(range(40, 70)), [70, 71, 72]),  # a continuation the model may or may not pick
        (list(range(100, 112)), [9]),
        ([5, 6], [7, 8, 9, 10]),
    ]
    # make one continuation greedy by construction: what the model itself picks after ctx
    ctx = [11, 12, 13, 14, 15]
    greedy: list[int] = []
    for _ in range(3):
        greedy.append(int(_ref(hf, ctx + greedy + [0])[-1].argmax()))
    pairs.append((ctx, greedy))
    body = {
        "model": SMALL,
        "prompt": [c + x for c, x in pairs],
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }
    r = _post(http, body)
    choices = sorted(r["choices"], key=lambda c: c["index"])
    assert len(choices) == len(pairs)
    greedy_flags = []
    for (context, cont), choice in zip(pairs, choices):
        ctxlen = len(context)
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == ctxlen + len(cont) + 1  # the prompt, then 1 generated
        loglik = sum(token_logprobs[ctxlen:-1])
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(v == max(top.values()) for v, top in zip(token_logprobs[ctxlen:-1], tops))
        ref = _ref(hf, context + cont)
        want = sum(ref[ctxlen + i, t].item() for i, t in enumerate(cont))
        assert loglik == pytest.approx(want, abs=ATOL * len(cont))
        want_greedy = all(int(ref[ctxlen + i].argmax()) == t for i, t in enumerate(cont))
        assert is_greedy == want_greedy
        greedy_flags.append(is_greedy)
    assert greedy_flags[-1]  # the pair built from the model's own choices
    # echo without generation (max_tokens=0) scores the same
    r0 = _post(http, {**body, "max_tokens": 0})
    for c0, c1 in zip(sorted(r0["choices"], key=lambda c: c["index"]), choices, strict=True):
        assert c0["logprobs"]["token_logprobs"] == pytest.approx(
            c1["logprobs"]["token_logprobs"][:-1], abs=ATOL
        )
        assert c0["finish_reason"] == "length"
    assert r0["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_extension(
    small: tuple[Any, Any], llama: tuple[httpx.Client, ServerState]
) -> None:
    hf, _ = small
    http, st = llama

    def check(plp: list[Any], ids: list[int], k: int) -> None:
        assert len(plp) == len(ids) and plp[0] is None
        ref = _ref(hf, ids)
        for j in range(1, len(ids)):
            entry = plp[j]
            keys = [int(t) for t in entry]
            assert keys[0] == ids[j]  # the prompt's own token first
            best = set(ref[j].topk(k).indices.tolist()) if k else set()
            assert set(keys) == best | {ids[j]}
            for t, v in zip(keys, entry.values()):
                assert set(v) == {"logprob", "rank", "decoded_token"}
                assert abs(v["logprob"] - ref[j, t].item()) <= ATOL
                better = int((ref[j] > ref[j, t] + ATOL).sum())
                at_least = int((ref[j] >= ref[j, t] - ATOL).sum())
                assert better + 1 <= v["rank"] <= at_least
                assert v["decoded_token"] == st.tokenizer.decode([t], skip_special_tokens=False)

    body = {"model": SMALL, "prompt": PROMPTS[:2], "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
    r = _post(http, body)
    for c in r["choices"]:
        assert c["logprobs"] is None  # not asked for: only prompt_logprobs
        check(c["prompt_logprobs"], PROMPTS[c["index"] // 2], 2)
    # not asked for: null (as vLLM); prompt_logprobs=0 is each prompt token alone
    r = _post(http, {**body, "prompt_logprobs": None, "n": 1})
    assert all(c["prompt_logprobs"] is None for c in r["choices"])
    r = _post(http, {**body, "prompt_logprobs": 0, "n": 1})
    check(r["choices"][1]["prompt_logprobs"], PROMPTS[1], 0)
    # with echo's logprobs at a different k: each shows its own number of alternatives
    echo = {"echo": True, "logprobs": 4, "return_tokens_as_token_ids": True}
    r = _post(http, {**body, **echo, "n": 1, "prompt_logprobs": 1})
    for c in r["choices"]:
        ids = PROMPTS[c["index"]]
        check(c["prompt_logprobs"], ids, 1)
        ref = _ref(hf, ids)
        for j in range(1, len(ids)):
            top = {int(t.removeprefix("token_id:")) for t in c["logprobs"]["top_logprobs"][j]}
            assert top == set(ref[j].topk(4).indices.tolist()) | {ids[j]}
    # chat: the rendered messages' prompt logprobs, top level
    messages = [{"role": "user", "content": "Pages of keys and values"}]
    chat = {"model": SMALL, "messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
    r = _post(http, chat, "/v1/chat/completions")
    ids = st.chat_ids(P.decode_request(json.dumps(chat).encode(), P.ChatCompletionRequest))
    assert r["usage"]["prompt_tokens"] == len(ids)
    check(r["prompt_logprobs"], ids, 1)
    r = _post(http, {**chat, "prompt_logprobs": None}, "/v1/chat/completions")
    assert r["prompt_logprobs"] is None
    assert_clean(st)
