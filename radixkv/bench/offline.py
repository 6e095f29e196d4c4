"""``radixkv bench`` on an engine here: a synthetic workload, prefix cache off and on, side by side.

Offline, as SGLang's ``bench_offline_throughput``: every prompt arrives at once and the engine
runs them to completion. The workloads are named and shaped like SGLang's ``bench_serving``
datasets, with SGLang's flag names where it has them:

* ``generated-shared-prefix`` (the default): ``--gsp-num-groups`` groups of
  ``--gsp-prompts-per-group`` prompts, each group sharing a system prompt of
  ``--gsp-system-prompt-len`` tokens, each prompt adding a ``--gsp-question-len``-token question;
  shuffled. The defaults are SGLang's divided down to what a 2-core CPU runs in seconds.
* ``random``: ``--num-prompts`` independent prompts of ``--random-input-len`` tokens: nothing
  to share, so it shows what the cache costs when it cannot help.
* ``branches``: one ``--branches-prefix-len``-token prompt and ``--num-prompts`` branches of it,
  each with ``--branches-unique-len`` tokens of its own, decoding together (best-of-n, a tree
  search): the shared prefix is computed once, and with ``--cascade auto`` its KV is read once
  per decode step for all branches instead of once per branch.
* ``multi-turn``: ``--mt-conversations`` chats of ``--mt-turns`` turns, each turn resent with
  the chat's history (a system prompt all chats share, earlier user turns and answers), as
  chat clients send them; every turn of every chat is sent at once.

Prompts are random token ids below 256, valid for every tokenizer, so any model runs them;
sampling is greedy with ``ignore_eos`` so every request produces its full output. Each engine
first runs one unrelated warm-up request (one-time kernel and allocation costs) and drops it
from its cache. The engine flags are ``radixkv serve``'s (:class:`EngineConfig`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import zlib
from typing import Any, TextIO

import msgspec
import torch

from radixkv.bench.measure import WorkloadResult, format_table, measure
from radixkv.bench.workloads import (
    generated_shared_prefix,
    multi_turn_chats,
    random_prompts,
    shared_prefix_tokens,
)
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams

DATASETS = ("generated-shared-prefix", "random", "branches", "multi-turn")
CACHE_MODES = ("both", "on", "off")
_WARMUP_SEED = 10_007  # the warm-up prompt's ids come from their own generator


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Prompts (token ids) and what they ask for."""

    name: str  # the dataset
    description: str  # one line for the header
    prompts: list[list[int]]
    output_len: int
    ideal_hit_rate: float  # share of prompt tokens a perfect cache serves (each prefix once)


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def add_bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``radixkv bench`` flags on ``p``: workload, run and engine flags."""
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="radixkv-tiny",
        help="radixkv-tiny, a local Hugging Face model folder, or a Hugging Face repo id",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--dataset-name",
        default="generated-shared-prefix",
        choices=DATASETS,
        help="the workload's shape (module docstring of radixkv/bench/offline.py)",
    )
    w.add_argument(
        "--num-prompts", type=_positive, default=32, help="random: prompts; branches: branches"
    )
    w.add_argument("--random-input-len", type=_positive, default=512, help="tokens a prompt")
    w.add_argument("--random-output-len", type=_positive, default=32, help="tokens out")
    w.add_argument("--gsp-num-groups", type=_positive, default=8, help="groups of prompts")
    w.add_argument("--gsp-prompts-per-group", type=_positive, default=8, help="prompts a group")
    w.add_argument(
        "--gsp-system-prompt-len", type=_positive, default=1024, help="tokens a group shares"
    )
    w.add_argument("--gsp-question-len", type=_positive, default=64, help="tokens a prompt owns")
    w.add_argument("--gsp-output-len", type=_positive, default=32, help="tokens out")
    w.add_argument("--branches-prefix-len", type=_positive, default=4096, help="shared tokens")
    w.add_argument("--branches-unique-len", type=_positive, default=8, help="tokens a branch owns")
    w.add_argument("--branches-output-len", type=_positive, default=48, help="tokens out")
    w.add_argument("--mt-conversations", type=_positive, default=8, help="chats")
    w.add_argument("--mt-turns", type=_positive, default=4, help="user turns a chat")
    w.add_argument(
        "--mt-system-len", type=_positive, default=256, help="system prompt all chats share"
    )
    w.add_argument("--mt-user-len", type=_positive, default=64, help="tokens a user turn")
    w.add_argument(
        "--mt-assistant-len",
        type=_positive,
        default=128,
        help="tokens of each earlier answer in the history",
    )
    w.add_argument("--mt-output-len", type=_positive, default=32, help="tokens out")
    r = p.add_argument_group("run")
    r.add_argument(
        "--cache",
        default="both",
        choices=CACHE_MODES,
        help="prefix cache off, on, or both one after the other, with their ratios",
    )
    r.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip each engine's warm-up request",
    )
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no bars")
    r.add_argument("--json", default=None, metavar="FILE", help="also write everything here")
    EngineConfig.add_cli_arguments(p)
    return p


def build_workload(args: argparse.Namespace, vocab: int, seed: int | None = None) -> Workload:
    """The prompts of ``args.dataset_name``, seeded by ``seed`` (default ``args.seed``) and the
    dataset's name (datasets never share token runs: a server that ran one holds nothing of
    another)."""
    seed = zlib.crc32(f"{args.dataset_name}:{args.seed if seed is None else seed}".encode())
    if args.dataset_name == "generated-shared-prefix":
        g, n = args.gsp_num_groups, args.gsp_prompts_per_group
        sys_len, q_len = args.gsp_system_prompt_len, args.gsp_question_len
        prompts, ideal = generated_shared_prefix(
            num_groups=g,
            prompts_per_group=n,
            system_len=sys_len,
            question_len=q_len,
            vocab=vocab,
            seed=seed,
        )
        desc = (
            f"{g} groups x {n} prompts, each a {sys_len:,}-token system prompt shared by its "
            f"group + a {q_len}-token question, {args.gsp_output_len} tokens out"
        )
        return Workload(
            name=args.dataset_name,
            description=desc,
            prompts=prompts,
            output_len=args.gsp_output_len,
            ideal_hit_rate=ideal,
        )
    if args.dataset_name == "random":
        n, length = args.num_prompts, args.random_input_len
        prompts = random_prompts(num_requests=n, length=length, vocab=vocab, seed=seed)
        desc = f"{n} independent prompts of {length:,} tokens, {args.random_output_len} out"
        return Workload(
            name=args.dataset_name,
            description=desc,
            prompts=prompts,
            output_len=args.random_output_len,
            ideal_hit_rate=0.0,
        )
    if args.dataset_name == "multi-turn":
        return _multi_turn(args, seed, vocab)
    n, pre, uniq = args.num_prompts, args.branches_prefix_len, args.branches_unique_len
    prompts = shared_prefix_tokens(
        num_requests=n, prefix_len=pre, unique_len=uniq, vocab=vocab, seed=seed
    )
    desc = (
        f"{n} branches of one {pre:,}-token prompt, {uniq} tokens of their own each, "
        f"{args.branches_output_len} tokens out, decoding together"
    )
    return Workload(
        name=args.dataset_name,
        description=desc,
        prompts=prompts,
        output_len=args.branches_output_len,
        ideal_hit_rate=(n - 1) * pre / (n * (pre + uniq)),
    )


def _multi_turn(args: argparse.Namespace, seed: int, vocab: int) -> Workload:
    c, turns = args.mt_conversations, args.mt_turns
    prompts, ideal = multi_turn_chats(
        num_chats=c,
        turns=turns,
        system_len=args.mt_system_len,
        user_len=args.mt_user_len,
        assistant_len=args.mt_assistant_len,
        vocab=vocab,
        seed=seed,
    )
    desc = (
        f"{c} chats x {turns} turns resent with their history: a {args.mt_system_len:,}-token "
        f"system prompt they all share, {args.mt_user_len}-token user turns, "
        f"{args.mt_assistant_len}-token earlier answers, {args.mt_output_len} tokens out"
    )
    return Workload(
        name=args.dataset_name,
        description=desc,
        prompts=prompts,
        output_len=args.mt_output_len,
        ideal_hit_rate=ideal,
    )


def _check_fits(engine: Engine, work: Workload) -> None:
    """ValueError before anything runs if a request cannot fit the model's context."""
    longest = max(map(len, work.prompts)) + work.output_len
    if longest > engine.max_context:
        raise ValueError(
            f"a request needs {longest:,} tokens (prompt + output) but the model's context is "
            f"{engine.max_context:,}: shorten the prompts or the output"
        )


