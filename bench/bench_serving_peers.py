"""Serving, side by side in one run: ``radixkv serve`` against llama.cpp's server.

The same checkpoint as bench_peers.py (its random Llama, hidden 512, 4 layers; fp32 for radixkv,
an f32 GGUF made by llama.cpp's own converter for llama.cpp), each behind its OpenAI-compatible
server on 127.0.0.1, sent the same requests by ``radixkv bench --base-url`` (its client,
radixkv/bench/serving.py): SGLang's generated-shared-prefix shape as text prompts (llama.cpp's
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
from collections.abc import Sequence
from pathlib import Path

from peerkit import (
    LlamaCppServer,
    add_gguf_arguments,
    f32_checkpoint,
    results_path,
    utc_now,
    write_json,
)

from radixkv.bench.cli import build_parser
from radixkv.bench.serving import run_serving
from radixkv.engine.async_engine import AsyncEngine
from radixkv.server.app import build_app
from radixkv.server.background import BackgroundServer

RESULTS = results_path("bench_serving_peers")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gguf_arguments(ap)
    ap.add_argument("--quick", action="store_true", help="2 groups x 4 prompts, one round")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    folder, gguf = f32_checkpoint(args, ap)

    groups, per_group, repeats = (2, 4, 1) if args.quick else (4, 4, args.repeats)
    # words of the client's text prompts: this checkpoint's tokenizer reads them a character at
    # a time (about 6 tokens a word), so 160 + 10 words make prompts of about 1,050 tokens
    bench_argv = [
        *("--gsp-num-groups", str(groups), "--gsp-prompts-per-group", str(per_group)),
        *("--gsp-system-prompt-len", "160", "--gsp-question-len", "10"),
        *("--gsp-output-len", "32", "--repeats", str(repeats), "--prompt-format", "text"),
    ]
    engine = AsyncEngine(str(folder), dtype="float32")
    app = build_app(engine, owns_engine=True)
    log = io.StringIO()
    llama = LlamaCppServer(gguf, n_ctx=8192, n_batch=512)
    with BackgroundServer(app) as srv, llama:
        run_args = build_parser().parse_args(
            [*bench_argv, "--base-url", srv.url, "--base-url", llama.url]
        )
        report = run_serving(run_args, log)
    print(log.getvalue())
    names = {srv.url: "radixkv serve (float32)", llama.url: "llama.cpp server (f32 GGUF)"}
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
        "date": utc_now(),
        "machine": f"{platform.platform()}, {os.cpu_count() or 1} CPUs, "
        f"Python {platform.python_version()}",
        "versions": {"llama_cpp_python": llama_cpp.__version__},
        "checkpoint": folder.name,  # the model tag (peerkit.f32_checkpoint)
        "workload": report["workload"] | {"rounds": repeats, "prompt_format": "text"},
        "llama_cpp_server": " ".join(llama.argv[1:]).replace(str(gguf), gguf.name),
        "summary": rows,
        "ratios_radixkv_over_llama_cpp": {
            "req_per_s": round(rows[0]["req_per_s"] / rows[1]["req_per_s"], 2),
            "ttft_mean": round(rows[1]["ttft_mean_ms"] / rows[0]["ttft_mean_ms"], 2),
        },
    }
    print(json.dumps(out["summary"], indent=1))
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
