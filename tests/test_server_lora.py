"""LoRA adapters through the HTTP server: ``model`` names an adapter (completions, chat,
streaming, tokenize), outputs equal PEFT's greedy reference, base and adapters served at once,
each adapter's KV cached apart from the base model's, ``/v1/models`` lists them as vLLM does,
and vLLM's runtime load/unload routes (off by default; 400/404 naming what is wrong)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
import zmq
from _model_hf_builders import EOS_ID
from engine_helpers import make_small_llama
from hypothesis import HealthCheck, given, settings
from lora_helpers import ATTN, make_peft_adapter, peft_greedy
from schemathesis import checks as C
from server_helpers import assert_clean, in_loop, live_server, wait_drained

from radixkv.cache.hashing import page_hashes
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.lora import AdapterNamespace
from radixkv.server import add_serve_arguments, build_from_args
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer
from radixkv.server.cli import RUNTIME_LORA_ENV
from radixkv.server.config import ServerConfig
from radixkv.server.kv_events import END_SEQ, BlockStored, decode_batch
from radixkv.server.state import ServerState

BASE = "small-llama"
KEY = "lora-test-key-0001"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW = 6  # generated tokens per request: enough for adapters to diverge, cheap on a CPU
PAGE = 16


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(transformers model, its saved folder): the small random Llama every server loads."""
    folder = tmp_path_factory.mktemp("lora-base")
    hf, _ = make_small_llama(folder)
    return hf, folder


@pytest.fixture(scope="module")
def adapters(base: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """name -> (folder, PEFT reference): ``sql`` adapts every linear layer, ``chat`` attention
    only at another rank, ``extra`` is loaded at runtime by the tests."""
    hf, _ = base
    root = tmp_path_factory.mktemp("adapters")
    specs: dict[str, dict[str, Any]] = {
        "sql": dict(seed=11),
        "chat": dict(seed=12, r=4, target_modules=ATTN),
        "extra": dict(seed=13, r=2),
    }
    return {n: (root / n, make_peft_adapter(hf, root / n, **kw)) for n, kw in specs.items()}


@pytest.fixture(scope="module")
def server(
    base: tuple[Any, Path], adapters: dict[str, Any]
) -> Iterator[tuple[BackgroundServer, ServerState]]:
    """``sql`` and ``chat`` loaded at start; runtime loading on; one API key."""
    engine = AsyncEngine(
        str(base[1]),
        num_pages=512,
        lora_modules={n: str(adapters[n][0]) for n in ("sql", "chat")},
    )
    config = ServerConfig(
        model_name=BASE, api_keys={KEY: "alice"}, allow_runtime_lora_updating=True
    )
    app = build_app(engine, config, owns_engine=True)
    with BackgroundServer(app) as srv:
        yield srv, app.state.radixkv


@pytest.fixture(scope="module")
def http(server: tuple[BackgroundServer, ServerState]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0].url, headers=AUTH, timeout=60) as c:
        yield c


def _ids(seed: int, n: int) -> list[int]:
    """A prompt of ``n`` token ids (3..300: no special tokens), different for each seed."""
    return [3 + (seed * 7919 + i * 104729) % 297 for i in range(n)]


def _want(model: str, adapters: dict[str, Any], base: tuple[Any, Path]) -> Any:
    """The transformers/PEFT model that is the reference for the served ``model``."""
    return base[0] if model == BASE else adapters[model][1]


def _tokens(logprob_tokens: list[str]) -> list[int]:
    """Token ids from ``return_tokens_as_token_ids`` logprob entries (``token_id:N``)."""
    assert all(t.startswith("token_id:") for t in logprob_tokens), logprob_tokens
    return [int(t.removeprefix("token_id:")) for t in logprob_tokens]


