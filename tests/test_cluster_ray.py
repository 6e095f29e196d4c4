"""radixkv on Ray Serve: 4 radixkv-tiny replicas behind RadixAffinityRouter vs Ray's default.

One Ray session for the module (start-up dominates): two fleets of 4 replicas each (a fraction
of a CPU apiece), one routed by RadixAffinityRouter, one by Ray Serve's default router, both
behind the cluster's ingress on a loopback HTTP port. Tests run in file order: hit rate on a
shared-prefix workload, a hot prefix spreading once the load thresholds trip, a prefix-cache
reset through the ingress reaching every replica, a weight update reaching every replica, then a
replica killed mid-run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from engine_helpers import save_tiny_folder

from radixkv.cluster.readiness import app_state, wait_until_running
from radixkv.cluster.workload import Item, SharedPrefixWorkload, fleet_hit_rate, run_workload

REPLICAS = 4
PAGE = 16
AFFINITY, DEFAULT = "aff", "dflt"
ADMIN = "cluster-admin-key"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    # No warning filters: Ray's import-time pydantic deprecations are silenced narrowly by
    # radixkv.cluster._ray.import_serve, and nothing else warns.
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fleets() -> Iterator[dict[str, str]]:
    from radixkv.cluster._ray import import_serve

    serve = import_serve()
    from radixkv.cluster.app import ClusterConfig, build_cluster_app

    root = str(Path(__file__).resolve().parents[1])
    ray.init(
        address="local",  # always a fresh local cluster, never one named by RAY_ADDRESS
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
                "OMP_NUM_THREADS": "1",
            }
        },
    )
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        common: dict[str, Any] = {
            "replicas": REPLICAS,
            "engine_kwargs": {"page_size": PAGE, "num_pages": 512},
            "replica_num_cpus": 0.4,  # 8 x 0.4 + 2 x 0.1 ingress fit in num_cpus=4
            "ingress_num_cpus": 0.1,
            "stats_period_s": 1.0,
            "server_kwargs": {"admin_key": ADMIN},
        }
        aff = ClusterConfig(router="affinity", router_kwargs={"imbalance_abs": 4}, **common)
        dflt = ClusterConfig(router="default", **common)
        serve.run_many(
            [
                serve.RunTarget(build_cluster_app(aff), name=AFFINITY, route_prefix="/aff"),
                serve.RunTarget(build_cluster_app(dflt), name=DEFAULT, route_prefix="/dflt"),
            ],
            wait_for_applications_running=False,
        )
        for app in (AFFINITY, DEFAULT):
            wait_until_running(
                lambda app=app: app_state(serve.status(), app), app_name=app, timeout_s=240
            )
        base = f"http://127.0.0.1:{port}"
        yield {AFFINITY: f"{base}/aff", DEFAULT: f"{base}/dflt"}
    finally:
        serve.shutdown()
        ray.shutdown()


def _serve() -> Any:
    from radixkv.cluster._ray import import_serve

    return import_serve()


def _router_view(app: str, *, settle_s: float = 10.0) -> dict[str, dict[str, int]]:
    """The ingress's affinity router state, once its in-flight counts have settled to zero
    (completion callbacks arrive asynchronously) or after ``settle_s``."""
    serve = _serve()
    deadline = time.monotonic() + settle_s
    while True:
        views = serve.get_app_handle(app).router_state.remote().result(timeout_s=30)
        assert len(views) == 1, views  # one ingress replica, one router
        view = views[0]
        if all(v["inflight"] == 0 for v in view.values()) or time.monotonic() > deadline:
            return view
        time.sleep(0.2)


def _stats(app: str) -> list[dict[str, Any]]:
    from radixkv.cluster.app import fleet_engine_stats

    got = fleet_engine_stats(app)
    assert got, f"no engine stats from {app}"
    return got


def test_affinity_hit_rate_beats_default_routing(
    fleets: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    wl = SharedPrefixWorkload(groups=8, per_group=6, prefix_tokens=192, suffix_tokens=16)
    items = wl.items()
    best = wl.best_hit_tokens(PAGE) / wl.prompt_tokens()
    rates, walls = {}, {}
    for app in (DEFAULT, AFFINITY):
        before = _stats(app)
        res = run_workload(fleets[app], items, concurrency=4, max_tokens=2)
        assert [o.status for o in res.outcomes] == [200] * len(items), res.outcomes
        rates[app] = fleet_hit_rate(before, _stats(app))
        walls[app] = res.wall_s
        if app == AFFINITY:
            # each group after its first request stays on one replica
            split = [g for g in range(wl.groups) if len(res.replicas_of(g)) > 1]
            assert len(split) <= 1, split
            used = {o.replica for o in res.outcomes}
            assert len(used) >= 3  # groups were spread over the fleet, not piled on one replica
            view = _router_view(AFFINITY)  # the router's own accounting balances out
            assert len(view) == REPLICAS
            assert all(v["inflight"] == 0 and v["provisional"] == 0 for v in view.values()), view
            assert all(v["recent"] > 0 for v in view.values() if v["cached_estimate"]), view
    with capsys.disabled():
        print(
            f"\n[cluster] best {best:.3f}  affinity {rates[AFFINITY]:.3f} ({walls[AFFINITY]:.1f}s)"
            f"  default {rates[DEFAULT]:.3f} ({walls[DEFAULT]:.1f}s)"
        )
    assert rates[AFFINITY] >= 0.95 * best
    assert rates[AFFINITY] >= rates[DEFAULT] + 0.15


def test_hot_prefix_spreads_once_thresholds_trip(fleets: dict[str, str]) -> None:
    hot = SharedPrefixWorkload(groups=1, per_group=24, prefix_tokens=256, suffix_tokens=16, seed=7)
    res = run_workload(fleets[AFFINITY], hot.items(), concurrency=24, max_tokens=48)
    assert all(o.status == 200 for o in res.outcomes), res.outcomes
    per = Counter(o.replica for o in res.outcomes)
    assert len(per) >= 3, per  # imbalance_abs=4: the hot prefix must leave its first replica
    assert max(per.values()) <= 18, per
    # affinity still wins inside the spread: most requests hit the prefix somewhere
    assert sum(o.cached_tokens > 0 for o in res.outcomes) >= len(res.outcomes) - len(per) - 2


def test_reset_through_the_ingress_reaches_every_replica(fleets: dict[str, str]) -> None:
    for app in (AFFINITY, DEFAULT):  # both routers honour the per-replica pin
        before = _stats(app)
        assert len(before) == REPLICAS
        assert sum(s["cached_pages"] > 0 for s in before) >= 2, before  # warmed by earlier tests
        url = fleets[app] + "/reset_prefix_cache"
        denied = httpx.post(url, headers={"Authorization": "Bearer not-the-admin-key"}, timeout=60)
        assert denied.status_code == 401, denied.text
        assert [s["cached_pages"] for s in _stats(app)] == [s["cached_pages"] for s in before]
        r = httpx.post(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "ok" and body["failed"] == [], body
        assert body["replicas"] == body["reset"] == REPLICAS
        assert sorted(body["reset_replicas"]) == sorted(s["replica"] for s in before)
        after = _stats(app)
        assert len(after) == REPLICAS
        assert all(s["cached_pages"] == 0 for s in after), after
    view = _router_view(AFFINITY)  # the affinity router forgot what the replicas held
    assert len(view) == REPLICAS
    assert all(v["recent"] == 0 and v["cached_estimate"] == 0 for v in view.values()), view
    assert all(v["inflight"] == 0 for v in view.values()), view  # the reset calls completed
    # the next request of an old prefix finds nothing cached anywhere
    again = SharedPrefixWorkload(groups=8, per_group=6, prefix_tokens=192, suffix_tokens=16)
    res = run_workload(fleets[AFFINITY], again.items()[:1], concurrency=1, max_tokens=2)
    assert [(o.status, o.cached_tokens) for o in res.outcomes] == [(200, 0)], res.outcomes


def test_weight_update_through_the_ingress_reaches_every_replica(
    fleets: dict[str, str], tmp_path: Path
) -> None:
    """SGLang's /update_weights_from_disk through the ingress updates every replica (each reads
    the folder), empties their caches and makes the router forget them; then back."""
    new = save_tiny_folder("radixkv-tiny-random", tmp_path / "new")
    old = save_tiny_folder("radixkv-tiny", tmp_path / "old")
    url = fleets[AFFINITY] + "/update_weights_from_disk"
    prompt = {
        "input_ids": list(range(5, 60)),
        "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
    }
    before = httpx.post(fleets[AFFINITY] + "/generate", json=prompt, timeout=60).json()
    denied = httpx.post(url, json={"model_path": str(new)}, timeout=60)
    assert denied.status_code == 401, denied.text
    assert all(s["weight_updates"] == 0 for s in _stats(AFFINITY))
    auth = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.post(
        url, json={"model_path": str(new), "weight_version": "rl-7"}, headers=auth, timeout=120
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["updated"] == REPLICAS and body["failed"] == []
    stats = _stats(AFFINITY)
    assert all(s["weight_updates"] == 1 and s["cached_pages"] == 0 for s in stats), stats
    view = _router_view(AFFINITY)
    assert all(v["cached_estimate"] == 0 for v in view.values()), view
    after = httpx.post(fleets[AFFINITY] + "/generate", json=prompt, timeout=60).json()
    assert after["meta_info"]["weight_version"] == "rl-7"
    assert after["output_ids"] != before["output_ids"]
    bad = httpx.post(url, json={"model_path": str(tmp_path / "nope")}, headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["success"] is False, bad.text
    r = httpx.post(
        url, json={"model_path": str(old), "weight_version": "default"}, headers=auth, timeout=120
    )
    assert r.status_code == 200 and r.json()["updated"] == REPLICAS, r.text
    again = httpx.post(fleets[AFFINITY] + "/generate", json=prompt, timeout=60).json()
    assert again["output_ids"] == before["output_ids"]


# Last in this module on purpose: the fleet stays degraded after it (Ray Serve replaces the
# replica in its own time, and fan-outs meanwhile meet a replica that is gone), while the tests
# above reach "every replica" of the whole fleet.
def test_replica_killed_mid_run(fleets: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    wl = SharedPrefixWorkload(groups=6, per_group=5, prefix_tokens=128, suffix_tokens=16, seed=3)
    killed: dict[str, Any] = {}
    lock = threading.Lock()
    serve = _serve()
    ingress = serve.get_app_handle(AFFINITY)

    def kill_busiest(outcome: Any, n_done: int) -> None:
        with lock:
            if killed or n_done < 6:
                return
            killed["pending"] = True
        # the replica with the most requests in flight, as the router sees it right now
        view = ingress.router_state.remote().result(timeout_s=30)[0]
        uid, info = max(view.items(), key=lambda kv: kv[1]["inflight"])
        name = f"SERVE_REPLICA::{AFFINITY}#RadixKVReplica#{uid}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        killed.update(name=name, inflight=info["inflight"])

    res = run_workload(
        fleets[AFFINITY],
        wl.items(),
        concurrency=6,
        max_tokens=64,
        stream_every=3,
        timeout_s=90,
        on_done=kill_busiest,
    )
    assert "name" in killed, "no replica was killed"
    failures = ingress.ingress_stats.remote().result(timeout_s=30)
    with capsys.disabled():
        print(
            f"\n[cluster] killed a replica with {killed['inflight']} in flight: "
            f"{sum(o.status == 200 and not o.streamed_error for o in res.outcomes)} ok, "
            f"{sum(o.streamed_error for o in res.outcomes)} streams cut, "
            f"{sum(o.status == 503 for o in res.outcomes)} x 503 of {len(res.outcomes)}; "
            f"ingress {failures}"
        )
    if killed["inflight"] >= 2:  # (one alone might finish between the look and the kill)
        assert failures["retries"] + failures["streams_cut"] + failures["unavailable"] >= 1
    assert failures["streams_cut"] == sum(o.streamed_error for o in res.outcomes)
    # every request was answered: success (possibly after a retry elsewhere) or a clean error
    for o in res.outcomes:
        assert o.status in (200, 503), o
        if o.status == 503:
            assert o.error and "replica_unavailable" in o.error
    ok = [o for o in res.outcomes if o.status == 200 and not o.streamed_error]
    assert len(ok) >= len(res.outcomes) - 6, res.outcomes  # only in-flight ones may fail
    # afterwards the router no longer picks the dead replica and the others keep serving
    after = run_workload(fleets[AFFINITY], _fresh(wl, 12), concurrency=4, max_tokens=2)
    assert [o.status for o in after.outcomes] == [200] * 12, after.outcomes
    assert killed["name"] not in {o.replica for o in after.outcomes}
    view = _router_view(AFFINITY)
    assert killed["name"].rsplit("#", 1)[-1] not in view, view  # forgotten by the router
    assert all(v["inflight"] == 0 for v in view.values()), view


def _fresh(wl: SharedPrefixWorkload, n: int) -> list[Item]:
    return SharedPrefixWorkload(
        groups=n, per_group=1, prefix_tokens=wl.prefix_tokens, seed=wl.seed + 100
    ).items()
