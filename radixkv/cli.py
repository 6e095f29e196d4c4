"""The ``radixkv`` command line: demo, generate, bench, bench-cache, serve, serve-ray.

``radixkv ...`` and ``python -m radixkv ...`` are the same program."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.params import GuidedDecodingParams


def _demo(args: argparse.Namespace) -> int:
    import torch

    from radixkv.bench.measure import format_table, measure
    from radixkv.bench.workloads import shared_module_prompts
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(args.model, device=args.device or "cpu", dtype=args.dtype)
    prompts = shared_module_prompts(
        lm.tokenizer, num_requests=args.requests, system_words=args.system_words, seed=args.seed
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    n_tok = sum(map(len, prompts))
    kv_note = "" if args.kv_cache_dtype == "auto" else f", KV pages in {args.kv_cache_dtype}"
    print(
        f"radixkv demo: {len(prompts)} requests on {lm.name}, each asking for the body of one "
        f"method of a Python class; all share the module above it ({_shared(prompts)} tokens; "
        f"{n_tok:,} prompt tokens, {args.max_tokens} output tokens each, "
        f"{str(lm.model.dtype).removeprefix('torch.')}{kv_note}, "
        f"torch threads={torch.get_num_threads()})"
    )
    results = []
    engines = []
    for cache_on in (False, True):
        engine = Engine(
            lm,
            enable_prefix_cache=cache_on,
            num_pages=args.num_pages,
            seed=args.seed,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        desc = f"cache {'on' if cache_on else 'off'}"
        results.append(measure(engine, prompts, params, name="shared-module", desc=desc))
        engine.check_invariants()
        engines.append(engine)
    off, on = results
    print()
    print(format_table(results))
    print()
    print(
        f"prefix cache: time to first token {1 - on.ttft_mean_s / off.ttft_mean_s:.0%} lower "
        f"(p99 {1 - on.ttft_p99_s / off.ttft_p99_s:.0%} lower), throughput "
        f"{on.throughput_tok_s / off.throughput_tok_s:.1f}x, "
        f"{on.prefill_saved:,} of {on.prompt_tokens:,} prompt tokens served from cache"
    )
    if args.show > 0:  # what the model wrote: the same seeded samples with the cache off and on
        shown = prompts[: args.show]
        sample = SamplingParams(
            temperature=0.8, top_k=20, max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed
        )
        texts = [[o.text for o in e.generate(shown, sample, use_tqdm=False)] for e in engines]
        same = "identical" if texts[0] == texts[1] else "DIFFERENT"
        print(
            f"\nsampled continuations (temperature 0.8, top-k 20, seed {args.seed}; {same} with "
            "the cache off and on):"
        )
        for ids, text in zip(shown, texts[1]):
            sig = lm.tokenizer.decode(ids).rstrip().rsplit("\n", 1)[-1]
            print(f"{sig}\n{text}\n")
    if engines and args.tree:
        print("\ncache tree after the run (cache on):")
        lines = engines[-1].cache.pretty(max_tokens_shown=6).splitlines()
        print("\n".join(lines[: args.tree_lines]))
        if len(lines) > args.tree_lines:
            print(f"... ({len(lines) - args.tree_lines} more lines)")
    print(f"\ndone in {time.perf_counter() - t0:.1f}s")
    if args.json:
        import msgspec

        Path(args.json).write_text(json.dumps([msgspec.to_builtins(r) for r in results], indent=2))
    return 0


def _shared(prompts: list[list[int]]) -> int:
    a, b = prompts[0], prompts[1] if len(prompts) > 1 else prompts[0]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _generate(args: argparse.Namespace) -> int:
    from radixkv.engine.engine import Engine
    from radixkv.engine.intake import Prompt
    from radixkv.engine.params import SamplingParams
    from radixkv.model.tokenizer import encode_chat

    engine = Engine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        revision=args.revision,
        gguf_file=args.gguf_file,
        seed=args.seed,
        lora_modules={"adapter": args.lora} if args.lora else None,
    )
    lora = "adapter" if args.lora else None
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed if args.temperature > 0 else None,
        stop=args.stop or (),
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        guided=_guided(args),
    )
    prompt: Prompt = args.prompt
    if args.chat:  # the ids Engine.chat and the server's chat completions make (one chat path)
        prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
    if args.stream:
        for out in engine.stream(prompt, params, lora=lora):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        out = engine.generate(prompt, params, use_tqdm=False, lora=lora)[0]
        print(out.text)
        print(
            f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
            f"ttft={out.metrics.ttft * 1e3:.0f}ms]",
            file=sys.stderr,
        )
    return 0


def _guided(args: argparse.Namespace) -> GuidedDecodingParams | None:
    from radixkv.engine.params import GuidedDecodingParams

    schema = args.json_schema
    if schema is not None and schema.startswith("@"):
        try:
            schema = Path(schema[1:]).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--json-schema: cannot read {schema[1:]}: {e.strerror}") from None
    if schema is not None:
        return GuidedDecodingParams(json=schema)
    if args.json_object:
        return GuidedDecodingParams(json_object=True)
    if args.regex is not None:
        return GuidedDecodingParams(regex=args.regex)
    if args.choice:
        return GuidedDecodingParams(choice=args.choice)
    return None


def _bench_cache(argv: list[str]) -> int:
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_cache.py"
    if not path.is_file():
        print(f"bench-cache: {path} not found (run from a source checkout)", file=sys.stderr)
        return 2
    if str(path.parent) not in sys.path:  # its shared helpers (bench/peerkit/) sit beside it
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("radixkv_bench_cache", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return int(mod.main(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    from radixkv import __version__
    from radixkv.engine.config import DTYPES, KV_CACHE_DTYPES

    KV_HELP = "dtype the KV pages store (auto: the model's; fp8 halves bf16's bytes per token)"
    ap = argparse.ArgumentParser(prog="radixkv", description=__doc__)
    ap.add_argument("--version", action="version", version=f"radixkv {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="shared-prefix code completions, prefix cache off vs on")
    d.add_argument("--model", default="radixkv-tiny")
    d.add_argument("--requests", type=int, default=48)
    d.add_argument(  # radixkv-tiny was trained on 512-token windows: prompt + output fit in that
        "--system-words", type=int, default=12, help="shared module docstring length (words)"
    )
    d.add_argument("--max-tokens", type=int, default=48)
    d.add_argument("--show", type=int, default=3, help="print this many continuations")
    d.add_argument("--num-pages", type=int, default=None)
    d.add_argument("--device", default=None)
    d.add_argument(
        "--dtype",
        default=None,
        help="weights and KV dtype (default: the checkpoint's; bfloat16 is 2-3x faster on CPUs "
        "with bf16 matrix units, greedy outputs then vary with batch shapes: docs/tuning.md)",
    )
    d.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_HELP)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-tree", dest="tree", action="store_false", help="skip the cache tree")
    d.add_argument("--tree-lines", type=int, default=24)
    d.add_argument("--json", default=None, help="also write the results here")

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    g.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="radixkv-tiny",
        help="radixkv-tiny, smollm2-135m-instruct (packaged GGUF), a local Hugging Face model "
        "folder, a Hugging Face repo id, or a *.gguf file",
    )
    g.add_argument("--revision", default=None, help="branch, tag or commit of a repo id")
    g.add_argument(
        "--gguf-file", default=None, help="the GGUF file in the model folder or repo id to load"
    )
    g.add_argument("--dtype", default=None, choices=DTYPES)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_HELP)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 0; 1 is off, above 1 fewer repeats"
    )
    guided = g.add_mutually_exclusive_group()  # guided decoding (SamplingParams.guided)
    guided.add_argument(
        "--json-schema",
        default=None,
        help="constrain the output to one JSON value this schema accepts (JSON text, or "
        "@path to a file holding it)",
    )
    guided.add_argument("--json-object", action="store_true", help="output any JSON object")
    guided.add_argument("--regex", default=None, help="output a match of this regex")
    guided.add_argument(
        "--choice", action="append", default=None, help="output one of these (repeatable)"
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template (as Engine.chat and "
        "the server's chat completions do)",
    )
    g.add_argument("--stream", action="store_true")
    g.add_argument(
        "--lora", default=None, metavar="FOLDER", help="run with this PEFT LoRA adapter folder"
    )
    g.add_argument("--device", default=None)
    g.add_argument("--seed", type=int, default=0)

    sub.add_parser(
        "bench",
        help="the engine on a synthetic workload, prefix cache off vs on (radixkv bench --help)",
        add_help=False,
    )
    sub.add_parser(
        "bench-cache", help="cache micro-benchmarks (bench/bench_cache.py)", add_help=False
    )
    sub.add_parser("serve", help="OpenAI-compatible server (radixkv serve --help)", add_help=False)
    sub.add_parser(
        "serve-ray", help="the server on Ray Serve with prefix-affinity routing", add_help=False
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # serve, bench and bench-cache own their flags; hand them the rest of the command line
    if argv and argv[0] == "serve":
        from radixkv.server import main as serve_main

        return int(serve_main(argv[1:]) or 0)
    if argv and argv[0] == "serve-ray":  # needs the `ray` extra; imported only here
        from radixkv.cluster.cli import main as serve_ray_main

        return int(serve_ray_main(argv[1:]) or 0)
    if argv and argv[0] == "bench":  # radixkv/bench/: tooling, imported only here
        from radixkv.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "bench-cache":
        return _bench_cache(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return {"demo": _demo, "generate": _generate}[args.command](args)
    except (ValueError, TypeError) as e:
        print(f"radixkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
