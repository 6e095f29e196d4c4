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
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/",
        "-k",
        "fuzz or state_machine",
        env={"RADIXKV_HYPOTHESIS_PROFILE": "fuzz"},
    )


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run every benchmark in bench/ and regenerate docs/benchmarks.md."""
    _install(session, "test")
    scripts = (
        "bench_cache.py",
        "bench_model.py",
        "bench_engine.py",
        "bench_cascade.py",
        "bench_tuning.py",
        "bench_server.py",
    )
    for script in scripts:
        session.run("python", f"bench/{script}", *session.posargs)
    session.run("python", "bench/make_report.py")


@nox.session(python="3.11")
def bench_cluster(session: nox.Session) -> None:
    """The Ray Serve fleet benchmark (starts a local Ray; slower, so kept apart)."""
    _install(session, "test")
    session.run("python", "bench/bench_cluster.py", *session.posargs)
    session.run("python", "bench/make_report.py")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Build the documentation site with warnings as errors."""
    _install(session)
    session.run("python", "-m", "mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python="3.11")
def notebooks(session: nox.Session) -> None:
    _install(session)
    session.run("pytest", "-q", "--nbmake", "docs/notebooks")


@nox.session(python=False)
def gpu_check(session: nox.Session) -> None:
    """On a CUDA machine only: flashinfer vs torch backend. Never part of CI."""
    session.run("python", "bench/gpu_check.py", *session.posargs)
