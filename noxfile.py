"""nox sessions: tests, lint, fuzz, bench, notebooks, docs, gpu_check."""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # CPU build; an unpinned torch pulls a multi-GB CUDA build


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    _install(session)
    session.run("pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """The Hypothesis state machines with the long profile (many more examples)."""
    _install(session)
    session.run(
        "pytest", "-q", "-p", "no:cacheprovider", "tests/", "-k", "fuzz or state_machine",
        env={"RADIXKV_HYPOTHESIS_PROFILE": "fuzz"},
    )


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run every benchmark in bench/ and regenerate docs/benchmarks.md."""
    _install(session, "test")
    for script in ("bench_cache.py", "bench_model.py", "bench_engine.py", "bench_cascade.py"):
        session.run("python", f"bench/{script}", *session.posargs)


@nox.session(python="3.11")
def notebooks(session: nox.Session) -> None:
    _install(session)
    session.run("pytest", "-q", "--nbmake", "docs/notebooks")


@nox.session(python=False)
def gpu_check(session: nox.Session) -> None:
    """On a CUDA machine only: flashinfer vs torch backend. Never part of CI."""
    session.run("python", "bench/gpu_check.py", *session.posargs)