def _warm_up(engine: Engine, length: int) -> None:
    """One unrelated request (first-call costs: kernel setup, allocations), then forget it."""
    prompts = random_prompts(
        num_requests=1, length=length, vocab=engine.vocab_size, seed=_WARMUP_SEED
    )
    engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    engine.reset_prefix_cache()


def _decode_figures(engine: Engine, before: Any) -> dict[str, Any]:
    """Cascade use during the measured run (deltas of the engine's counters)."""
    after = engine.stats()
    plain = after.kv_bytes_read_plain - before.kv_bytes_read_plain
    read = after.kv_bytes_read_cascade - before.kv_bytes_read_cascade
    return {
        "cascade_steps": after.cascade_steps - before.cascade_steps,
        "decode_kv_bytes_plain": plain,
        "decode_kv_bytes_read": read,
    }


def run(args: argparse.Namespace, out: TextIO | None = None) -> dict[str, Any]:
    """Run the benchmark ``args`` describe, print the report to ``out`` (default: stdout),
    return it as a dict. Raises ValueError on bad settings (before the model is loaded where
    possible)."""
    out = sys.stdout if out is None else out
    config = EngineConfig.from_cli_args(args)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.cache]
    if not config.enable_prefix_cache and True in modes:
        if args.cache == "on":
            raise ValueError("--cache on and --disable-prefix-cache contradict each other")
        modes = (False,)
    results: list[WorkloadResult] = []
    decode: list[dict[str, Any]] = []
    model: Any = args.model
    work: Workload | None = None
    params: SamplingParams | None = None
    for cache_on in modes:
        cfg = dataclasses.replace(config, enable_prefix_cache=cache_on)
        if not isinstance(model, str):  # loaded: what only loading uses is spent
            cfg = dataclasses.replace(
                cfg, revision=None, gguf_file=None, tokenizer=None, chat_template=None
            )
        engine = Engine(model, config=cfg)
        try:
            model = engine.model  # loaded once, shared by the second engine
            if work is None or params is None:
                work = build_workload(args, engine.vocab_size)
                _check_fits(engine, work)
                print(_header(engine, work), file=out, flush=True)
                params = SamplingParams(
                    temperature=0.0, max_tokens=work.output_len, ignore_eos=True
                )
            if args.warmup:
                _warm_up(engine, min(256, max(map(len, work.prompts))))
            before = engine.stats()
            results.append(
                measure(
                    engine,
                    work.prompts,
                    params,
                    name=work.name,
                    use_tqdm=args.progress,
                    desc=f"cache {'on' if cache_on else 'off'}",
                )
            )
            decode.append(_decode_figures(engine, before))
            engine.check_invariants()
        finally:
            engine.close()
    assert work is not None  # modes is never empty
    report = _report(args, config, work, results, decode)
    print(file=out)
    print(format_table(results), file=out)
    for line in report["summary_lines"]:
        print(line, file=out)
    return report


