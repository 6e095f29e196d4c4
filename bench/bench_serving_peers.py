"""Serving, side by side in one run: ``radixkv serve`` against llama.cpp's server.

The same checkpoint as bench_peers.py (its random Llama, hidden 512, 4 layers; fp32 for radixkv,
an f32 GGUF made by llama.cpp's own converter for llama.cpp), each behind its OpenAI-compatible
server on 127.0.0.1, sent the same requests by ``radixkv bench --base-url`` (its client,
radixkv/server/bench_client.py): SGLang's generated-shared-prefix shape as text prompts (llama.cpp's
server takes text only), all requests at once, streamed, greedy, ``--repeats`` rounds of new
prompts with the servers' order rotated. Client-side TTFT, time per output token, request and
token throughput, and the prompt tokens each server says it served from its cache.

llama.cpp's server is llama-cpp-python's (``python -m llama_cpp.server``), started with the
machine's threads and ``--interrupt_requests False`` (by default a new request cuts the stream in
progress, which would end most outputs early); it runs one request at a time. radixkv serve runs
in this process (its engine in float32, default settings).

    python bench/bench_serving_peers.py [--fetch-converter | --converter PATH] [--quick]

Needs llama-cpp-python with its server extra (sse-starlette, starlette-context,
pydantic-settings) and the converter (see bench_peers.py). Writes
bench/results/bench_serving_peers.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402

from radixkv.engine.async_engine import AsyncEngine  # noqa: E402
from radixkv.engine.bench_cli import add_bench_arguments  # noqa: E402
from radixkv.server.app import build_app  # noqa: E402
from radixkv.server.background import BackgroundServer  # noqa: E402
from radixkv.server.bench_client import add_serving_arguments, run_serving  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "bench_serving_peers.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp's server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama.cpp's server at {url} not ready in {timeout:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_peers.add_gguf_arguments(ap)
    ap.add_argument("--quick", action="store_true", help="2 groups x 4 prompts, one round")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    folder, gguf = bench_peers.f32_checkpoint(args, ap)

    groups, per_group, repeats = (2, 4, 1) if args.quick else (4, 4, args.repeats)
    # words of the client's text prompts: this checkpoint's tokenizer reads them a character at
    # a time (about 6 tokens a word), so 160 + 10 words make prompts of about 1,050 tokens
    bench_argv = [
        *("--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group)),
        *("--gsp-system-prompt-len", "160", "--gsp-question-len", "10"),
        *("--gsp-output-len", "32", "--repeats", str(repeats), "--prompt-format", "text"),
    ]
    threads = os.cpu_count() or 1
    port = _free_port()
    llama_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
        "--n_ctx", "8192", "--n_threads", str(threads), "--n_batch", "512",
        "--interrupt_requests", "False",
    ]  # fmt: skip
    engine = AsyncEngine(str(folder), dtype="float32")
    app = build_app(engine, owns_engine=True)
    log = io.StringIO()
    with BackgroundServer(app) as srv:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_ready(llama_url, proc)
            parser = add_serving_arguments(add_bench_arguments(argparse.ArgumentParser()))
            run_args = parser.parse_args(
                [*bench_argv, "--base-url", srv.url, "--base-url", llama_url]
            )
            report = run_serving(run_args, log)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(log.getvalue())
    names = {srv.url: "radixkv serve (float32)", llama_url: "llama.cpp server (f32 GGUF)"}
    rows = []
    for s in report["servers"]:
        m = s["summary"]
        rows.append(
            {
                "server": names[s["base_url"]],
                "requests": m["completed"],
                "failed": m["failed"],
                "short_outputs": m["short_outputs"],
                "req_per_s": round(m["request_throughput"], 3),
                "output_tok_per_s": round(m["output_tok_s"], 1),
                "ttft_mean_ms": round(m["ttft_ms"]["mean"], 1),
                "ttft_p99_ms": round(m["ttft_ms"]["p99"], 1),
                "tpot_mean_ms": round(m["tpot_ms"]["mean"], 2),
                "latency_p99_ms": round(m["latency_ms"]["p99"], 1),
                "cached_share": round(m["cached_share"], 4),
            }
        )
    import llama_cpp

    out = {
        "benchmark": "bench_serving_peers",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.platform()}, {threads} CPUs, Python {platform.python_version()}",
        "versions": {"llama_cpp_python": llama_cpp.__version__},
        "checkpoint": folder.name,  # the model tag (bench_peers.f32_checkpoint)
        "workload": report["workload"] | {"rounds": repeats, "prompt_format": "text"},
        "llama_cpp_server": " ".join(cmd[3:]).replace(str(gguf), gguf.name),
        "summary": rows,
        "ratios_radixkv_over_llama_cpp": {
            "req_per_s": round(rows[0]["req_per_s"] / rows[1]["req_per_s"], 2),
            "ttft_mean": round(rows[1]["ttft_mean_ms"] / rows[0]["ttft_mean_ms"], 2),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
