"""Timing systems against each other on a shared machine: every system once a round, the order
rotated, so a slow spell of the machine hits each alike; medians over the rounds."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def rotated_rounds(
    systems: dict[str, Callable[[], Any]], rounds: int, label: str = ""
) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run every system once a round, the order rotated one place a round (a slow spell hits
    each alike); returns (each one's times, each one's output in the last round)."""
    times, outputs = rotated_rounds_all(systems, rounds, label)
    return times, {name: outs[-1] for name, outs in outputs.items() if outs}


def rotated_rounds_all(
    systems: dict[str, Callable[[], Any]], rounds: int, label: str = ""
) -> tuple[dict[str, list[float]], dict[str, list[Any]]]:
    """:func:`rotated_rounds`, keeping every round's output: (times, outputs), a list each per
    system in round order."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dt, out = timed(systems[name])
            times[name].append(dt)
            outputs[name].append(out)
            print(f"{label}round {r}: {name}: {dt:.2f} s", flush=True)
    return times, outputs


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    """Each system's median time."""
    return {name: statistics.median(ts) for name, ts in times.items()}


def add_round_arguments(
    ap: argparse.ArgumentParser, results: Path, quick: str, rounds: int = 3
) -> None:
    """``--quick`` (``quick`` says what it shrinks; one round), ``--rounds`` and ``--out``
    (default ``results``), as :func:`rounds_of` reads them."""
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (medians)")
    ap.add_argument("--out", type=Path, default=results)


def rounds_of(args: argparse.Namespace) -> int:
    """The rounds to run: one with ``--quick``, else ``--rounds``."""
    return 1 if args.quick else int(args.rounds)
