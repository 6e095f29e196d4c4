"""Fair admission (schedule_policy.fair_order): waiting requests of different tenants
(``SamplingParams.tenant``) are interleaved, the tenant with the fewest running sequences
first, each tenant's in the schedule policy's order, none past ``tenant_max_running``; an
engine user who names no tenant is scheduled exactly as without fair admission.

The bound tested: with T tenants waiting and none running more than another, a tenant's k-th
waiting request is among the next T*k admissions, however many the others have queued (here a
tenant with 1,000 waiting and one with 3: the three are among the next 6 admissions)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest
from engine_helpers import make_small_llama

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.schedule_policy import fair_order, fcfs, lpm


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-fair"))[1]


@dataclass(eq=False)
class _Seq:
    name: str
    tenant: str | None


class _NoCache:
    enabled = False


def _queue(spec: list[tuple[str | None, int]]) -> deque[Any]:
    q: deque[Any] = deque()
    for tenant, n in spec:
        q.extend(_Seq(f"{tenant}{i}", tenant) for i in range(n))
    return q


def _names(order: list[Any]) -> list[str]:
    return [s.name for s in order]


def test_a_flood_cannot_push_another_tenant_back() -> None:
    q = _queue([("a", 1000), ("b", 3)])
    order = fair_order(q, _NoCache(), fcfs, {}, None)  # type: ignore[arg-type]
    # a's queue is cut to the policy's MAX_CANDIDATES, b's three interleave from the start
    assert _names(order[:7]) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]
    assert [s.tenant for s in order].count("a") == 128
    # without fair admission the policy sees b's behind a's thousand
    assert not any(s.tenant == "b" for s in fcfs(q, _NoCache()))  # type: ignore[arg-type]


def test_the_least_served_tenant_goes_first_and_caps_hold() -> None:
    q = _queue([("a", 10), ("b", 4), ("c", 2)])
    order = fair_order(q, _NoCache(), fcfs, {"a": 3, "b": 1}, None)  # type: ignore[arg-type]
    # c (0 running) catches up with b (1), both with a (3), then round robin, ties to the
    # tenant nearest the queue's head (a, then b, then c)
    assert _names(order[:8]) == ["c0", "b0", "c1", "b1", "a0", "b2", "a1", "b3"]
    capped = fair_order(q, _NoCache(), fcfs, {"a": 3, "b": 1}, 4)  # type: ignore[arg-type]
    assert [s.tenant for s in capped].count("a") == 1  # a runs 3, may run 4
    assert [s.tenant for s in capped].count("b") == 3
    assert [s.tenant for s in capped].count("c") == 2


def test_one_tenant_gets_the_policy_order_as_is() -> None:
    q = _queue([(None, 5)])
    assert fair_order(q, _NoCache(), lpm, {None: 2}, None) == lpm(q, _NoCache())  # type: ignore[arg-type]


def _params(tenant: str | None, max_tokens: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, tenant=tenant)


def _admission_order(eng: Engine, steps: int) -> list[str]:
    """Request ids in the order they were first scheduled, over ``steps`` steps (each runs a
    step after its admission: two tokens to generate)."""
    seen: dict[str, float] = {}
    for _ in range(steps):
        eng.step()
        eng.check_invariants()
        for s in eng.scheduler.running:
            t = s.group.metrics.first_scheduled_time
            assert t is not None
            seen.setdefault(s.group.request_id, t)
    return sorted(seen, key=lambda r: seen[r])


@pytest.mark.parametrize("fair", [True, False])
def test_engine_admits_the_other_tenant_within_the_bound(lm: Any, fair: bool) -> None:
    eng = Engine(lm, page_size=4, num_pages=600, max_running_requests=4, fair_admission=fair)
    for i in range(1000):
        eng.add_request([3 + i % 200, 5, 7, 9, 11], _params("a"), request_id=f"a{i}")
    for i in range(3):
        eng.add_request([4, 6, 8 + i, 10, 12], _params("b"), request_id=f"b{i}")
    order = _admission_order(eng, steps=12)
    first_b = [i for i, r in enumerate(order) if r.startswith("b")]
    if fair:
        assert len(first_b) == 3 and first_b[-1] < 6, order[:10]
    else:
        assert all(r.startswith("a") for r in order[:20]), order[:20]


def test_tenant_max_running_caps_a_tenant(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=600, max_running_requests=8, tenant_max_running=3)
    for i in range(10):
        eng.add_request([3 + i, 5, 7, 9], _params("a", 6))
    for i in range(2):
        eng.add_request([4 + i, 6, 8, 10], _params("b", 6))
    most = 0
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
        by = eng.scheduler.running_by_tenant()
        assert by.get("a", 0) <= 3 and by.get("b", 0) <= 3, by
        most = max(most, by.get("a", 0))
    assert most == 3
    assert eng.stats().locked_pages == 0


def test_an_engine_user_without_tenants_is_scheduled_as_before(lm: Any) -> None:
    prompts = [[3 + (5 * i + j) % 200 for j in range(6 + i % 5)] for i in range(12)]

    def run(fair: bool) -> tuple[list[str], list[list[int]]]:
        eng = Engine(lm, page_size=4, num_pages=600, max_running_requests=3, fair_admission=fair)
        ids = [eng.add_request(p, _params(None, 5)) for p in prompts]
        finished: list[str] = []
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    finished.append(o.request_id)
                    tokens[o.request_id] = o.outputs[0].token_ids
        return finished, [tokens[r] for r in ids]

    assert run(True) == run(False)
