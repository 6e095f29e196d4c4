"""A shared-prefix workload for a fleet behind HTTP (used by the cluster tests and the bench).

``G`` groups of ``P`` requests; each group shares a ``prefix_tokens``-token prefix and every
request adds ``suffix_tokens`` unique tokens. Requests are sent in a seeded random order by
``concurrency`` client threads (prompts are token ids, so no tokenizer is involved on the
client). The best possible fleet hit rate is every group served by one replica after its first
request: ``best_hit_tokens`` counts that, with the engine's rules (whole pages only, the last
prompt token always computed).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Item:
    group: int
    prompt: list[int]


@dataclass
class Outcome:
    group: int
    status: int  # HTTP status, or 0 when the request raised (timeout, connection error)
    replica: str | None = None
    cached_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None
    streamed_error: bool = False  # a stream that ended with an error event instead of [DONE]


@dataclass
class RunResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def replicas_of(self, group: int) -> set[str]:
        return {o.replica for o in self.outcomes if o.group == group and o.replica}


@dataclass(frozen=True, kw_only=True)
class SharedPrefixWorkload:
    groups: int = 8
    per_group: int = 6
    prefix_tokens: int = 192
    suffix_tokens: int = 16
    vocab: int = 256  # plain byte tokens of radixkv-tiny (no special tokens)
    seed: int = 0

    def items(self) -> list[Item]:
        rng = random.Random(self.seed)
        out = []
        for g in range(self.groups):
            prefix = [rng.randrange(self.vocab) for _ in range(self.prefix_tokens)]
            for _ in range(self.per_group):
                suffix = [rng.randrange(self.vocab) for _ in range(self.suffix_tokens)]
                out.append(Item(g, prefix + suffix))
        rng.shuffle(out)
        return out

    def prompt_tokens(self) -> int:
        return self.groups * self.per_group * (self.prefix_tokens + self.suffix_tokens)

    def best_hit_tokens(self, page_size: int) -> int:
        """Hit tokens if each group's later requests reuse its first one's whole prefix pages."""
        n = self.prefix_tokens + self.suffix_tokens
        shared = min(self.prefix_tokens, n - 1) // page_size * page_size
        return self.groups * (self.per_group - 1) * shared


def _one(client: Any, url: str, model: str, item: Item, max_tokens: int, stream: bool) -> Outcome:
    body: dict[str, Any] = {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    try:
        if not stream:
            r = client.post(url, json=body)
            cached = int(r.headers.get("x-cached-tokens", 0) or 0)
            return Outcome(
                item.group,
                r.status_code,
                r.headers.get("x-radixkv-replica"),
                cached,
                time.monotonic() - t0,
                None if r.status_code == 200 else r.text[:200],
            )
        with client.stream("POST", url, json={**body, "stream": True}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
            done = bool(lines) and lines[-1].strip() == "data: [DONE]"
            return Outcome(
                item.group,
                r.status_code,
                r.headers.get("x-radixkv-replica"),
                int(r.headers.get("x-cached-tokens", 0) or 0),
                time.monotonic() - t0,
                None if done else (lines[-1][:200] if lines else "empty stream"),
                streamed_error=not done and r.status_code == 200,
            )
    except Exception as e:  # the test decides whether a transport error is acceptable
        return Outcome(item.group, 0, latency_s=time.monotonic() - t0, error=repr(e))


def run_workload(
    base_url: str,
    items: list[Item],
    *,
    model: str = "radixkv-tiny",
    max_tokens: int = 2,
    concurrency: int = 4,
    timeout_s: float = 120.0,
    stream_every: int = 0,
    on_done: Any = None,
) -> RunResult:
    """Send ``items`` to ``base_url``/v1/completions; every ``stream_every``-th one streamed.
    ``on_done(outcome, n_done)`` is called after each request (from a worker thread)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    lock = threading.Lock()
    result = RunResult()
    local = threading.local()
    clients: list[Any] = []

    def client() -> Any:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(timeout=timeout_s)
            with lock:
                clients.append(c)
        return c

    def work(i: int, item: Item) -> None:
        stream = stream_every > 0 and i % stream_every == 0
        out = _one(client(), url, model, item, max_tokens, stream)
        with lock:
            result.outcomes.append(out)
            n = len(result.outcomes)
        if on_done is not None:
            on_done(out, n)

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(work, i, it) for i, it in enumerate(items)]:
                f.result()
    finally:
        for c in clients:
            c.close()
    result.wall_s = time.monotonic() - t0
    return result


def fleet_delta(before: list[dict[str, Any]], after: list[dict[str, Any]], field: str) -> int:
    """How much the engines' counter ``field`` grew over a run, summed over the replicas
    (``fleet_engine_stats`` before and after; replicas missing from ``before`` count from
    zero)."""
    prev = {s["replica"]: s for s in before}
    return sum(s[field] - prev.get(s["replica"], {}).get(field, 0) for s in after)


def fleet_hit_rate(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> float:
    """Prefix-cache hit rate over a run, from the engines' own counters (summed over
    replicas)."""
    query = fleet_delta(before, after, "prefix_cache_query_tokens")
    hit = fleet_delta(before, after, "prefix_cache_hit_tokens")
    return hit / query if query else 0.0
