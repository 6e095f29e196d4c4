"""``radixkv serve-ray``: the OpenAI-compatible server as a Ray Serve fleet with prefix routing.

    radixkv serve-ray --model radixkv-tiny --replicas 4 --port 8000

starts (or joins, with ``--address``) a Ray cluster, deploys ``--replicas`` engine replicas
behind the cluster ingress and RadixAffinityRouter, serves the same routes as ``radixkv serve``
at ``http://HOST:PORT/v1/...``, and runs until interrupted.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="radixkv-tiny", help="model name or local HF folder")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas")
    p.add_argument("--router", choices=["affinity", "default"], default="affinity")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--route-prefix", default="/")
    p.add_argument("--app-name", default="radixkv")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start one)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs of a locally started Ray")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica")
    p.add_argument("--torch-threads", type=int, default=1, help="intra-op threads per replica")
    p.add_argument("--max-ongoing-requests", type=int, default=64)
    p.add_argument("--stats-period", type=float, default=1.0, help="routing stats period (s)")
    # engine
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool bytes per replica")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--schedule-policy", choices=["lpm", "fcfs"], default="lpm")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    # server
    p.add_argument("--api-keys", default=None, metavar="FILE", help="JSON: API key -> tenant")
    p.add_argument("--admin-key", default=os.environ.get("RADIXKV_ADMIN_KEY"))
    p.add_argument("--max-queue", type=int, default=1024)
    # router
    p.add_argument("--imbalance-abs", type=int, default=4)
    p.add_argument("--imbalance-rel", type=float, default=2.0)
    p.add_argument("--min-match-pages", type=int, default=1)
    p.add_argument("--min-match-ratio", type=float, default=0.1)
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The ClusterConfig for parsed ``serve-ray`` arguments (validates them)."""
    from radixkv.cluster.app import ClusterConfig

    engine: dict[str, Any] = {
        "page_size": args.page_size,
        "max_running_requests": args.max_running_requests,
        "schedule_policy": args.schedule_policy,
    }
    for key in ("num_pages", "kv_cache_memory", "device", "dtype"):
        if getattr(args, key) is not None:
            engine[key] = getattr(args, key)
    server: dict[str, Any] = {"max_queue": args.max_queue, "admin_key": args.admin_key}
    if args.api_keys:
        from radixkv.server.auth import load_api_keys

        server["api_keys"] = load_api_keys(args.api_keys)
    return ClusterConfig(
        model=args.model,
        replicas=args.replicas,
        router=args.router,
        engine_kwargs=engine,
        server_kwargs=server,
        router_kwargs={
            "imbalance_abs": args.imbalance_abs,
            "imbalance_rel": args.imbalance_rel,
            "min_match_pages": args.min_match_pages,
            "min_match_ratio": args.min_match_ratio,
        },
        replica_num_cpus=args.replica_cpus,
        max_ongoing_requests=args.max_ongoing_requests,
        stats_period_s=args.stats_period,
        torch_threads=args.torch_threads,
    )


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="radixkv serve-ray", description=__doc__))
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    from radixkv.cluster._ray import import_serve

    serve = import_serve()
    import ray

    from radixkv.cluster.app import build_cluster_app

    if args.address is not None:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts down as cleanly as Ctrl-C

    signal.signal(signal.SIGTERM, stop)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_cluster_app(config), name=args.app_name, route_prefix=args.route_prefix)
        prefix = args.route_prefix.rstrip("/")
        print(
            f"radixkv serve-ray: {args.replicas} replicas of {args.model} ({args.router} routing)"
        )
        print(f"  OpenAI API at http://{args.host}:{args.port}{prefix}/v1  (Ctrl-C to stop)")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
