"""``radixkv bench``: an engine here (offline.py) or, with ``--base-url``, running servers
(serving.py), on the same workloads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from radixkv.bench.offline import add_bench_arguments, run
from radixkv.bench.serving import add_serving_arguments, run_serving


def build_parser() -> argparse.ArgumentParser:
    """Every ``radixkv bench`` flag: workload, run, engine and serving."""
    parser = argparse.ArgumentParser(
        prog="radixkv bench",
        description="The engine (or, with --base-url, a running OpenAI-compatible server) on "
        "a synthetic workload shaped like SGLang's bench_serving datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    return add_serving_arguments(add_bench_arguments(parser))


def main(argv: list[str]) -> int:
    """Run the benchmark ``argv`` asks for. Bad settings exit 2 with the reason; a run in which
    some request failed returns 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.base_url is None:
            report = run(args)
        elif args.cache != "both":
            raise ValueError("--cache applies to an engine run here, not to a server's cache")
        else:
            report = run_serving(args, sys.stdout)
    except ValueError as e:
        parser.error(str(e))  # prints usage + the message, exits 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report.get("failed_requests") else 0
