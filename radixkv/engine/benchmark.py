"""Workloads and measurements shared by ``radixkv demo``, ``radixkv bench`` and
bench/bench_engine.py.

``measure(engine, prompts, params)`` submits every prompt at once, runs the engine to completion
and reports what a prefix cache changes: hit rate, time to first token (mean, p99), throughput
and prefill tokens computed vs saved. ``measure_rounds`` does the same over rounds of requests
whose prompts depend on the previous round's answers (chat turns).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

import msgspec

from radixkv.engine.engine import Engine
from radixkv.engine.intake import Prompt
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.model.tokenizer import Tokenizer, encode_chat


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
    once = iter([prompts])
    return measure_rounds(
        engine, lambda _: next(once, None), params, name=name, use_tqdm=use_tqdm, desc=desc
    )[0]


def measure_rounds(
    engine: Engine,
    next_round: Callable[[list[RequestOutput]], Sequence[Prompt] | None],
    params: SamplingParams,
    *,
    name: str = "workload",
    use_tqdm: bool = True,
    desc: str | None = None,
) -> tuple[WorkloadResult, list[list[RequestOutput]]]:
    """Run rounds of requests to completion on ``engine`` and measure them as one workload.

    ``next_round(previous)`` gets the finished outputs of the previous round (``[]`` before the
    first) and returns the next round's prompts, all arriving at once, or ``None`` when there
    are no more: a chat's next turn is only known once its previous answer is. Returns the
    measurement over all rounds and every round's outputs (in prompt order)."""
    from tqdm import tqdm

    before = engine.stats()
    t0 = time.perf_counter()
    rounds: list[list[RequestOutput]] = []
    prev: list[RequestOutput] = []
    with tqdm(desc=desc or name, unit="req", disable=not use_tqdm) as bar:
        while (prompts := next_round(prev)) is not None:
            ids = [engine.add_request(p, params, stream=False) for p in prompts]
            bar.total = (bar.total or 0) + len(ids)
            done: dict[str, RequestOutput] = {}
            for o in engine.iter_outputs(ids):
                if o.finished:
                    done[o.request_id] = o
                    bar.update(1)
            prev = [done[i] for i in ids]
            rounds.append(prev)
    wall = time.perf_counter() - t0
    outs = [o for r in rounds for o in r]
    after = engine.stats()
    ttfts = [o.metrics.ttft or 0.0 for o in outs]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs) * params.n
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    computed = after.prefill_tokens_computed - before.prefill_tokens_computed
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    result = WorkloadResult(
        name=name,
        cache=engine.config.enable_prefix_cache,
        requests=len(outs),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        prefill_computed=computed,
        prefill_saved=hits,
        hit_rate=hits / max(1, prompt_tokens),
        ttft_mean_s=sum(ttfts) / max(1, len(ttfts)),
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
    return result, rounds


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


# ---------------------------------------------------------------------------- workloads
_WORDS = [
    "cache",
    "prefix",
    "token",
    "page",
    "radix",
    "tree",
    "attention",
    "request",
    "batch",
    "decode",
    "prefill",
    "system",
    "prompt",
    "user",
    "answer",
    "question",
    "model",
    "engine",
    "memory",
    "shared",
    "branch",
    "chat",
    "turn",
    "document",
    "key",
    "value",
    "evict",
    "lock",
    "node",
    "hit",
    "miss",
    "latency",
    "throughput",
    "schedule",
    "kernel",
]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def shared_system_prompt_chats(
    tokenizer: Tokenizer,
    *,
    num_requests: int,
    system_words: int,
    question_words: int,
    seed: int = 0,
) -> list[list[int]]:
    """Chat prompts (rendered with the tokenizer's chat template when it has one) that share one
    long system prompt and differ in a short user question."""
    rng = random.Random(seed)
    system = "You are a careful assistant. Follow these rules. " + _text(rng, system_words)
    prompts = []
    for i in range(num_requests):
        q = f"Question {i}: " + _text(rng, question_words) + "?"
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        if getattr(tokenizer, "chat_template", None):
            prompts.append(encode_chat(tokenizer, msgs))
        else:
            prompts.append(tokenizer.encode(system + "\n" + q + "\n"))
    return prompts


# The ``radixkv demo`` workload: many completions of one Python module. radixkv-tiny was trained
# on the Python standard library, so it can continue this; the module's docstring, imports and
# class header are the shared prefix (the "system prompt"), each request adds one method signature.
_MODULE_DOC = (
    "A small in-memory cache with a size limit. The cache keeps at most maxsize items and, when "
    "it is full, removes the entry that was used least recently. Every method is safe to call "
    "from several threads, because each one holds the lock while it reads or changes the "
    "mapping. Keys must be hashable; values may be any object. The statistics attribute counts "
    "hits, misses and evictions, so that the caller can tell whether the limit is large enough "
    "for the workload. Entries are stored in an ordered dictionary: the most recently used key "
    "is moved to the end, so the least recently used one is always first and can be removed in "
    "constant time. The size limit may be changed at any time with resize(), which drops the "
    "oldest entries until the cache fits. A value of None is stored like any other value; use a "
    "sentinel to tell a missing key from a stored None. Iterating over the cache does not count "
    "as use and does not change the order of the entries. The class does not expire entries "
    "after a time; store a timestamp with the value if that is needed. This module is an "
    "example for the radixkv demo: many requests share the text above and below, and each asks "
    "for the body of a different method."
)
_MODULE_CODE = '''
import os
import sys
import threading
from collections import OrderedDict


class LRUCache:
    """A mapping that keeps at most *maxsize* items, dropping the least recently used."""

    def __init__(self, maxsize=128):
        self.maxsize = maxsize
        self.data = OrderedDict()
        self.lock = threading.RLock()
        self.hits = self.misses = 0
'''
_METHODS = [
    "get", "put", "pop", "clear", "copy", "keys", "items", "values", "update", "resize",
    "discard", "setdefault", "__len__", "__contains__", "__repr__", "__iter__",
]  # fmt: skip
_ARGS = ["self", "self, key", "self, key, default=None"]


def shared_module_prompts(
    tokenizer: Tokenizer, *, num_requests: int, system_words: int, seed: int = 0
) -> list[list[int]]:
    """Token prompts that share one Python module (a docstring of ``system_words`` words, imports
    and a class header) and differ in the method signature that ends them (plus the body's
    indentation): the model writes that method's body. Requests past the 48 distinct signatures repeat them (full cache hits)."""
    import textwrap

    rng = random.Random(seed)
    words = _MODULE_DOC.split()
    doc = textwrap.fill(" ".join(words[i % len(words)] for i in range(system_words)), 80)
    module = f'"""{doc}\n"""\n{_MODULE_CODE}'
    sigs = [f"{m}({a})" for a in _ARGS for m in _METHODS]
    rng.shuffle(sigs)
    return [
        tokenizer.encode(
            f"{module}\n    def {sigs[i % len(sigs)]}:\n        "
        )  # as an editor indents
        for i in range(num_requests)
    ]


def shared_prefix_tokens(
    *, num_requests: int, prefix_len: int, unique_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``num_requests`` token prompts: one shared ``prefix_len`` prefix + ``unique_len`` own."""
    rng = random.Random(seed)
    hi = min(vocab, 256)  # plain byte ids: valid for every tokenizer we ship
    prefix = [rng.randrange(hi) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(hi) for _ in range(unique_len)] for _ in range(num_requests)]


def generated_shared_prefix(
    *,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    vocab: int,
    seed: int = 0,
) -> tuple[list[list[int]], float]:
    """SGLang's generated-shared-prefix shape: groups of prompts sharing a per-group system
    prompt, each with its own question, shuffled. Returns (prompts, ideal hit rate), the ideal
    being every system prompt computed once: (n - groups) * system / total prompt tokens."""
    rng = random.Random(seed)
    hi = min(vocab, 256)
    prompts = []
    for _ in range(num_groups):
        system = [rng.randrange(hi) for _ in range(system_len)]
        for _ in range(prompts_per_group):
            prompts.append(system + [rng.randrange(hi) for _ in range(question_len)])
    rng.shuffle(prompts)
    n = len(prompts)
    ideal = (n - num_groups) * system_len / (n * (system_len + question_len))
    return prompts, ideal


def random_prompts(*, num_requests: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``num_requests`` independent token prompts of ``length`` ids: nothing to share."""
    rng = random.Random(seed)
    hi = min(vocab, 256)
    return [[rng.randrange(hi) for _ in range(length)] for _ in range(num_requests)]


def multi_turn_chats(
    *,
    num_chats: int,
    turns: int,
    system_len: int,
    user_len: int,
    assistant_len: int,
    vocab: int,
    seed: int = 0,
) -> tuple[list[list[int]], float]:
    """Chats resent with their history, as a chat client sends them: turn t of a chat is a
    system prompt every chat shares, the t - 1 earlier exchanges (user turn + answer) and the
    new user turn. Returns (prompts, ideal hit rate). The earlier answers are fixed tokens, not
    what a model wrote, so what a cache can reuse of turn t is turn t - 1's prompt (and, for a
    chat's first turn, the system prompt once another chat computed it)."""
    rng = random.Random(seed)
    hi = min(vocab, 256)

    def toks(n: int) -> list[int]:
        return [rng.randrange(hi) for _ in range(n)]

    system = toks(system_len)
    prompts: list[list[int]] = []
    reusable = 0
    for chat in range(num_chats):
        history = list(system)
        for t in range(turns):
            prompt = history + toks(user_len)
            reusable += len(history) - assistant_len if t else (len(system) if chat else 0)
            prompts.append(prompt)
            history = prompt + toks(assistant_len)
    return prompts, reusable / sum(map(len, prompts))