def _header(engine: Engine, work: Workload) -> str:
    prompt_tokens = sum(map(len, work.prompts))
    return (
        f"radixkv bench: {work.name}: {work.description} ({prompt_tokens:,} prompt tokens; a "
        f"perfect cache serves {work.ideal_hit_rate:.1%} of them)\n"
        f"model {engine.model.name} in {str(engine.model.model.dtype).removeprefix('torch.')} "
        f"on {engine.kv_pool.device}, attention {engine.backend_choice.name}, cascade "
        f"{engine.config.cascade}, page size {engine.page_size}, torch threads "
        f"{torch.get_num_threads()}"
    )


def _report(
    args: argparse.Namespace,
    config: EngineConfig,
    work: Workload,
    results: list[WorkloadResult],
    decode: list[dict[str, Any]],
) -> dict[str, Any]:
    lines = []
    for r, d in zip(results, decode, strict=True):
        cascade = ""
        if d["cascade_steps"]:
            fewer = d["decode_kv_bytes_plain"] / max(1, d["decode_kv_bytes_read"])
            cascade = (
                f"; cascade in {d['cascade_steps']} decode steps, {fewer:.1f}x fewer KV bytes read"
            )
        lines.append(
            f"cache {'on' if r.cache else 'off'}: {r.output_tok_s:,.0f} output tok/s, "
            f"{r.steps} steps, {r.preemptions} preemptions{cascade}"
        )
    summary: dict[str, Any] = {}
    if len(results) == 2:
        off, on = results
        tiny = 1e-12  # no division by zero on a degenerate run
        summary = {
            "ttft_mean_reduction": 1 - on.ttft_mean_s / max(off.ttft_mean_s, tiny),
            "ttft_p99_reduction": 1 - on.ttft_p99_s / max(off.ttft_p99_s, tiny),
            "throughput_ratio": on.throughput_tok_s / max(off.throughput_tok_s, tiny),
            "hit_rate": on.hit_rate,
            "ideal_hit_rate": work.ideal_hit_rate,
        }
        lines.append(
            f"prefix cache: time to first token {summary['ttft_mean_reduction']:.1%} lower "
            f"(p99 {summary['ttft_p99_reduction']:.1%} lower), throughput "
            f"{summary['throughput_ratio']:.2f}x; hit rate {on.hit_rate:.1%} of the "
            f"{work.ideal_hit_rate:.1%} a perfect cache reaches"
        )
    return {
        "benchmark": "radixkv bench",
        "workload": {
            "dataset": work.name,
            "description": work.description,
            "requests": len(work.prompts),
            "prompt_tokens": sum(map(len, work.prompts)),
            "output_len": work.output_len,
            "ideal_hit_rate": work.ideal_hit_rate,
            "seed": args.seed,
        },
        "engine": {  # JSON values as they are, anything else (a torch dtype) as its text
            k: v if v is None or isinstance(v, bool | int | float | str) else str(v)
            for k, v in dataclasses.asdict(config).items()
        },
        "model": args.model,
        "torch_threads": torch.get_num_threads(),
        "results": [msgspec.to_builtins(r) | d for r, d in zip(results, decode, strict=True)],
        "summary": summary,
        "summary_lines": lines,
    }
