"""``radixkv bench --base-url URL``: drive a running OpenAI-compatible server with a workload.

The client side of a serving benchmark, as SGLang's ``bench_serving`` and vLLM's ``bench serve``
measure it, so one workload can be sent to ``radixkv serve``, SGLang or vLLM alike: every
request is a streamed ``/v1/completions`` call whose prompt is a list of token ids (all three
accept that), greedy, with ``ignore_eos`` (so each produces exactly its ``max_tokens``) and
``stream_options.include_usage`` (so the server reports the prompt tokens it served from its
prefix cache, ``usage.prompt_tokens_details.cached_tokens``). ``--prompt-format text`` sends
the same prompts as words instead (:func:`as_text`), for servers that take text only.

Several ``--base-url`` run the same prompts one server after the other (each round in a
rotated order, ``--repeats`` rounds of new prompts), and a table sets them side by side.

Requests start at ``--request-rate`` per second (Poisson arrivals; ``inf``: all at once), at
most ``--max-concurrency`` in flight. Measured at the client, per request: time to first token
(the first chunk carrying text), the gaps between text chunks (inter-token latency), and the
whole request; per run: request and token throughput. A request that fails (HTTP error, broken
stream) is counted, with the first error's text, and leaves the others running.

The workload's prompts are seeded: a second run with the same ``--seed`` finds the first run's
prompts in the server's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from typing import Any, TextIO

import msgspec

from radixkv.bench.measure import percentile
from radixkv.bench.offline import Workload, build_workload


class RequestRecord(msgspec.Struct, kw_only=True):
    """One request as the client saw it (times in seconds)."""

    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = msgspec.field(default_factory=list)  # gaps between text chunks


def _rate(text: str) -> float:
    try:
        r = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a rate in requests/s or inf, got {text!r}"
        ) from None
    if not r > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 (or inf), got {text!r}")
    return r


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def add_serving_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--base-url`` flags of ``radixkv bench``."""
    s = p.add_argument_group("serving (with --base-url: a running server, not an engine here)")
    s.add_argument(
        "--base-url",
        action="append",
        default=None,
        help="an OpenAI-compatible server (radixkv serve, SGLang, vLLM), e.g. "
        "http://127.0.0.1:8000; repeat it to compare servers side by side; the engine flags "
        "then do not apply",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model id to send (default: each server's first one in /v1/models)",
    )
    s.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds; round r sends the workload of seed + r to every server, the servers' "
        "order rotating from round to round",
    )
    s.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (default inf)")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    s.add_argument(
        "--prompt-format",
        default="ids",
        choices=("ids", "text"),
        help="ids: token-id prompts (radixkv, vLLM, SGLang); text: the same prompts as words, "
        "for servers that take text only (OpenAI, llama.cpp's server), where the server's "
        "tokenizer sets the token counts",
    )
    s.add_argument(
        "--extra-request-body",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="fields merged into every request body, as SGLang's bench_serving takes them, "
        """e.g. '{"logit_bias": {"2": -100}}' to ban an EOS a server would not ignore""",
    )
    s.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    return p


async def _one(
    client: Any,
    model: str,
    prompt: list[int] | str,
    output_len: int,
    extra: dict[str, Any] | None = None,
) -> RequestRecord:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    # a text prompt's token count is the server's to say (usage); ids are counted here
    rec = RequestRecord(ok=False, prompt_tokens=0 if isinstance(prompt, str) else len(prompt))
    t0 = time.perf_counter()
    last = None
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {text[:300]}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):  # a server that fails mid-stream says so in an event
                    err = chunk["error"]
                    rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return rec
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                if choices[0].get("finish_reason") == "error":
                    rec.error = "the server ended the request with finish_reason 'error'"
                    return rec
                if choices[0].get("finish_reason") is None or choices[0].get("text"):
                    # a token whose text is held back (part of a UTF-8 character) still counts,
                    # for servers that report no usage
                    chunks += 1
                if choices[0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
    except Exception as e:  # a broken connection or stream fails this request only
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.latency = time.perf_counter() - t0
    if last is None:
        rec.error = "the stream ended without any text"
        return rec
    rec.ok = True
    rec.output_tokens = chunks
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or chunks)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
    return rec


