"""SGLang's native API (server/native.py): ``/generate`` with text or input_ids, single and
batched, ``n`` samples in SGLang's order, streamed (cumulative chunks, ``[DONE]``), logprobs in
SGLang's ``[logprob, token_id, text]`` shapes equal to the OpenAI routes' values, finish reasons,
constrained outputs, beam search, LoRA adapters by ``lora_path``; the prefix cache shared with
the OpenAI routes and emptied by ``/flush_cache``; ``/get_model_info``, ``/get_server_info``,
``/health_generate``; and the OpenAI routes' policies (API keys, ``max_queue``, the body limit,
400s naming the field, client disconnects releasing everything, metrics).

Where SGLang 0.5.23's wheel is in the benchmark cache (bench/sglang_peer.py downloads it), the
answers are also decoded by SGLang's own generated API types (sglang/api/v1/api_types.py, which
needs msgspec only): the wire contract SGLang's Rust and Python servers share.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_helpers import (
    MODEL,
    assert_clean,
    checked_http,
    failing_forward,
    in_loop,
    live_server,
    metric_values,
    wait_drained,
)

from radixkv.engine.params import SamplingParams
from radixkv.server.background import BackgroundServer
from radixkv.server.config import ServerConfig
from radixkv.server.native import FLUSHED
from radixkv.server.state import ServerState

ADMIN = "native-admin-key-01"
KEY = "native-tenant-key-01"
# long enough to fill a few 16-token pages (radixkv-tiny's tokenizer is byte-level)
DOC = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the window "
    "and the bird sings a song about the morning sun. "
)
PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SAME = {"ignore_eos": True}  # the OpenAI routes' request for GREEDY's outputs
SGLANG_WHEEL = "sglang-0.5.23-*.whl"


# ------------------------------------------------------------------ SGLang's own contract


def _sglang_api_types() -> types.ModuleType | None:
    """SGLang 0.5.23's generated API types, from its wheel in the benchmark cache (None
    without it: nothing is downloaded here)."""
    cache = Path.home() / ".cache" / "radixkv-bench"
    wheels = sorted(cache.glob(SGLANG_WHEEL)) if cache.is_dir() else []
    if not wheels:
        return None
    with zipfile.ZipFile(wheels[-1]) as z:
        source = z.read("sglang/api/v1/api_types.py").decode()
    spec = importlib.util.spec_from_loader("sglang_api_types", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    exec(compile(source, "sglang/api/v1/api_types.py", "exec"), module.__dict__)
    return module


SGL = _sglang_api_types()


def conforms(body: Any, kind: str = "GenerateResponse") -> None:
    """``body`` decodes as SGLang's ``kind`` (each entry of a list), when its types are here;
    the decoder checks every field it knows (types, the logprob triples, finish reasons)."""
    if SGL is None:
        return
    decode = getattr(SGL, kind).from_json_value
    for entry in body if isinstance(body, list) else [body]:
        decode(entry)


needs_sglang = pytest.mark.skipif(SGL is None, reason=f"no {SGLANG_WHEEL} in the bench cache")


@needs_sglang
def test_every_sglang_field_is_known() -> None:
    """Every sampling parameter of SGLang's contract is mapped or refused by name, and every
    field of its /generate body is served, refused by name or ignored as operational."""
    from radixkv.server.native_protocol import GenerateRequest, NativeSamplingParams

    assert set(SGL._FIELDS_SamplingParams) == set(NativeSamplingParams.__struct_fields__)
    ours = set(GenerateRequest.__struct_fields__)
    assert set(SGL.GenerateRequest.__struct_fields__) <= ours


@needs_sglang
@pytest.mark.parametrize(
    "sp",
    [
        {"temperature": "hot"},
        {"max_new_tokens": 1.5},
        {"stop": 3},
        {"ignore_eos": "yes"},
        {"temprature": 0.5},
        {"json_schema": 3},
        {"choice": "yes"},
    ],
)
def test_sampling_params_sglang_refuses_are_refused(http: httpx.Client, sp: dict[str, Any]) -> None:
    with pytest.raises(SGL.JsonContractError):
        SGL.SamplingParams.from_json_value(sp)
    err = error_of(http.post("/generate", json={"text": "x", "sampling_params": sp}))
    assert err["param"] == f"sampling_params.{next(iter(sp))}"


@pytest.fixture
def sglang_frontend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """SGLang's frontend language (``sglang.lang.api``, its ``RuntimeEndpoint`` client) from
    the wheel, without SGLang's server: the package ``__init__`` files are not run, and the two
    modules it touches beyond the frontend are stand-ins (its environment switches; pybase64,
    when missing, is base64). Everything imported is dropped again afterwards."""
    cache = Path.home() / ".cache" / "radixkv-bench"
    wheel = sorted(cache.glob(SGLANG_WHEEL))[-1]
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp_path, [n for n in z.namelist() if n.startswith("sglang/lang/")])
        z.extract("sglang/utils.py", tmp_path)
    before = set(sys.modules)

    def package(name: str, path: Path | None = None) -> None:
        module = types.ModuleType(name)
        module.__path__ = [str(path)] if path is not None else []
        monkeypatch.setitem(sys.modules, name, module)

    package("sglang", tmp_path / "sglang")
    package("sglang.lang", tmp_path / "sglang" / "lang")
    package("sglang.lang.backend", tmp_path / "sglang" / "lang" / "backend")
    package("sglang.srt")
    environ = types.ModuleType("sglang.srt.environ")
    switch = types.SimpleNamespace(get=lambda: False)
    environ.envs = types.SimpleNamespace(SGLANG_IS_IN_CI=switch)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.environ", environ)
    if importlib.util.find_spec("pybase64") is None:
        import base64

        monkeypatch.setitem(sys.modules, "pybase64", base64)
    try:
        yield importlib.import_module("sglang.lang.api")
    finally:
        for name in set(sys.modules) - before:
            if name.startswith("sglang"):
                del sys.modules[name]


@needs_sglang
def test_sglang_s_own_frontend_runs_against_radixkv(
    sglang_frontend: types.ModuleType,
    http: httpx.Client,
    oai: openai.OpenAI,
    server: tuple[BackgroundServer, ServerState],
) -> None:
    """``sgl.function`` programs with ``gen`` and ``select`` (which scores each choice with
    ``max_new_tokens: 0``, ``logprob_start_len`` and ``input_token_logprobs``), streamed too."""
    sgl = sglang_frontend
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    backend = RuntimeEndpoint(server[0].url, api_key=ADMIN)  # the admin key: to flush
    assert backend.get_model_name() == MODEL
    choices = ["red", "green", "blue"]

    @sgl.function
    def program(s: Any, question: str) -> None:
        s += question
        s += sgl.gen("answer", max_tokens=8, temperature=0)
        s += "\nPick:" + sgl.select("pick", choices=choices)

    state = program.run(question=PROMPT, backend=backend)
    want = generate(http, text=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert state["answer"] == want["text"]
    assert state.get_meta_info("answer")["finish_reason"] == {"type": "length", "length": 8}
    # select scored each choice from two tokens before its end on: the values are the
    # completions route's prompt logprobs of the same tokens
    context = PROMPT + state["answer"] + "\nPick:"
    tok = server[1].tokenizer
    start = max(len(tok.encode(context)) - 2, 0)
    meta = state.get_meta_info("pick")
    for choice, got in zip(choices, meta["input_token_logprobs"]):
        ids = tok.encode(context + choice)
        plp = (
            oai.completions.create(
                model=MODEL,
                prompt=context + choice,
                max_tokens=1,
                extra_body={"prompt_logprobs": 0},
            )
            .choices[0]
            .model_extra["prompt_logprobs"]
        )
        expected = [plp[t][str(ids[t])]["logprob"] for t in range(start + 1, len(ids))]
        assert [v for v, _, _ in got if v is not None] == pytest.approx(expected, abs=1e-5)
    scores = meta["normalized_prompt_logprobs"]
    assert state["pick"] == choices[scores.index(max(scores))]
    streamed = "".join(program.run(question=PROMPT, backend=backend, stream=True).text_iter())
    assert streamed.startswith(PROMPT + want["text"])
    backend.flush_cache()  # raises unless 200
    assert generate(http, text=PROMPT, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    # a short context: the test that fills it stays cheap
    with live_server(ServerConfig(admin_key=ADMIN), max_model_len=1024) as s:
        yield s


@pytest.fixture
def http(server: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    """A client of the server; after the test the server holds nothing (assert_clean)."""
    with checked_http(server) as c:
        yield c


@pytest.fixture
def oai(server: tuple[BackgroundServer, ServerState]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server[0].url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield c
    c.close()


def generate(http: httpx.Client, **body: Any) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    conforms(out)
    return out


def stream(http: httpx.Client, **body: Any) -> list[Any]:
    """The parsed chunks of a streamed /generate, [DONE] last (checked) and not returned."""
    lines = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                lines.append(line.removeprefix("data: "))
    assert lines[-1] == "[DONE]" and "[DONE]" not in lines[:-1]
    chunks = [json.loads(x) for x in lines[:-1]]
    conforms(chunks)
    return chunks


def error_of(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if SGL is not None:
        SGL.ErrorBody.from_json_value(err)
    return err


def unique(tag: str) -> str:
    """A prompt no other test sends (nothing of it is cached yet), a few pages long."""
    return f"[{tag}] " + DOC


# ------------------------------------------------------------------ /generate


def test_text_prompt(http: httpx.Client, server: tuple[BackgroundServer, ServerState]) -> None:
    out = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 6})
    assert set(out) == {"text", "output_ids", "meta_info"}
    tok = server[1].tokenizer
    assert len(out["output_ids"]) == 6 and tok.decode(out["output_ids"]) == out["text"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(tok.encode(PROMPT))
    assert meta["completion_tokens"] == 6 and meta["e2e_latency"] > 0
    assert re.fullmatch(r"[0-9a-f]{32}", meta["id"])
    assert "input_token_logprobs" not in meta  # only with return_logprob
    put = http.put("/generate", json={"text": PROMPT, "sampling_params": GREEDY})  # SGLang's too
    assert put.status_code == 200 and put.json()["text"].startswith(out["text"])


def test_priority_is_sglang_s_higher_first() -> None:
    from radixkv.server.auth import Principal
    from radixkv.server.native_plan import Planner

    planner = Planner(types.SimpleNamespace(), Principal(""))  # type: ignore[arg-type]
    assert planner.priority(5) == -5 and planner.priority(-2) == 2  # radixkv: lower first
    assert planner.priority(None) == 0


def test_greedy_output_is_the_completions_route_s(
    http: httpx.Client, oai: openai.OpenAI, server: tuple[BackgroundServer, ServerState]
) -> None:
    want = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=SAME
    )
    by_text = generate(http, text=PROMPT, sampling_params=GREEDY)
    ids = server[1].tokenizer.encode(PROMPT)
    by_ids = generate(http, input_ids=list(ids), sampling_params=GREEDY, rid="mine")
    assert by_text["text"] == by_ids["text"] == want.choices[0].text
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_ids["meta_info"]["id"] == "mine"


def test_batches_keep_their_order(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    tok = server[1].tokenizer
    prompts = ["def add(a, b):", "SELECT * FROM", "Once upon a time"]
    singles_out = [generate(http, text=p, sampling_params=GREEDY) for p in prompts]
    singles = [o["text"] for o in singles_out]
    out = generate(http, text=prompts, sampling_params=GREEDY, rid="job")
    assert isinstance(out, list) and [o["text"] for o in out] == singles
    assert [o["meta_info"]["id"] for o in out] == ["job_0", "job_1", "job_2"]
    assert len(set(singles)) == 3  # the prompts are told apart
    ids = [generate(http, text=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:2]]
    per_prompt = [{**GREEDY, "max_new_tokens": 3}, GREEDY]
    out = generate(
        http,
        text=prompts[:2],
        sampling_params=per_prompt,
        rid=["a", "b"],
        return_prompt_token_ids=True,
    )
    assert out[0]["output_ids"] == ids[0][:3] and out[1]["output_ids"] == ids[1]
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert out[1]["prompt_token_ids"] == list(tok.encode(prompts[1]))
    assert "prompt_token_ids" not in singles_out


def test_input_id_batches(http: httpx.Client, server: tuple[BackgroundServer, ServerState]) -> None:
    tok = server[1].tokenizer
    texts = ["alpha beta", "gamma delta"]
    out = generate(http, input_ids=[list(tok.encode(t)) for t in texts], sampling_params=GREEDY)
    assert [o["text"] for o in out] == [
        generate(http, text=t, sampling_params=GREEDY)["text"] for t in texts
    ]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(tok.encode(t)) for t in texts]


def test_n_samples_come_prompt_major(http: httpx.Client) -> None:
    prompts = ["a", "a longer prompt"]  # told apart by their lengths
    sp = {"n": 3, "temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 7}
    out = generate(http, text=prompts, sampling_params=sp)
    assert len(out) == 6
    lengths = [
        generate(http, text=p, sampling_params={"max_new_tokens": 1})["meta_info"]["prompt_tokens"]
        for p in prompts
    ]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [lengths[0]] * 3 + [lengths[1]] * 3
    assert len({o["meta_info"]["id"] for o in out}) == 6
    assert len({o["text"] for o in out[:3]}) > 1  # sampled, seed + i per sample
    again = generate(http, text=prompts, sampling_params=sp)
    assert [o["text"] for o in again] == [o["text"] for o in out]  # sampling_seed: reproducible
    single = generate(http, text="a", sampling_params={**GREEDY, "n": 2})
    assert isinstance(single, list) and len(single) == 2  # n > 1 answers a list, as in SGLang
    assert single[0]["text"] == single[1]["text"]


def test_repeated_prompts_hit_the_cache_shared_with_the_openai_routes(
    http: httpx.Client, oai: openai.OpenAI
) -> None:
    first = generate(http, text=unique("repeat"), sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    second = generate(http, text=unique("repeat"), sampling_params=GREEDY)
    assert second["meta_info"]["cached_tokens"] >= 16
    assert second["text"] == first["text"]
    oai.completions.create(model=MODEL, prompt=unique("shared"), max_tokens=2)
    native = generate(http, text=unique("shared"), sampling_params=GREEDY)
    assert native["meta_info"]["cached_tokens"] >= 16  # cached by the completions request
    r = http.post("/generate", json={"text": unique("salted"), "cache_salt": "s1"})
    assert r.json()["meta_info"]["cached_tokens"] == 0
    r = http.post("/generate", json={"text": unique("salted"), "cache_salt": "s2"})
    assert r.json()["meta_info"]["cached_tokens"] == 0  # another salt: another namespace
    salted = oai.completions.create(
        model=MODEL, prompt=unique("salted"), max_tokens=1, extra_body={"cache_salt": "s1"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens >= 16  # the same salt: shared
    r = http.post(
        "/generate", json={"text": unique("salted"), "cache_salt": "s1", "extra_key": "k"}
    )
    assert r.json()["meta_info"]["cached_tokens"] == 0  # extra_key narrows it further


def test_prefill_only_runs_the_prompt_and_shows_nothing(http: httpx.Client) -> None:
    out = generate(http, text=unique("prefill"), sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0
    after = generate(http, text=unique("prefill"), sampling_params=GREEDY)
    assert after["meta_info"]["cached_tokens"] >= 16  # SGLang's cache_prefix works


def test_streaming_sends_cumulative_chunks(http: httpx.Client) -> None:
    whole = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 10})
    chunks = stream(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 10})
    assert len(chunks) >= 2
    for before, after in itertools.pairwise(chunks):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["meta_info"]["completion_tokens"] > before["meta_info"]["completion_tokens"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert all("index" not in c for c in chunks)  # a single prompt's chunks carry no index
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert len({c["meta_info"]["id"] for c in chunks}) == 1


def test_streamed_batches_carry_their_index(http: httpx.Client) -> None:
    prompts = ["one", "two two"]
    whole = generate(http, text=prompts, sampling_params={**GREEDY, "n": 2})
    chunks = stream(http, text=prompts, sampling_params={**GREEDY, "n": 2})
    final = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(final) == [0, 1, 2, 3]
    assert [final[i]["text"] for i in range(4)] == [w["text"] for w in whole]
    for c in chunks:
        assert c["meta_info"]["prompt_tokens"] == whole[c["index"]]["meta_info"]["prompt_tokens"]


def _openai_logprobs(oai: openai.OpenAI, prompt: str, n_top: int) -> Any:
    return oai.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        logprobs=n_top,
        extra_body={"prompt_logprobs": n_top, **SAME},
    ).choices[0]


@pytest.mark.parametrize("streamed", [False, True])
def test_logprobs_in_sglang_shapes_equal_the_openai_route_s(
    http: httpx.Client,
    oai: openai.OpenAI,
    server: tuple[BackgroundServer, ServerState],
    streamed: bool,
) -> None:
    want = _openai_logprobs(oai, PROMPT, 2)
    body = dict(
        text=PROMPT,
        sampling_params={**GREEDY, "max_new_tokens": 6},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )
    meta = (stream(http, **body)[-1] if streamed else generate(http, **body))["meta_info"]
    out = meta["output_token_logprobs"]
    assert len(out) == 6 == meta["output_token_logprobs_length"]
    assert [t for _, _, t in out] == want.logprobs.tokens
    assert [lp for lp, _, _ in out] == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
    for row, top in zip(meta["output_top_logprobs"], want.logprobs.top_logprobs):
        assert len(row) == 2 and row[0][0] >= row[1][0]
        assert {t: lp for lp, _, t in row} == pytest.approx(
            {t: top[t] for _, _, t in row}, abs=1e-5
        )
    ids = server[1].tokenizer.encode(PROMPT)
    inputs = meta["input_token_logprobs"]
    assert [i for _, i, _ in inputs] == list(ids)
    assert inputs[0][0] is None and meta["input_top_logprobs"][0] is None
    plp = want.model_extra["prompt_logprobs"]
    for (lp, tok, _), entry in zip(inputs[1:], plp[1:]):
        assert lp == pytest.approx(entry[str(tok)]["logprob"], abs=1e-5)
    assert all(len(row) == 2 for row in meta["input_top_logprobs"][1:])


def test_logprob_start_len_and_the_defaults(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    ids = server[1].tokenizer.encode(PROMPT)
    full = generate(
        http, text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0
    )
    meta = generate(
        http, text=PROMPT, sampling_params=GREEDY, return_logprob=True, logprob_start_len=5
    )["meta_info"]
    assert [i for _, i, _ in meta["input_token_logprobs"]] == list(ids[5:])
    assert meta["input_token_logprobs"][0][0] is None  # SGLang's: the start token has none
    assert meta["input_token_logprobs"][1:] == full["meta_info"]["input_token_logprobs"][6:]
    assert all(t is None for _, _, t in meta["output_token_logprobs"])  # no return_text_in_logprobs
    assert "output_top_logprobs" not in meta  # top_logprobs_num 0
    plain = generate(http, text=PROMPT, sampling_params=GREEDY, return_logprob=True)["meta_info"]
    assert plain["input_token_logprobs"] == [] and len(plain["output_token_logprobs"]) == 8
    last = generate(
        http,
        text=PROMPT,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=len(ids) - 1,
    )
    assert last["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    scored = generate(
        http,
        text=PROMPT,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )["meta_info"]
    assert scored["input_token_logprobs"] == full["meta_info"]["input_token_logprobs"]
    assert scored["output_token_logprobs"] == []


@pytest.mark.parametrize("streamed", [False, True])
def test_token_ids_logprob_reports_the_asked_ids_at_every_position(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState], streamed: bool
) -> None:
    """SGLang's token_ids_logprob: [logprob, id, text] of each asked id, in the order asked,
    at every output position and (from logprob_start_len) every input position; the values
    the engine gives the same ids when it is asked for the whole vocabulary."""
    st = server[1]
    asked = [17, 5, 17, 90]  # a repeat is reported once
    body = dict(
        text=PROMPT,
        sampling_params={**GREEDY, "max_new_tokens": 5},
        return_logprob=True,
        logprob_start_len=0,
        token_ids_logprob=asked,
        return_text_in_logprobs=True,
    )
    meta = (stream(http, **body)[-1] if streamed else generate(http, **body))["meta_info"]
    ids = st.tokenizer.encode(PROMPT)
    every = SamplingParams(
        temperature=0.0, max_tokens=5, logprobs=st.vocab_size, prompt_logprobs=st.vocab_size
    )

    async def reference() -> Any:
        return st.engine.engine.generate([ids], every, use_tqdm=False)[0]

    wait_drained(st)  # no step runs while the engine is used directly in its loop
    ref = in_loop(st, reference)
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == 5 == len(ref.outputs[0].logprobs)
    for row, entry in zip(outs, ref.outputs[0].logprobs):
        assert [i for _, i, _ in row] == [17, 5, 90]
        for lp, i, t in row:
            assert lp == pytest.approx(entry[i].logprob, abs=1e-5) and t == st.token_texts(i)
    ins = meta["input_token_ids_logprobs"]
    assert ins[0] is None and len(ins) == len(ids) == len(ref.prompt_logprobs)
    for row, entry in zip(ins[1:], ref.prompt_logprobs[1:]):
        assert {i: lp for lp, i, _ in row} == pytest.approx(
            {i: entry[i].logprob for i in (17, 5, 90)}, abs=1e-5
        )
    per_prompt = http.post(
        "/generate",
        json=dict(
            text=[PROMPT, PROMPT + " x"],
            sampling_params={**GREEDY, "max_new_tokens": 2},
            return_logprob=True,
            token_ids_logprob=[[3], [4, 6]],
        ),
    )
    assert per_prompt.status_code == 200, per_prompt.text
    a, b = per_prompt.json()
    assert [[i for _, i, _ in r] for r in a["meta_info"]["output_token_ids_logprobs"]] == [[3]] * 2
    assert [[i for _, i, _ in r] for r in b["meta_info"]["output_token_ids_logprobs"]] == [
        [4, 6]
    ] * 2
    plain = generate(http, text=PROMPT, sampling_params=GREEDY, token_ids_logprob=[3])["meta_info"]
    assert "output_token_ids_logprobs" not in plain  # without return_logprob: none (SGLang's)


@pytest.mark.parametrize(
    "value",
    [[10**8], [[1], "x"], "12", [True], [[1], [2]]],
    ids=["outside", "mixed", "text", "bool", "per-prompt-for-one"],
)
def test_bad_token_ids_logprob_is_a_400(http: httpx.Client, value: Any) -> None:
    err = error_of(
        http.post(
            "/generate", json={"text": PROMPT, "return_logprob": True, "token_ids_logprob": value}
        ),
        400,
    )
    assert err["param"] == "token_ids_logprob", err


def test_finish_reasons(http: httpx.Client) -> None:
    free = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12})
    text, ids = free["text"], free["output_ids"]
    at = next(i for i in range(2, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[at : at + 2]  # its first occurrence is after the start
    out = generate(
        http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12, "stop": stop}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:at]
    kept = generate(
        http,
        text=PROMPT,
        sampling_params={**GREEDY, "max_new_tokens": 12, "stop": [stop], "no_stop_trim": True},
    )
    assert kept["text"] == text[: at + 2]
    token = ids[4]
    out = generate(
        http,
        text=PROMPT,
        sampling_params={**GREEDY, "max_new_tokens": 12, "stop_token_ids": [token]},
    )
    first = ids.index(token)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert out["output_ids"] == ids[: first + 1]  # the matched token is the last output id
    short = generate(
        http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 2, "min_new_tokens": 2}
    )
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_unlimited_max_new_tokens_fills_the_context(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    st = server[1]
    ids = [5] * (st.max_context - 3)
    out = generate(
        http, input_ids=ids, sampling_params={"max_new_tokens": None, "ignore_eos": True}
    )
    assert out["meta_info"]["completion_tokens"] == 3
    r = http.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})
    assert error_of(r)["param"] == "input_ids"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_constrained_outputs(http: httpx.Client) -> None:
    sp = {"temperature": 1.0, "sampling_seed": 3, "max_new_tokens": 48}
    out = generate(http, text="JSON:", sampling_params={**sp, "json_schema": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    anything = generate(http, text="JSON:", sampling_params={**sp, "json_schema": "$$ANY$$"})
    empty = generate(http, text="JSON:", sampling_params={**sp, "json_schema": "{}"})
    assert anything["text"] == empty["text"]  # SGLang's "any JSON value": the empty schema
    assert anything["text"] != generate(http, text="JSON:", sampling_params=sp)["text"]
    out = generate(
        http, text="Date:", sampling_params={**sp, "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}
    )
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", out["text"])
    outs = generate(http, text=["A", "B"], sampling_params={**sp, "n": 2, "choice": ["yes", "no"]})
    assert {o["text"] for o in outs} <= {"yes", "no"} and len(outs) == 4
    out = generate(
        http, text="Pick:", sampling_params={**sp, "ebnf": 'root ::= "red" | "green" | "blue"'}
    )
    assert out["text"] in {"red", "green", "blue"}


def test_beam_search(http: httpx.Client, oai: openai.OpenAI) -> None:
    want = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        n=2,
        best_of=4,
        extra_body={"use_beam_search": True},
    )
    out = generate(
        http, text=PROMPT, sampling_params={"beam_width": 4, "n": 2, "max_new_tokens": 6}
    )
    assert isinstance(out, dict)  # one answer per prompt, its hypotheses inside
    beams = out["meta_info"]["beam_results"]
    assert [b["text"] for b in beams] == [
        c.text for c in sorted(want.choices, key=lambda c: c.index)
    ]
    assert out["text"] == beams[0]["text"] and out["output_ids"] == beams[0]["output_ids"]
    assert beams[0]["meta_info"]["sequence_score"] >= beams[1]["meta_info"]["sequence_score"]
    assert out["meta_info"]["completion_tokens"] == sum(len(b["output_ids"]) for b in beams)
    chunks = stream(
        http, text=PROMPT, sampling_params={"beam_width": 4, "n": 2, "max_new_tokens": 6}
    )
    assert len(chunks) == 1  # the search's outcome, once
    streamed = chunks[0]["meta_info"]["beam_results"]
    assert [(b["text"], b["output_ids"]) for b in streamed] == [
        (b["text"], b["output_ids"]) for b in beams
    ]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "text"),
        ({"text": "x", "input_ids": [1, 2]}, "input_ids"),
        ({"text": 3}, "text"),
        ({"text": []}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, [2]]}, "input_ids"),
        ({"input_ids": [[1], []]}, "input_ids[1]"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"input_ids": ["a"]}, "input_ids[0]"),
        ({"text": "x", "sampling_params": {"temprature": 0.5}}, "sampling_params.temprature"),
        ({"text": "x", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        ({"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "x", "sampling_params": {"top_k": -5}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"stop_regex": "\\d"}}, "sampling_params.stop_regex"),
        (
            {"text": "x", "sampling_params": {"structural_tag": "{}"}},
            "sampling_params.structural_tag",
        ),
        (
            {"text": "x", "sampling_params": {"json_schema": "{not json"}},
            "sampling_params.json_schema",
        ),
        (
            {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
            "sampling_params.regex",
        ),
        (
            {"text": "x", "sampling_params": {"ebnf": "root ::= undefined_rule"}},
            "sampling_params.ebnf",
        ),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
            "sampling_params.min_new_tokens",
        ),
        (
            {"text": "x", "sampling_params": {"beam_width": 2, "stop": "a"}},
            "sampling_params.beam_width",
        ),
        ({"text": "x", "sampling_params": [{}, {}]}, "sampling_params"),
        ({"text": ["x", "y"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
        ({"text": ["x", "y"], "sampling_params": [{}, {"top_k": "a"}]}, "sampling_params[1].top_k"),
        ({"text": "x", "image_data": "cat.png"}, "image_data"),
        ({"text": "x", "return_hidden_states": True}, "return_hidden_states"),
        ({"text": "x", "session_params": {"id": "s"}}, "session_params"),
        ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"text": "x", "lora_path": "nope"}, "lora_path"),
        ({"text": ["x", "y"], "rid": ["a", "a"]}, "rid"),
        ({"text": ["x", "y"], "rid": ["a"]}, "rid"),
        ({"text": "x", "priority": 1}, "priority"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    err = error_of(http.post("/generate", json=body))
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_priority_under_another_policy_is_the_sglang_route_s_400(http: httpx.Client) -> None:
    """The engine's intake refuses it; /generate words it as sent (SGLang's higher-first)."""
    for stream in (False, True):
        body = {"text": "x", "priority": 7, "stream": stream, "sampling_params": GREEDY}
        err = error_of(http.post("/generate", json=body))
        assert err["param"] == "priority" and err["message"] == (
            "priority=7 needs the server started with --schedule-policy priority; under the "
            "other policies leave it unset"
        )


def test_bad_json_and_serving_goes_on(http: httpx.Client) -> None:
    r = http.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert "JSON" in error_of(r)["message"]
    assert (
        generate(http, text="still here", sampling_params=GREEDY)["meta_info"]["completion_tokens"]
        == 8
    )


def test_operational_fields_are_ignored(http: httpx.Client) -> None:
    """What SGLang's benchmark sends (routing, logging, null and false switches) is accepted."""
    out = generate(
        http,
        text=PROMPT,
        sampling_params={**GREEDY, "stream_interval": 4, "spaces_between_special_tokens": True},
        lora_path=None,
        return_logprob=False,
        return_routed_experts=False,
        logprob_start_len=-1,
        log_metrics=False,
        routed_dp_rank=0,
        routing_key="r",
        custom_labels={"a": "b"},
        image_data=[],
    )
    assert out["meta_info"]["completion_tokens"] == 8


