"""llama.cpp as a peer, through llama-cpp-python: a model on the machine's threads, bench_peers.py's
one-sequence-at-a-time runner, and llama.cpp's OpenAI-compatible server in a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .random_checkpoint import SEED
from .systems import System, Workload


def open_llama(
    gguf: Path, *, n_ctx: int, n_batch: int = 512, n_ubatch: int = 512, kv_type: int | None = None
) -> Any:
    """``llama_cpp.Llama`` on ``gguf`` with every core for prompts and decoding; ``kv_type``
    is the KV cache's GGML type (0: f32, 30: bf16; None: llama.cpp's default f16)."""
    import llama_cpp

    threads = os.cpu_count() or 1
    return llama_cpp.Llama(
        str(gguf),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_threads=threads,
        n_threads_batch=threads,
        type_k=kv_type,
        type_v=kv_type,
        seed=SEED,
        verbose=False,
    )


def llama_cpp_system(gguf: Path, outtype: str, ctx: int) -> System:
    """``Llama.generate`` one sequence at a time, reusing the longest prefix its context shares
    with the previous request (llama.cpp's shared-prefix recipe); KV in the weights' precision
    (f32, bf16; the default f16 for q8_0)."""
    kv_type = {"f32": 0, "bf16": 30}.get(outtype)  # GGML_TYPE_F32 / _BF16; q8_0: default f16
    llm = open_llama(gguf, n_ctx=ctx, n_batch=2048, kv_type=kv_type)

    def run(w: Workload) -> list[list[int]]:
        outs = []
        for p in w.prompts:
            got: list[int] = []
            for t in llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                got.append(int(t))
                if len(got) == w.new_tokens:
                    break
            outs.append(got)
        return outs

    precision = {"f32": "float32", "bf16": "bfloat16"}.get(outtype, outtype)
    return System(f"llama.cpp {outtype}", "llama.cpp", precision, run,
                  note="llama-cpp-python, one sequence at a time, common prefix reused")  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaCppServer:
    """llama-cpp-python's server (``python -m llama_cpp.server``) on ``gguf``, on a free port
    of 127.0.0.1, with the machine's threads and ``--interrupt_requests False`` (by default a
    new request cuts the stream in progress); ``with`` starts it, waits until it answers and
    stops it. ``argv`` is its command line after ``python -m``."""

    def __init__(self, gguf: Path, *, n_ctx: int = 8192, n_batch: int = 512) -> None:
        threads = os.cpu_count() or 1
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            "llama_cpp.server", "--model", str(gguf), "--port", str(self.port),
            "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_batch", str(n_batch),
            "--interrupt_requests", "False",
        ]  # fmt: skip
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaCppServer:
        cmd = [sys.executable, "-m", *self.argv]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(self._proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=30)
            self._proc = None

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited with {proc.returncode}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama.cpp's server at {self.url} not ready in {timeout:.0f} s")
