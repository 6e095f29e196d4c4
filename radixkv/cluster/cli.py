"""``radixkv serve-ray``: the OpenAI-compatible server as a Ray Serve fleet with prefix routing.

    radixkv serve-ray --model radixkv-tiny --replicas 4 --port 8000

starts (or joins, with ``--address``) a Ray cluster, deploys ``--replicas`` engine replicas
behind the cluster ingress and RadixAffinityRouter, serves the same routes as ``radixkv serve``
at ``http://HOST:PORT/v1/...``, and runs until interrupted.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

from radixkv.engine.config import EngineConfig
from radixkv.server.cli import add_model_argument, add_server_arguments, server_config_from_args


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``radixkv serve-ray`` flags: the fleet's, the server's (as ``radixkv serve``)
    and the engine's (generated from EngineConfig, as for ``radixkv serve``)."""
    add_model_argument(p)
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
    add_server_arguments(p)
    # router
    p.add_argument("--imbalance-abs", type=int, default=4)
    p.add_argument("--imbalance-rel", type=float, default=2.0)
    p.add_argument("--min-match-pages", type=int, default=1)
    p.add_argument("--min-match-ratio", type=float, default=0.1)
    EngineConfig.add_cli_arguments(p)  # per replica
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The ClusterConfig for parsed ``serve-ray`` arguments (validates them)."""
    from radixkv.cluster.app import ClusterConfig

    # plain data: Ray pickles both per replica; None fields are left to the defaults
    engine = EngineConfig.from_cli_args(args).options()
    server = server_config_from_args(args)
    server_kwargs = {
        "model_name": server.model_name,
        "api_keys": server.api_keys,
        "admin_key": server.admin_key,
        "max_queue": server.max_queue,
        "max_body_bytes": server.max_body_bytes,
    }
    return ClusterConfig(
        model=args.model,
        replicas=args.replicas,
        router=args.router,
        engine_kwargs=engine,
        server_kwargs={k: v for k, v in server_kwargs.items() if v is not None},
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
