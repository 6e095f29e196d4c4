"""``radixkv serve-ray``: the OpenAI-compatible server as a Ray Serve fleet with prefix routing.

    radixkv serve-ray --model radixkv-tiny --replicas 4 --port 8000

starts (or joins, with ``--address``) a Ray cluster, deploys ``--replicas`` engine replicas
behind the cluster ingress and RadixAffinityRouter, serves the same routes as ``radixkv serve``
at ``http://HOST:PORT/v1/...``, and runs until interrupted.

Before deploying it plans each replica's CPU reservation (``placement.py``): on the Ray it
starts, replicas share the CPUs (``--replica-cpus`` unset) or a reservation that cannot fit
fails at once. Then it waits for the fleet at most ``--ready-timeout`` seconds
(``readiness.py``) and exits with Ray's reason instead of waiting forever.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from typing import Any

from radixkv.cluster.placement import CpuPlan, FleetDoesNotFit, plan_cpus
from radixkv.cluster.readiness import (
    DeploymentNotReady,
    app_state,
    check_reachable,
    wait_until_running,
)
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
    p.add_argument(
        "--address",
        default=None,
        help="join this Ray cluster ('auto': the one `ray start` runs here; default: start a "
        "fresh local one)",
    )
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs of the locally started Ray (default: the CPUs this machine has)",
    )
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=None,
        help="CPUs Ray reserves per replica (default: on a local Ray, the replicas share the "
        "CPUs the ingress leaves, at most 1 each; on a joined cluster 1)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="exit with an error when the fleet is not serving after this long (0: wait forever)",
    )
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
        # replicas and the ingress re-read the file when it changes (where it exists on their
        # node; elsewhere the keys read here stay in force)
        "api_keys_file": server.api_keys_file,
        "admin_key": server.admin_key,
        "max_queue": server.max_queue,
        "max_body_bytes": server.max_body_bytes,
        "strict_api": server.strict_api or None,
        "metrics_require_key": server.metrics_require_key,  # None: as keys are configured
        "allowed_hosts": server.allowed_hosts or None,
        "tool_call_parser": server.tool_call_parser,
        "reasoning_parser": server.reasoning_parser,
        "responses_store_size": server.responses_store_size,
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
        # placeholder when unset: main() fits it to the cluster (placement.plan_cpus)
        replica_num_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
        max_ongoing_requests=args.max_ongoing_requests,
        stats_period_s=args.stats_period,
        torch_threads=args.torch_threads,
    )


def _say(msg: str, *, err: bool = False) -> None:
    print(f"radixkv serve-ray: {msg}", file=sys.stderr if err else sys.stdout, flush=True)


def _machine_cpus() -> int:
    """The CPUs a local Ray would detect by itself (cgroup quotas included)."""
    try:
        from ray._private.utils import get_num_cpus

        return int(get_num_cpus())
    except ImportError:  # pragma: no cover - Ray moved its helper
        return len(os.sched_getaffinity(0))


def _check_args(args: argparse.Namespace) -> None:
    if args.num_cpus is not None and args.num_cpus < 1:
        raise ValueError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    if args.replica_cpus is not None and not args.replica_cpus >= 0:
        raise ValueError(f"--replica-cpus must be >= 0, got {args.replica_cpus}")
    if not args.ready_timeout >= 0:
        raise ValueError(f"--ready-timeout must be >= 0 (0: no limit), got {args.ready_timeout}")
    if args.address is not None and args.num_cpus is not None:
        raise ValueError("--num-cpus sizes a Ray started here; it cannot be used with --address")


def _plan(config: Any, args: argparse.Namespace, available: float, *, local: bool) -> CpuPlan:
    return plan_cpus(
        replicas=config.replicas,
        available_cpus=available,
        replica_cpus=args.replica_cpus,
        ingress_cpus=config.ingress_num_cpus,
        ingress_replicas=config.ingress_replicas,
        local=local,
    )


def main(argv: list[str] | None = None) -> int:
    """Run ``radixkv serve-ray`` until interrupted; returns the exit code: 0 after Ctrl-C or
    SIGTERM, 1 when the fleet cannot start (does not fit, failed, not ready in time); bad
    flags exit 2."""
    parser = add_arguments(argparse.ArgumentParser(prog="radixkv serve-ray", description=__doc__))
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        config = config_from_args(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    local = args.address is None
    plan = None
    if local:  # the CPUs are known before Ray starts: a fleet that cannot fit fails here
        cpus = args.num_cpus or _machine_cpus()
        try:
            plan = _plan(config, args, float(cpus), local=True)
        except FleetDoesNotFit as e:
            _say(f"error: {e}", err=True)
            return 1

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts down as cleanly as Ctrl-C

    previous = signal.signal(signal.SIGTERM, stop)
    from radixkv.cluster._ray import import_serve

    serve = import_serve()
    import ray

    from radixkv.cluster.app import build_cluster_app

    try:
        if local:
            # "local": a fresh cluster, never one RAY_ADDRESS or `ray start` points at; sized
            # explicitly so it has exactly the CPUs the plan counted
            ray.init(address="local", num_cpus=cpus, include_dashboard=False)
        else:
            check_reachable(args.address)
            ray.init(address=args.address)
            plan = _plan(config, args, ray.available_resources().get("CPU", 0.0), local=False)
        # ray.init installs its own SIGTERM handler (it aborts the driver, leaving Ray's
        # processes to die on their own): ours again, for the orderly shutdown below
        signal.signal(signal.SIGTERM, stop)
        assert plan is not None
        _say(plan.describe(), err=not plan.fits)
        config = dataclasses.replace(config, replica_num_cpus=plan.replica_cpus)
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run_many(
            [
                serve.RunTarget(
                    build_cluster_app(config), name=args.app_name, route_prefix=args.route_prefix
                )
            ],
            wait_for_ingress_deployment_creation=False,  # both would wait without a deadline
            wait_for_applications_running=False,
        )
        waited = wait_until_running(
            lambda: app_state(serve.status(), args.app_name),
            app_name=args.app_name,
            timeout_s=args.ready_timeout or None,
            on_progress=_say,
        )
        prefix = args.route_prefix.rstrip("/")
        _say(
            f"{args.replicas} replicas of {args.model} ({args.router} routing) "
            f"ready in {waited:.0f} s"
        )
        print(f"  OpenAI API at http://{args.host}:{args.port}{prefix}/v1  (Ctrl-C to stop)")
        sys.stdout.flush()
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except DeploymentNotReady as e:
        _say(f"error: {e}", err=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup
        if ray.is_initialized():  # (serve's calls would start a Ray of their own otherwise)
            if local:
                serve.shutdown()
            else:  # the joined cluster may serve other applications: remove only ours
                serve.delete(args.app_name)
            ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
