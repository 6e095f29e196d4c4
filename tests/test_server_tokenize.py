"""POST /tokenize and /detokenize (vLLM's): the ids the server would run, and back to text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, live_server

from radixkv.model.tokenizer import encode_chat
from radixkv.server.config import ServerConfig

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[httpx.Client, Any]]:
    with live_server() as (srv, st), httpx.Client(base_url=srv.url, timeout=30) as http:
        yield http, st


def test_tokenize_a_prompt_as_completions_encodes_it(server: tuple[httpx.Client, Any]) -> None:
    http, st = server
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "def f(x):"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == st.tokenizer.encode("def f(x):")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == st.max_context
    assert body["token_strs"] is None
    # what /v1/completions runs for the same text: its usage counts the same tokens
    done = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "def f(x):", "max_tokens": 1}
    )
    assert done.json()["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_messages_as_chat_completions_renders_them(
    server: tuple[httpx.Client, Any],
) -> None:
    http, st = server
    r = http.post("/tokenize", json={"model": MODEL, "messages": CHAT, "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == encode_chat(st.tokenizer, CHAT)
    assert "".join(body["token_strs"]) == st.tokenizer.decode(body["tokens"])
    chat = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}
    )
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_round_trip(server: tuple[httpx.Client, Any]) -> None:
    http, _ = server
    ids = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()["tokens"]
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200
    text = r.json()["prompt"]
    assert "Be brief." in text and "hi there" in text
    assert http.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/tokenize", {"model": MODEL}, 400, "prompt", "exactly one"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "messages": CHAT}, 400, "prompt", "exactly"),
        ("/tokenize", {"model": MODEL, "prompt": ""}, 400, "prompt", "length >= 1"),
        ("/tokenize", {"model": MODEL, "prompt": "a", "tools": [{}]}, 400, "tools", "messages"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model", "does not exist"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 10**6]}, 400, "tokens", "vocabulary"),
        ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens[0]", ">= 0"),
        ("/detokenize", {"model": MODEL}, 400, "tokens", "tokens"),
    ],
)
def test_bad_requests_name_the_problem(
    server: tuple[httpx.Client, Any],
    path: str,
    body: dict[str, Any],
    status: int,
    param: str,
    message: str,
) -> None:
    http, _ = server
    r = http.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_api_keys_guard_them(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-tenant-a": "tenant-a"}))
    from radixkv.server.auth import load_api_keys

    config = ServerConfig(api_keys=load_api_keys(str(keys)))
    with live_server(config) as (srv, _), httpx.Client(base_url=srv.url, timeout=30) as http:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert http.post(path, json={"model": MODEL, **body}).status_code == 401
            ok = http.post(
                path, json={"model": MODEL, **body}, headers={"Authorization": "Bearer sk-tenant-a"}
            )
            assert ok.status_code == 200