async def _run(
    args: argparse.Namespace, base_url: str, work: Workload, model: str
) -> tuple[list[RequestRecord], float]:
    import httpx

    limit = args.max_concurrency or len(work.prompts)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=base_url, headers=_headers(args), timeout=args.timeout, limits=limits
    ) as client:

        async def bounded(prompt: list[int] | str) -> RequestRecord:
            async with sem:
                return await _one(client, model, prompt, work.output_len, args.extra_request_body)

        t0 = time.perf_counter()
        tasks = []
        prompts = work.prompts if args.prompt_format == "ids" else as_text(work.prompts)
        for prompt in prompts:
            tasks.append(asyncio.create_task(bounded(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - t0


# 256 distinct common English words, one per token id of the workloads (which are below 256):
# most are one token (after a space) in real models' vocabularies (GPT-2's, Llama's, Qwen's)
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father power "
    "hour game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education foot boy "
    "age policy music market sense nation plan college interest death experience effect class "
    "control care field development role effort rate heart drug show leader light voice wife "
    "police mind price report decision son view relationship town road arm difference value "
    "building action model season society tax director position player record paper space "
    "ground form event official matter center couple site project activity star table need "
    "court oil situation cost industry figure street image phone data picture practice piece "
    "land product doctor wall patient worker news test movie north love support technology step "
    "baby computer type attention film tree source organization hair window evidence population "
    "truth camp trial fire hotel heat river rock army bank cell chair lake ship snow sun train "
    "wind bird blue cold dark deep dry early easy fast fine free full good great green hard "
    "high hot large late long low new old open poor real red short simple slow small "
)
_WORDS = tuple(_WORD_TEXT.split())  # distinct (a test checks)


def as_text(prompts: list[list[int]]) -> list[str]:
    """Token-id prompts as text: id ``t`` is the ``t``-th word, so prompts that share ids share
    their text (the shared prefixes stay shared, up to a token where they end). How many
    tokens a prompt becomes is the server's tokenizer's business."""
    words = _WORDS
    return [" ".join(words[t % len(words)] for t in p) for p in prompts]


def _server_root(url: str) -> str:
    """``url`` without a trailing slash or ``/v1`` (the routes add ``/v1/...`` themselves)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def _served_model(args: argparse.Namespace, base_url: str) -> str:
    """The model id to send to ``base_url`` (a server root, see :func:`_server_root`):
    ``--served-model-name``, else the server's first; ValueError if the server cannot be
    reached or lists none."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/v1/models", headers=_headers(args), timeout=30)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if args.served_model_name:
        return str(args.served_model_name)
    if r.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered HTTP {r.status_code}: {r.text[:200]}")
    models = r.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --served-model-name")
    return str(models[0]["id"])


def summarize(
    records: list[RequestRecord], duration: float, output_len: int | None = None
) -> dict[str, Any]:
    """Run totals and latency statistics (ms) over the requests that succeeded; with
    ``output_len`` (what each asked for), how many stopped short of it."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft * 1e3 for r in ok]
    lat = [r.latency * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r.itl]
    tpot = [(r.latency - r.ttft) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)

    def stats(xs: list[float]) -> dict[str, float]:
        return {
            "mean": sum(xs) / len(xs) if xs else 0.0,
            "p50": percentile(xs, 50),
            "p99": percentile(xs, 99),
        }

    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "first_error": next((r.error for r in records if not r.ok), None),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": prompt / duration,
        "output_tok_s": output / duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "cached_share": cached / max(1, prompt),
        "short_outputs": (
            0 if output_len is None else sum(r.output_tokens < output_len for r in ok)
        ),
        "ttft_ms": stats(ttft),
        "tpot_ms": stats(tpot),
        "itl_ms": stats(itl),
        "latency_ms": stats(lat),
    }


def run_serving(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """Send the workload of ``args`` to each ``args.base_url`` (``args.repeats`` rounds), print
    the report to ``out``, return it. ValueError (before anything is sent) if a server cannot
    be reached or a setting is bad."""
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    # in order, each once; "http://host:8000/v1" (an OpenAI client's base URL) is the server
    urls: list[str] = list(dict.fromkeys(_server_root(u) for u in args.base_url))
    models = {url: _served_model(args, url) for url in urls}
    records: dict[str, list[RequestRecord]] = {url: [] for url in urls}
    seconds = dict.fromkeys(urls, 0.0)
    work = build_workload(args, vocab=256)  # ids below 256: valid for every tokenizer
    what = work.description
    if args.prompt_format == "text":
        what += " (sent as text, a word per token id: the server's tokenizer sets the counts)"
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    print(
        f"radixkv bench: {work.name}: {what}; {rate}, at most "
        f"{args.max_concurrency or len(work.prompts)} in flight, {args.repeats} round(s); on a "
        f"fresh server a perfect cache serves {work.ideal_hit_rate:.1%} of the prompt tokens",
        file=out,
        flush=True,
    )
    for r in range(args.repeats):
        if r:  # a new round: new prompts, so no server finds the last round's in its cache
            work = build_workload(args, vocab=256, seed=args.seed + r)
        for k in range(len(urls)):
            url = urls[(k + r) % len(urls)]
            recs, duration = asyncio.run(_run(args, url, work, models[url]))
            records[url].extend(recs)
            seconds[url] += duration
    servers = []
    for url in urls:
        s = summarize(records[url], seconds[url], work.output_len)
        lines = _server_lines(s, work.ideal_hit_rate)
        print(f"\n{url} (model {models[url]}):", file=out)
        for line in lines:
            print("  " + line, file=out)
        servers.append({"base_url": url, "model": models[url], "summary": s, "lines": lines})
    if len(urls) > 1:
        print("\n" + _comparison(servers), file=out)
    return {
        "benchmark": "radixkv bench --base-url",
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "repeats": args.repeats,
        "workload": {
            "dataset": work.name,
            "description": what,
            "requests_per_round": len(work.prompts),
            "output_len": work.output_len,
            "ideal_hit_rate": work.ideal_hit_rate,
            "seed": args.seed,
        },
        "servers": servers,
        "failed_requests": sum(x["summary"]["failed"] for x in servers),
    }


def _server_lines(s: dict[str, Any], ideal: float) -> list[str]:
    lines = [
        f"requests: {s['completed']} completed, {s['failed']} failed in {s['duration_s']:.2f} s "
        f"({s['request_throughput']:.2f} req/s; {s['input_tok_s']:,.0f} prompt tok/s, "
        f"{s['output_tok_s']:,.0f} output tok/s)",
        f"server prefix cache: {s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens "
        f"({s['cached_share']:.1%}; a perfect cache on a fresh server: {ideal:.1%})",
    ]
    for key, name in (
        ("ttft_ms", "time to first token"),
        ("tpot_ms", "time per output token"),
        ("itl_ms", "inter-token latency"),
        ("latency_ms", "request latency"),
    ):
        st = s[key]
        lines.append(
            f"{name:<22} mean {st['mean']:9.1f} ms   p50 {st['p50']:9.1f} ms   "
            f"p99 {st['p99']:9.1f} ms"
        )
    if s["short_outputs"]:
        lines.append(
            f"{s['short_outputs']} of {s['completed']} outputs stopped before max_tokens (a "
            "server that ignores ignore_eos ends at EOS): compare token rates, not request rates"
        )
    if s["failed"]:
        lines.append(f"first failure: {s['first_error']}")
    return lines


def _comparison(servers: list[dict[str, Any]]) -> str:
    """One row per server, in the order given."""
    w = max(len("server"), *(len(x["base_url"]) for x in servers))
    head = (
        f"{'server':<{w}} {'req/s':>8} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT p99':>10} "
        f"{'TPOT mean':>10} {'cached':>7} {'failed':>6}"
    )
    rows = [head, "-" * len(head)]
    for x in servers:
        s = x["summary"]
        rows.append(
            f"{x['base_url']:<{w}} {s['request_throughput']:>8.2f} {s['output_tok_s']:>10,.0f} "
            f"{s['ttft_ms']['mean']:>8.1f}ms {s['ttft_ms']['p99']:>8.1f}ms "
            f"{s['tpot_ms']['mean']:>8.1f}ms {s['cached_share']:>7.1%} {s['failed']:>6}"
        )
    return "\n".join(rows)
