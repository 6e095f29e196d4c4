"""``schedule_policy="priority"`` (``SamplingParams.priority``, lower first, as vLLM's): waiting
requests are admitted by priority, a more urgent arrival preempts running requests of a lower
priority for a running slot or for pages, preempted requests resume with the same output, and
every step keeps the running list in priority order and every page accounted for."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import make_small_llama

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-priority"))[1]


def _params(priority: int, max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def _run(eng: Engine, rids: list[str]) -> tuple[list[str], dict[str, list[int]]]:
    """Step to the end, checking invariants; (finish order, tokens by id)."""
    order, tokens = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(o.request_id)
                tokens[o.request_id] = o.outputs[0].token_ids
        eng.check_invariants()
    assert eng.stats().locked_pages == 0
    return order, {r: tokens[r] for r in rids}


def _prompt(i: int) -> list[int]:
    return [3 + (7 * i + j) % 250 for j in range(12 + i)]


def test_urgent_arrival_takes_a_running_slot(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=400, schedule_policy="priority", max_running_requests=2)
    low = [eng.add_request(_prompt(i), _params(5)) for i in range(3)]
    for _ in range(3):
        eng.step()
    high = eng.add_request(_prompt(9), _params(0, max_tokens=8))
    order, tokens = _run(eng, [*low, high])
    assert order[0] == high  # it did not wait for the two running low-priority requests
    assert eng.stats().num_preemptions >= 1
    ref = Engine(lm, page_size=4, num_pages=400)  # same requests, no contention
    for i, rid in enumerate(low):
        (o,) = ref.generate([_prompt(i)], _params(0), use_tqdm=False)
        assert tokens[rid] == o.outputs[0].token_ids  # the preempted one resumed exactly


def test_urgent_arrival_takes_pages(lm: Any) -> None:
    """Slots are plenty but the pool is not: running low-priority requests give their pages."""
    eng = Engine(lm, page_size=4, num_pages=40, schedule_policy="priority", max_prefill_tokens=64)
    low = [eng.add_request(_prompt(i), _params(3, max_tokens=60)) for i in range(3)]
    for _ in range(25):
        eng.step()
    assert eng.stats().kv_pages_free < 15  # the urgent prompt needs 15 pages
    high = eng.add_request(_prompt(7) * 3, _params(-1, max_tokens=10))
    before = eng.stats().num_preemptions
    order, _ = _run(eng, [*low, high])
    assert order[0] == high and eng.stats().num_preemptions > before


def test_queue_is_admitted_by_priority_then_arrival(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=400, schedule_policy="priority", max_running_requests=1)
    prios = [3, 1, 2, 1, 0, 3]
    rids = [eng.add_request(_prompt(i), _params(p, max_tokens=4)) for i, p in enumerate(prios)]
    order, _ = _run(eng, rids)
    expected = [r for _, _, r in sorted(zip(prios, range(len(rids)), rids))]
    assert order == expected


def test_priority_needs_the_priority_policy(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=100)
    with pytest.raises(ValueError, match="priority=2 needs schedule_policy='priority'"):
        eng.add_request([5, 6, 7], _params(2))
    assert not eng.has_unfinished()
    eng.add_request([5, 6, 7], _params(0))  # 0 is every request's priority elsewhere
    for bad in (1.5, "1", True, None):
        with pytest.raises(ValueError, match="priority must be an int"):
            SamplingParams(priority=bad)  # type: ignore[arg-type]


def test_server_takes_priority_only_under_the_priority_policy() -> None:
    """``priority`` on /v1/completions: accepted by a server started with the priority policy,
    a 400 naming it elsewhere (and that server goes on serving)."""
    import httpx
    from server_helpers import assert_clean, live_server

    body = {"model": "radixkv-tiny", "prompt": "def f():", "max_tokens": 4, "priority": -3}
    with live_server(schedule_policy="priority") as (srv, st):
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert_clean(st)
    with live_server() as (srv, st):
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert r.json()["error"]["message"] == (  # the engine's check, in the server's words
            "priority=-3 needs the server started with --schedule-policy priority; under the "
            "other policies it must be 0"
        )
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "priority": 0}, timeout=60)
        assert ok.status_code == 200
        assert_clean(st)
