"""What ``radixkv demo``, ``radixkv bench`` and bench/bench_engine.py measure on an engine.

``measure(engine, prompts, params)`` submits every prompt at once, runs the engine to completion
and reports what a prefix cache changes: hit rate, time to first token (mean, p99), throughput
and prefill tokens computed vs saved.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from radixkv.engine.engine import Engine
from radixkv.engine.intake import Prompt
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams


class WorkloadResult(msgspec.Struct, kw_only=True):
    name: str
    cache: bool
    requests: int
    prompt_tokens: int
    output_tokens: int
    prefill_computed: int  # prompt tokens actually run through the model
    prefill_saved: int  # prompt tokens served from the cache
    hit_rate: float  # prefill_saved / prompt_tokens
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    wall_s: float
    throughput_tok_s: float  # (prompt + output tokens) / wall
    output_tok_s: float
    steps: int
    preemptions: int
    time_schedule_s: float
    time_forward_s: float
    time_sample_s: float
    time_postprocess_s: float


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100 * len(s) + 0.5) - 1))
    return s[k]


def measure(
    engine: Engine,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    *,
    name: str = "workload",
    use_tqdm: bool = True,
    desc: str | None = None,
) -> WorkloadResult:
    """Run ``prompts`` (all arriving now) to completion on ``engine`` and measure."""
    from tqdm import tqdm

    before = engine.stats()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    done: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), desc=desc or name, unit="req", disable=not use_tqdm) as bar:
        for o in engine.iter_outputs(ids):
            if o.finished:
                done[o.request_id] = o
                bar.update(1)
    wall = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    after = engine.stats()
    ttfts = [o.metrics.ttft or 0.0 for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs) * params.n
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    computed = after.prefill_tokens_computed - before.prefill_tokens_computed
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    return WorkloadResult(
        name=name,
        cache=engine.config.enable_prefix_cache,
        requests=len(outs),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prefill_computed=computed,
        prefill_saved=hits,
        hit_rate=hits / max(1, prompt_tokens),
        ttft_mean_s=sum(ttfts) / len(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        wall_s=wall,
        throughput_tok_s=(prompt_tokens + output_tokens) / wall,
        output_tok_s=output_tokens / wall,
        steps=after.num_steps - before.num_steps,
        preemptions=after.num_preemptions - before.num_preemptions,
        time_schedule_s=after.time_schedule - before.time_schedule,
        time_forward_s=after.time_forward - before.time_forward,
        time_sample_s=after.time_sample - before.time_sample,
        time_postprocess_s=after.time_postprocess - before.time_postprocess,
    )


def format_table(results: Sequence[WorkloadResult]) -> str:
    """A fixed-width comparison table, one row per result."""
    w = max([22, *(len(r.name) for r in results)])  # the name column fits every name
    head = (
        f"{'workload':<{w}} {'cache':>5} {'hit rate':>8} {'TTFT mean':>10} {'TTFT p99':>10} "
        f"{'tok/s':>9} {'prefill run':>11} {'saved':>9} {'wall s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.name:<{w}} {'on' if r.cache else 'off':>5} {r.hit_rate:>8.1%} "
            f"{r.ttft_mean_s * 1e3:>8.0f}ms {r.ttft_p99_s * 1e3:>8.0f}ms "
            f"{r.throughput_tok_s:>9.0f} {r.prefill_computed:>11,} {r.prefill_saved:>9,} "
            f"{r.wall_s:>7.2f}"
        )
    return "\n".join(lines)
