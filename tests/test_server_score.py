"""``POST /v1/score`` (SGLang's scoring API): each item's label probabilities after the query,
the same numbers as ``Engine.score`` on the same engine, the query served from the prefix cache,
400s naming the field before anything runs, and a clean engine however a request ends."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import (
    MODEL,
    assert_clean,
    failing_forward,
    in_loop,
    live_server,
    wait_drained,
)

from radixkv.server.background import BackgroundServer
from radixkv.server.state import ServerState

QUERY = "def is_even(n):\n    return n % 2 == 0\n\n# is_even(4) -> "
ITEMS = ["True", "False", " 7", "None"]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[BackgroundServer, ServerState]]:
    with live_server(page_size=16) as s:
        yield s


def post(server: tuple[BackgroundServer, ServerState], body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server[0].url + "/v1/score", json=body, timeout=60)


def labels(st: ServerState) -> list[int]:
    return [st.tokenizer.encode(c)[-1] for c in ("T", "F", "N")]


def engine_scores(st: ServerState, query: Any, items: Any, labs: list[int], **kw: Any) -> Any:
    """Engine.score on the server's own engine, run in its loop once it is idle (no step
    runs meanwhile)."""
    wait_drained(st)

    async def run() -> Any:
        return st.engine.engine.score(query, items, labs, **kw)

    return in_loop(st, run)


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_scores_are_the_engines(
    server: tuple[BackgroundServer, ServerState], apply_softmax: bool, item_first: bool
) -> None:
    _, st = server
    labs = labels(st)
    r = post(
        server,
        {
            "model": MODEL,
            "query": QUERY,
            "items": ITEMS,
            "label_token_ids": labs,
            "apply_softmax": apply_softmax,
            "item_first": item_first,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["model"] == MODEL
    want = engine_scores(st, QUERY, ITEMS, labs, apply_softmax=apply_softmax, item_first=item_first)
    assert len(body["scores"]) == len(ITEMS)
    for got, w in zip(body["scores"], want):
        assert got == pytest.approx(w, rel=1e-4)
        if apply_softmax:
            assert math.fsum(got) == pytest.approx(1.0, abs=1e-9)
        else:
            assert all(0.0 < p < 1.0 for p in got)
    prompts = [it + QUERY if item_first else QUERY + it for it in ITEMS]
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(len(st.tokenizer.encode(p)) for p in prompts)
    assert usage["completion_tokens"] == len(ITEMS)
    if not item_first:  # the query's pages come from the cache for all but the first item
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16 * (len(ITEMS) - 1)
    assert_clean(st)


def test_token_ids_and_one_text_item(server: tuple[BackgroundServer, ServerState]) -> None:
    _, st = server
    labs = labels(st)
    q = st.tokenizer.encode(QUERY)
    items = [st.tokenizer.encode(it, add_special_tokens=False) for it in ITEMS[:2]]
    r = post(server, {"model": MODEL, "query": q, "items": items, "label_token_ids": labs})
    assert r.status_code == 200, r.text
    for got, want in zip(r.json()["scores"], engine_scores(st, q, items, labs), strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    one = post(server, {"model": MODEL, "query": QUERY, "items": "True", "label_token_ids": labs})
    assert one.status_code == 200 and len(one.json()["scores"]) == 1
    assert one.json()["scores"][0] == pytest.approx(
        engine_scores(st, QUERY, ["True"], labs)[0], rel=1e-4
    )
    assert_clean(st)


BAD: list[tuple[dict[str, Any], int, str | None, str]] = [
    ({"items": ["a", [1, 2]]}, 400, "items", "texts when the query is text"),
    ({"query": [1, 2], "items": ["a"]}, 400, "items", "token-id lists when it is token ids"),
    ({"items": []}, 400, "items", ""),
    ({"label_token_ids": []}, 400, "label_token_ids", ""),
    ({"label_token_ids": [5, 5]}, 400, "label_token_ids", "repeated"),
    ({"label_token_ids": [10**7]}, 400, "label_token_ids", "vocabulary"),
    ({"label_token_ids": [-1]}, 400, "label_token_ids[0]", ">= 0"),
    ({"query": [1, 10**7], "items": [[3]]}, 400, "items", "vocabulary"),
    ({"items": ["x" * 20000]}, 400, "items", "maximum context length"),
    ({"model": "nope"}, 404, "model", "does not exist"),
    ({"query": None}, 400, "query", ""),
]


@pytest.mark.parametrize(("patch", "status", "param", "msg"), BAD)
def test_bad_requests_name_the_field_and_run_nothing(
    server: tuple[BackgroundServer, ServerState],
    patch: dict[str, Any],
    status: int,
    param: str | None,
    msg: str,
) -> None:
    _, st = server
    before = in_loop(st, st.engine.stats).num_requests
    body = {"model": MODEL, "query": QUERY, "items": ITEMS, "label_token_ids": [5, 6], **patch}
    r = post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and msg in err["message"], err
    assert in_loop(st, st.engine.stats).num_requests == before
    assert_clean(st)


def test_an_engine_failure_is_a_500_and_leaves_it_clean(
    server: tuple[BackgroundServer, ServerState],
) -> None:
    _, st = server
    body = {"model": MODEL, "query": QUERY + "x", "items": ITEMS, "label_token_ids": [5, 6]}
    with failing_forward(st):
        r = post(server, body)
    assert r.status_code == 500 and "injected forward failure" in r.text
    assert_clean(st)
    again = post(server, body)  # and the next request is served
    assert again.status_code == 200 and len(again.json()["scores"]) == len(ITEMS)


def test_a_client_that_leaves_releases_everything(
    server: tuple[BackgroundServer, ServerState],
) -> None:
    """The client stops waiting: every item still running is aborted, nothing is held."""
    _, st = server
    before = in_loop(st, st.engine.stats).num_aborted
    items = [f"# item {i}: " + "x = 1\n" * 60 for i in range(48)]
    body = {"model": MODEL, "query": QUERY * 4, "items": items, "label_token_ids": [5, 6]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server[0].url + "/v1/score", json=body, timeout=0.3)
    assert_clean(st)
    assert in_loop(st, st.engine.stats).num_aborted > before