def test_an_engine_failure_is_a_500_and_serving_goes_on(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    with failing_forward(server[1]) as calls:
        err = error_of(http.post("/generate", json={"text": unique("fail")}), 500)
        assert "injected" in err["message"] and err["type"] == "server_error"
        calls["n"], calls["fail_at"] = 0, 3  # after the stream started: an error chunk
        body = {"text": unique("fail2"), "sampling_params": {"max_new_tokens": 50}, "stream": True}
        with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        last = json.loads(data[-2])["error"]
        assert "injected" in last["message"] and last["code"] == 500
    assert generate(http, text="x", sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 8


# ------------------------------------------------------------------ the other routes


def test_model_and_server_info(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    for path in ("/get_model_info", "/model_info"):
        info = http.get(path).json()
        conforms(info, "GetModelInfoResponse")
        assert info["model_path"] == MODEL and info["is_generation"] is True
        assert info["served_model_name"] == server[1].model_name
    for path in ("/get_server_info", "/server_info"):
        info = http.get(path).json()
        conforms(info, "GetServerInfoResponse")
        assert info["max_context_length"] == server[1].max_context
        assert info["incremental_streaming_output"] is False  # chunks are cumulative
        assert info["page_size"] == 16 and info["internal_states"][0]["num_running_reqs"] >= 0
        assert info["version"]
        core = server[1].engine.engine
        assert info["dtype"] == str(core.kv_pool.compute_dtype).removeprefix("torch.")
        assert info["kv_cache_dtype"] == core.config.kv_cache_dtype == "auto"


def test_health_generate(http: httpx.Client, server: tuple[BackgroundServer, ServerState]) -> None:
    before = in_loop(server[1], server[1].engine.stats).num_finished
    r = http.get("/health_generate")
    assert r.status_code == 200 and r.content == b""
    assert in_loop(server[1], server[1].engine.stats).num_finished == before + 1  # it generated


def test_flush_cache_empties_the_cache(http: httpx.Client) -> None:
    generate(http, text=unique("flush"), sampling_params=GREEDY)
    assert (
        generate(http, text=unique("flush"), sampling_params=GREEDY)["meta_info"]["cached_tokens"]
        > 0
    )
    assert error_of(http.post("/flush_cache"), 401)["message"]  # the admin key
    r = http.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.text == FLUSHED
    assert (
        generate(http, text=unique("flush"), sampling_params=GREEDY)["meta_info"]["cached_tokens"]
        == 0
    )
    r = http.get("/flush_cache", headers={"Authorization": f"Bearer {ADMIN}"})  # SGLang's GET too
    assert r.status_code == 200


def test_queue_limits(http: httpx.Client, server: tuple[BackgroundServer, ServerState]) -> None:
    st = server[1]
    r = http.post("/generate", json={"text": ["x"] * 600, "sampling_params": {"n": 2}})
    assert error_of(r)["param"] == "text"  # more than max_queue at once: never admitted

    async def fill(delta: int) -> None:
        st.in_flight += delta

    in_loop(st, lambda: fill(st.config.max_queue))
    try:
        r = http.post("/generate", json={"text": "x"})
        err = error_of(r, 503)
        assert r.headers["retry-after"] == "1" and "capacity" in err["message"]
    finally:
        in_loop(st, lambda: fill(-st.config.max_queue))
    assert generate(http, text="x", sampling_params=GREEDY)["meta_info"]["completion_tokens"] == 8


def test_metrics_count_the_requests(
    http: httpx.Client, server: tuple[BackgroundServer, ServerState]
) -> None:
    def counts() -> dict[str, float]:
        return metric_values(http.get("/metrics").text)

    key = 'radixkv_requests_total{finish_reason="length"}'
    before = counts()
    generate(http, text=["m1", "m2"], sampling_params={**GREEDY, "n": 2})
    stream(http, text="m3", sampling_params=GREEDY)
    http.post("/generate", json={"text": 1})
    after = counts()
    assert after[key] - before.get(key, 0) == 5
    assert (
        after["radixkv_generation_tokens_total"] - before["radixkv_generation_tokens_total"] == 40
    )
    errors = 'radixkv_http_errors_total{status="400"}'
    assert after[errors] - before.get(errors, 0) == 1


def test_a_client_that_leaves_releases_everything(
    server: tuple[BackgroundServer, ServerState],
) -> None:
    srv, st = server
    body = {
        "text": unique("leave"),
        "sampling_params": {"max_new_tokens": None, "ignore_eos": True},  # to the context end
    }
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/generate", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")  # generating; then the client goes
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=srv.url, timeout=1.0) as c:
        c.post("/generate", json=body)
    assert_clean(st)  # both aborted: no lock, no private page, nothing in flight
    closed = metric_values(httpx.get(srv.url + "/metrics").text)
    assert closed['radixkv_client_closed_requests_total{phase="streaming"}'] >= 1
    assert closed['radixkv_client_closed_requests_total{phase="waiting"}'] >= 1


# ------------------------------------------------------------------ API keys and limits


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[BackgroundServer, ServerState]]:
    config = ServerConfig(api_keys={KEY: "alice"}, admin_key=ADMIN, max_body_bytes=1024)
    with live_server(config) as s:
        yield s