def _complete(http: httpx.Client, model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == model  # the response names the model the client asked for
    return out


def _completion_tokens(out: dict[str, Any]) -> list[int]:
    return _tokens(out["choices"][0]["logprobs"]["tokens"])


def _cached(out: dict[str, Any]) -> int:
    return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def _err(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]


# ------------------------------------------------------------------ model selection


def test_models_lists_the_base_model_and_adapters(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client, adapters: dict[str, Any]
) -> None:
    cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [BASE, "sql", "chat"]
    base_card = cards[0]
    assert base_card["root"] == BASE and base_card["parent"] is None
    assert base_card["max_model_len"] == server[1].max_context
    for card in cards[1:]:
        assert card["root"] == str(adapters[card["id"]][0]) and card["parent"] == BASE
        assert card["object"] == "model" and card["owned_by"] == "radixkv"
    # the openai client parses the same list
    with openai.OpenAI(
        base_url=server[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60
    ) as client:
        assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]
    assert httpx.get(server[0].url + "/v1/models").status_code == 401  # auth as everywhere


def test_completions_per_model_match_peft(
    http: httpx.Client, adapters: dict[str, Any], base: tuple[Any, Path]
) -> None:
    prompt = _ids(1, 21)
    got = {m: _completion_tokens(_complete(http, m, prompt)) for m in (BASE, "sql", "chat")}
    for model, tokens in got.items():
        assert tokens == peft_greedy(_want(model, adapters, base), prompt, NEW, EOS_ID), model
    # the adapters change the output (else the comparisons above prove nothing)
    assert len({tuple(t) for t in got.values()}) == 3


def test_chat_and_tokenize_with_an_adapter(
    http: httpx.Client, adapters: dict[str, Any], base: tuple[Any, Path]
) -> None:
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    r = http.post("/tokenize", json={"model": "sql", "messages": messages})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert (
        ids == http.post("/tokenize", json={"model": BASE, "messages": messages}).json()["tokens"]
    )  # the adapter shares the base model's tokenizer and template
    body = {
        "model": "sql",
        "messages": messages,
        "max_tokens": NEW,
        "temperature": 0,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == "sql"
    tokens = _tokens([e["token"] for e in out["choices"][0]["logprobs"]["content"]])
    assert tokens == peft_greedy(adapters["sql"][1], ids, NEW, EOS_ID)
    text = http.post("/detokenize", json={"model": "sql", "tokens": tokens})
    assert text.status_code == 200 and text.json()["prompt"].startswith(
        out["choices"][0]["message"]["content"]
    )


def test_base_and_two_adapters_at_once(
    server: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    adapters: dict[str, Any],
    base: tuple[Any, Path],
) -> None:
    """Requests for the base model and both adapters in flight together: each gets its own
    model's tokens."""
    jobs = [(m, _ids(100 + i, 9 + 4 * i)) for i, m in enumerate([BASE, "sql", "chat"] * 3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: _complete(http, *job), jobs))
    for (model, prompt), out in zip(jobs, outs):
        want = peft_greedy(_want(model, adapters, base), prompt, NEW, EOS_ID)
        assert _completion_tokens(out) == want, model
    assert_clean(server[1])


def test_adapter_requests_cache_apart_from_the_base_model(
    server: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    adapters: dict[str, Any],
    base: tuple[Any, Path],
) -> None:
    prompt = _ids(7, 3 * PAGE + 5)
    full = 3 * PAGE  # the prompt's whole pages: what a repeat can reuse
    first = _complete(http, BASE, prompt)
    assert _cached(first) == 0
    assert _cached(_complete(http, BASE, prompt)) == full  # the base model's entries exist
    want = peft_greedy(adapters["sql"][1], prompt, NEW, EOS_ID)
    sql = _complete(http, "sql", prompt)
    assert _cached(sql) == 0  # the base model's KV is not the adapter's
    assert _completion_tokens(sql) == want
    again = _complete(http, "sql", prompt)
    assert _cached(again) >= full and _completion_tokens(again) == want
    chat = _complete(http, "chat", prompt)
    assert _cached(chat) == 0  # nor is another adapter's
    assert _completion_tokens(chat) == peft_greedy(adapters["chat"][1], prompt, NEW, EOS_ID)
    # the cache keys the adapters' entries by content digest, within the tenant's namespace
    core = server[1].engine.engine
    digests = {i.name: i.digest for i in core.list_loras()}
    spaces = in_loop(server[1], lambda: _namespaces(server[1]))
    adapter_spaces = {ns.adapter for ns in spaces if isinstance(ns, AdapterNamespace)}
    assert {digests["sql"], digests["chat"]} <= adapter_spaces


def test_kv_events_name_the_adapter_whose_kv_the_blocks_hold(
    base: tuple[Any, Path], adapters: dict[str, Any]
) -> None:
    """An adapter's BlockStored events carry its lora_id (its slot) and lora_name, the base
    model's carry None for both; the hashes stay the adapter namespace's."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = AsyncEngine(str(base[1]), num_pages=256, lora_modules={"sql": str(adapters["sql"][0])})
    endpoint = f"tcp://127.0.0.1:{port}"
    config = ServerConfig(model_name=BASE, kv_events="tcp://127.0.0.1:0", kv_events_replay=endpoint)
    app = build_app(engine, config, owns_engine=True)
    prompts = {BASE: _ids(21, 2 * PAGE + 3), "sql": _ids(22, 2 * PAGE + 5)}
    ctx = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    try:
        with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            for model, prompt in prompts.items():
                _complete(http, model, prompt)
            st = app.state.radixkv
            wait_drained(st)
            info = next(i for i in st.engine.list_loras() if i.name == "sql")
            replay.connect(endpoint)
            deadline = time.monotonic() + 10
            pub = st.publisher
            assert pub is not None
            events: list[BlockStored] = []
            while not events and time.monotonic() < deadline:  # until the publisher has sent
                time.sleep(0.05)
                replay.send_multipart([b"", (0).to_bytes(8, "big")])
                while True:
                    assert replay.poll(5000), "replay timed out"
                    _, seq_b, payload = replay.recv_multipart()
                    if seq_b == END_SEQ:
                        break
                    events += [
                        e for e in decode_batch(payload).events if isinstance(e, BlockStored)
                    ]
    finally:
        replay.close(linger=0)
        ctx.term()
    by_model: dict[str, list[int]] = {BASE: [], "sql": []}
    for e in events:
        if e.lora_name is None:
            assert e.lora_id is None
            by_model[BASE] += e.token_ids
        else:
            assert (e.lora_id, e.lora_name) == (info.slot, "sql")
            by_model["sql"] += e.token_ids
    for model, prompt in prompts.items():  # each prompt's full pages, under its own model
        assert by_model[model][: 2 * PAGE] == prompt[: 2 * PAGE], model
    ns = AdapterNamespace(info.digest, None)
    sql_hashes = {h for e in events if e.lora_name for h in e.block_hashes}
    assert set(page_hashes(prompts["sql"][: 2 * PAGE], PAGE, ns)) <= sql_hashes


async def _namespaces(st: ServerState) -> list[Any]:
    return list(st.engine.engine.cache.namespaces)


def test_streaming_with_an_adapter(
    http: httpx.Client, adapters: dict[str, Any], base: tuple[Any, Path]
) -> None:
    prompt = _ids(3, 17)
    body = {
        "model": "chat",
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens: list[int] = []
    usage = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        assert chunk["model"] == "chat"
        for choice in chunk["choices"]:
            if choice.get("logprobs"):
                tokens += _tokens(choice["logprobs"]["tokens"])
        usage = chunk.get("usage") or usage
    assert tokens == peft_greedy(adapters["chat"][1], prompt, NEW, EOS_ID)
    assert usage is not None and usage["completion_tokens"] == len(tokens)


def test_unknown_model_is_404_naming_the_served_ones(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [5]}),
    ):
        r = http.post(path, json={"model": "sq", **body})
        assert r.status_code == 404, (path, r.text)
        err = _err(r)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        for name in (BASE, "sql", "chat"):
            assert f"`{name}`" in err["message"], err["message"]


# ------------------------------------------------------------------ runtime load / unload


def test_load_use_unload_an_adapter(
    server: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    adapters: dict[str, Any],
    base: tuple[Any, Path],
) -> None:
    folder, ref = adapters["extra"]
    prompt = _ids(5, 2 * PAGE + 3)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert r.text == "Success: LoRA adapter 'extra' added successfully."  # vLLM's words
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["extra"]["root"] == str(folder) and cards["extra"]["parent"] == BASE
    want = peft_greedy(ref, prompt, NEW, EOS_ID)
    assert _completion_tokens(_complete(http, "extra", prompt)) == want
    assert _cached(_complete(http, "extra", prompt)) == 2 * PAGE  # cached under the adapter

    # a second load of the name is refused whatever the path
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": "/x"})
    assert r.status_code == 400 and _err(r)["param"] == "lora_name"
    assert "'extra' has already been loaded" in _err(r)["message"]

    digest = next(i.digest for i in server[1].engine.list_loras() if i.name == "extra")
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'extra' removed successfully."
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [BASE, "sql", "chat"]
    r = http.post("/v1/completions", json={"model": "extra", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 404 and _err(r)["code"] == "model_not_found"
    # its cached KV went with it
    spaces = in_loop(server[1], lambda: _namespaces(server[1]))
    assert not any(isinstance(ns, AdapterNamespace) and ns.adapter == digest for ns in spaces)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert r.status_code == 404 and _err(r)["code"] == "lora_not_found"
    assert "'extra' cannot be found" in _err(r)["message"] and "'sql'" in _err(r)["message"]

    # loaded again (same files: same digest), it serves the same tokens, from a cold cache
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    out = _complete(http, "extra", prompt)
    assert _completion_tokens(out) == want and _cached(out) == 0
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert_clean(server[1])


def test_bad_load_requests_are_400_naming_the_problem(
    http: httpx.Client, adapters: dict[str, Any], tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere"
    not_adapter = tmp_path / "empty"
    not_adapter.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_bytes(
        (adapters["sql"][0] / "adapter_config.json").read_bytes()
    )
    cases = [
        ({"lora_name": "x", "lora_path": str(missing)}, "lora_path", str(missing)),
        (
            {"lora_name": "x", "lora_path": str(not_adapter)},
            "lora_path",
            str(not_adapter / "adapter_config.json"),
        ),
        (
            {"lora_name": "x", "lora_path": str(broken)},
            "lora_path",
            str(broken / "adapter_config.json"),
        ),
        (
            {"lora_name": "x", "lora_path": str(no_weights)},
            "lora_path",
            str(no_weights / "adapter_model.safetensors"),
        ),
        ({"lora_name": "x", "lora_path": ""}, "lora_path", "lora_path"),
        ({"lora_name": "x"}, "lora_path", "lora_path"),
        ({"lora_path": str(adapters["sql"][0])}, "lora_name", "lora_name"),
        ({"lora_name": " x", "lora_path": str(adapters["sql"][0])}, "lora_name", "' x'"),
        ({"lora_name": BASE, "lora_path": str(adapters["sql"][0])}, "lora_name", BASE),
        ({"lora_name": "sql", "lora_path": str(adapters["chat"][0])}, "lora_name", "sql"),
    ]
    for body, param, named in cases:
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400, (body, r.text)
        assert _err(r)["param"] == param, (body, r.text)
        assert named in _err(r)["message"], (body, r.text)
    # nothing was loaded, and the name already taken still serves its own adapter
    assert [c["id"] for c in http.get("/v1/models").json()["data"]] == [BASE, "sql", "chat"]
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards["sql"]["root"] == str(adapters["sql"][0])
    r = http.post("/v1/unload_lora_adapter", json={})
    assert r.status_code == 400 and _err(r)["param"] == "lora_name"


def test_unload_while_in_use_is_400_and_serving_goes_on(
    server: tuple[BackgroundServer, ServerState],
    http: httpx.Client,
    adapters: dict[str, Any],
    base: tuple[Any, Path],
) -> None:
    folder, ref = adapters["extra"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    prompt = _ids(9, 11)
    long = 300  # steps enough that the request is still running when the unload arrives
    body = {
        "model": "extra",
        "prompt": prompt,
        "max_tokens": long,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["model"] == "extra"
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
        assert r.status_code == 400, r.text
        assert _err(r)["param"] == "lora_name" and "'extra' is in use" in _err(r)["message"]
        # vLLM's lora_requests_info names the adapter in use
        text = http.get("/metrics").text
        info = next(ln for ln in text.splitlines() if ln.startswith("radixkv_lora_requests_info{"))
        assert 'running_lora_adapters="extra"' in info, info
        # everyone else is served meanwhile, the adapter included
        short = _complete(http, "extra", prompt)
        assert _completion_tokens(short) == peft_greedy(ref, prompt, NEW, EOS_ID)
        assert _complete(http, BASE, prompt)["choices"][0]["finish_reason"] is not None
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [
        c["finish_reason"]
        for ln in rest[:-1]
        for c in json.loads(ln.removeprefix("data: "))["choices"]
        if c.get("finish_reason")
    ]
    assert finish == ["length"]  # the long request ran to its end
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
    assert_clean(server[1])


def test_runtime_routes_need_the_key(server: tuple[BackgroundServer, ServerState]) -> None:
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
        ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ):
        r = httpx.post(server[0].url + path, json=body)
        assert r.status_code == 401, (path, r.text)
    assert "sql" in server[1].lora_names()


def test_runtime_routes_are_off_by_default(adapters: dict[str, Any]) -> None:
    with live_server(ServerConfig()) as (srv, st):
        for path, body in (
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"][0])}),
            ("/v1/unload_lora_adapter", {"lora_name": "x"}),
        ):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 404, (path, r.text)
        doc = httpx.get(srv.url + "/openapi.json").json()
        assert not any("lora" in p for p in doc["paths"])
        assert st.lora_names() == []


def test_adapter_named_like_the_base_model_is_refused(
    base: tuple[Any, Path], adapters: dict[str, Any]
) -> None:
    import asyncio

    engine = AsyncEngine(str(base[1]), num_pages=64, lora_modules={BASE: str(adapters["sql"][0])})
    try:
        with pytest.raises(ValueError, match="served model's name"):
            build_app(engine, ServerConfig(model_name=BASE))
    finally:
        asyncio.run(engine.shutdown())


# ------------------------------------------------------------------ flags and OpenAPI


def test_serve_flags(
    base: tuple[Any, Path], adapters: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def parse(*argv: str) -> Any:
        import argparse

        return add_serve_arguments(argparse.ArgumentParser()).parse_args(list(argv))

    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    assert parse().allow_runtime_lora_updating is False
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    assert parse().allow_runtime_lora_updating is True
    monkeypatch.setenv(RUNTIME_LORA_ENV, "0")
    args = parse(
        "--model", str(base[1]), "--served-model-name", BASE, "--num-pages", "64",
        "--lora-modules", f"sql={adapters['sql'][0]}", "--allow-runtime-lora-updating",
    )  # fmt: skip
    app, config = build_from_args(args)
    assert config.allow_runtime_lora_updating
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [BASE, "sql"]
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert r.status_code == 200, r.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [BASE]


def test_openapi_documents_the_runtime_routes(
    server: tuple[BackgroundServer, ServerState], http: httpx.Client
) -> None:
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, request in (
        ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
        ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest"),
    ):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + request)
        assert "text/plain" in op["responses"]["200"]["content"]
        assert {"400", "401"} <= set(op["responses"])
    assert set(schemas["LoadLoRAAdapterRequest"]["required"]) == {"lora_name", "lora_path"}
    assert doc["paths"]["/v1/unload_lora_adapter"]["post"]["responses"]["404"]
    card = schemas["ModelCard"]["properties"]
    assert {"root", "parent", "max_model_len"} <= set(card)


FUZZ_CHECKS = [
    C.not_a_server_error,
    C.status_code_conformance,
    C.content_type_conformance,
    C.response_schema_conformance,
]


def _fuzz(op: Any, mode: Any, url: str, statuses: dict[tuple[str, int], int]) -> None:
    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=op.as_strategy(mode))
    def run(case: Any) -> None:
        response = case.call(base_url=url, timeout=60)
        key = (op.label, response.status_code)
        statuses[key] = statuses.get(key, 0) + 1
        case.validate_response(response, checks=FUZZ_CHECKS)

    run()


def test_schemathesis_on_the_runtime_routes() -> None:
    """Generated requests, schema-valid and not, against the two routes: no 5xx, and every
    answer as documented. (Its own server: a generated name could unload an adapter the other
    tests use.)"""
    statuses: dict[tuple[str, int], int] = {}
    with live_server(ServerConfig(allow_runtime_lora_updating=True)) as (srv, st):
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        for result in schema.get_all_operations():
            op = result.ok()
            if "lora" in op.label:
                _fuzz(op, schemathesis.GenerationMode.POSITIVE, srv.url, statuses)
                _fuzz(op, schemathesis.GenerationMode.NEGATIVE, srv.url, statuses)
        assert st.lora_names() == []  # no generated path was an adapter folder
        assert_clean(st)
    print(f"schemathesis on the LoRA routes: {sorted(statuses.items())}")
    assert not any(status >= 500 for _, status in statuses)
    assert statuses.get(("POST /v1/load_lora_adapter", 400), 0) > 0
    assert statuses.get(("POST /v1/unload_lora_adapter", 404), 0) > 0