def test_api_keys_are_enforced(guarded: tuple[BackgroundServer, ServerState]) -> None:
    srv, st = guarded
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/generate", json={"text": "hi"})
        assert error_of(r, 401)["message"] and r.headers["www-authenticate"] == "Bearer"
        error_of(
            c.post(
                "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer wrong-key-000"}
            ),
            401,
        )
        for path in ("/get_model_info", "/get_server_info"):
            error_of(c.get(path), 401)
            assert c.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        # with keys, the probe that runs the engine needs one too (SGLang's needs none)
        error_of(c.get("/health_generate"), 401)
        assert (
            c.get("/health_generate", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        )
        error_of(c.post("/flush_cache", headers={"Authorization": f"Bearer {KEY}"}), 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        r = c.post("/generate", json={"text": "hi", "sampling_params": GREEDY}, headers=auth)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8
        r = c.post("/generate", json={"text": "x" * 2000}, headers=auth)
        assert "limit" in error_of(r, 413)["message"]  # the body limit
    assert_clean(st)


# ------------------------------------------------------------------ LoRA adapters


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BackgroundServer, ServerState]]:
    from engine_helpers import make_small_llama
    from lora_helpers import make_peft_adapter

    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.server.app import build_app

    folder = tmp_path_factory.mktemp("native-lora-base")
    hf, _ = make_small_llama(folder)
    adapter = tmp_path_factory.mktemp("native-lora") / "sql"
    make_peft_adapter(hf, adapter, seed=11)
    engine = AsyncEngine(str(folder), num_pages=256, lora_modules={"sql": str(adapter)})
    app = build_app(engine, ServerConfig(model_name="small-llama"), owns_engine=True)
    with BackgroundServer(app) as srv:
        yield srv, app.state.radixkv


def test_lora_path_names_a_loaded_adapter(
    lora_server: tuple[BackgroundServer, ServerState],
) -> None:
    srv, st = lora_server
    ids = [3 + (i * 104729) % 297 for i in range(20)]
    with httpx.Client(base_url=srv.url, timeout=60) as c:

        def via_openai(model: str) -> list[int]:
            body = {"model": model, "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 0}
            r = c.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
            return [
                int(t.removeprefix("token_id:"))
                for t in r.json()["choices"][0]["logprobs"]["tokens"]
            ]

        sp = {"max_new_tokens": 6, "temperature": 0}
        adapted = generate(c, input_ids=ids, sampling_params=sp, lora_path="sql")["output_ids"]
        base = generate(c, input_ids=ids, sampling_params=sp)["output_ids"]
        assert adapted == via_openai("sql") and base == via_openai("small-llama")
        assert adapted != base
        both = generate(c, input_ids=[ids, ids], sampling_params=sp, lora_path=["sql", None])
        assert [o["output_ids"] for o in both] == [adapted, base]
        assert (
            error_of(c.post("/generate", json={"input_ids": ids, "lora_path": "chat"}))["param"]
            == "lora_path"
        )
    assert_clean(st)
