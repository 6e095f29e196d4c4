"""Structured output, side by side in one run: radixkv's guided decoding against llama.cpp's
JSON-schema grammar, on the same checkpoint.

bench_peers.py's random Llama (hidden 512, 4 layers, a character-level vocabulary of 32,000),
fp32 in radixkv and as llama.cpp's f32 GGUF (made by llama.cpp's own converter). Sixteen record-
extraction prompts (a shared instruction, then a record of their own) each generate one JSON
object under the same schema, greedy, up to 160 tokens:

* radixkv: ``SamplingParams(guided=GuidedDecodingParams(json=schema))``, all prompts submitted
  together (continuous batching, the instruction served from the prefix cache), with
  jump-forward (the default: tokens the schema forces are appended without a decode step) and
  without it;
* llama.cpp through llama-cpp-python: ``LlamaGrammar.from_json_schema`` (llama.cpp's own
  schema-to-grammar conversion), ``create_completion`` one prompt at a time (it runs one
  sequence), the machine's threads.

A random model says nothing meaningful, but the grammar decides the shape: every output must
parse and validate against the schema (``jsonschema``), and the table counts those that do.
Rounds run every system once in a rotated order; times are medians over rounds.

    python bench/bench_structured_peers.py [--fetch-converter | --converter PATH] [--quick]

Needs llama-cpp-python and jsonschema (see bench_peers.py for the converter). Writes
bench/results/bench_structured_peers.json. Not part of CI.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from peerkit import (
    add_gguf_arguments,
    add_round_arguments,
    f32_checkpoint,
    machine_dict,
    medians,
    open_llama,
    print_rows,
    results_path,
    rotated_rounds,
    utc_now,
    write_json,
)

from radixkv.engine.engine import Engine
from radixkv.engine.params import GuidedDecodingParams, SamplingParams

RESULTS = results_path("bench_structured_peers")
MAX_TOKENS = 160
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "Lagos", "Lima", "Osaka"]},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["new", "vip", "late"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "member", "tags"],
}
INSTRUCTION = (
    "You are a data extraction service. Read the customer record below and answer with one "
    "JSON object holding the customer's name, age, city, whether they are a member, and the "
    "tags that apply to them. Answer with the JSON object only.\n\nRecord: "
)
PEOPLE = ["Ada", "Bola", "Chen", "Dara", "Emeka", "Femi", "Gita", "Hugo"]
CITIES = ["Paris", "Lagos", "Lima", "Osaka"]


def prompts(n: int) -> list[str]:
    return [
        f"{INSTRUCTION}{PEOPLE[i % 8]} {chr(65 + i)}., {20 + 3 * i} years old, lives in "
        f"{CITIES[i % 4]}, customer since {2001 + i}.\nJSON: "
        for i in range(n)
    ]


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


System = Callable[[list[str]], list[tuple[str, int]]]  # prompts -> (text, output tokens) each


def radixkv_system(folder: Path, jump_forward: bool, draft_tokens: int = 0) -> System:
    engine = Engine(
        str(folder),
        dtype="float32",
        guided_jump_forward=jump_forward,
        num_speculative_tokens=draft_tokens,
    )
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, guided=GuidedDecodingParams(json=SCHEMA)
    )
    engine.compile_guided(params)  # compiled once, as a server would have it by now

    def run(ps: list[str]) -> list[tuple[str, int]]:
        engine.reset_prefix_cache()  # every round starts cold, as llama.cpp's does
        outs = engine.generate(ps, params, use_tqdm=False)
        return [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]

    return run


def llama_cpp_system(gguf: Path) -> System:
    import llama_cpp

    llm = open_llama(gguf, n_ctx=2048, kv_type=0)  # f32 KV, as radixkv's
    grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)

    def run(ps: list[str]) -> list[tuple[str, int]]:
        llm.reset()  # the KV of the previous round's last prompt: start cold
        outs = []
        for p in ps:
            r = llm.create_completion(
                p, max_tokens=MAX_TOKENS, temperature=0.0, top_k=1, repeat_penalty=1.0,
                grammar=grammar,
            )  # fmt: skip
            outs.append((r["choices"][0]["text"], int(r["usage"]["completion_tokens"])))
        return outs

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_gguf_arguments(ap)
    add_round_arguments(ap, RESULTS, quick="4 prompts, one round")
    args = ap.parse_args(argv)

    folder, gguf = f32_checkpoint(args, ap)
    n, rounds = (4, 1) if args.quick else (16, args.rounds)
    ps = prompts(n)
    systems: dict[str, System] = {
        "radixkv (guided, jump-forward)": radixkv_system(folder, True),
        "radixkv (guided, every token sampled)": radixkv_system(folder, False),
        "radixkv (guided, jump-forward, prompt lookup k=8)": radixkv_system(folder, True, 8),
        "llama.cpp f32 (JSON-schema grammar)": llama_cpp_system(gguf),
    }
    names = list(systems)
    times, last = rotated_rounds({name: partial(run, ps) for name, run in systems.items()}, rounds)
    secs = medians(times)
    rows = []
    for name in names:
        tokens = sum(t for _, t in last[name])
        rows.append(
            {
                "system": name,
                "seconds": round(secs[name], 3),
                "output_tokens": tokens,
                "output_tok_per_s": round(tokens / secs[name], 1),
                "valid_json": f"{sum(valid(t) for t, _ in last[name])}/{len(ps)}",
                # greedy: every radixkv variant must write what the first one wrote
                "same_as_radixkv": sum(
                    a == b for (a, _), (b, _) in zip(last[name], last[names[0]])
                ),
                "time_vs_radixkv": round(secs[name] / secs[names[0]], 2),
            }
        )
    print_rows(rows)
    result = {
        "date": utc_now(),
        "machine": machine_dict(),
        "checkpoint": folder.name,  # the model tag (peerkit.f32_checkpoint)
        "workload": {"prompts": n, "max_tokens": MAX_TOKENS, "rounds": rounds, "greedy": True},
        "schema": SCHEMA,
        "summary": rows,
        "sample_outputs": {name: last[name][0][0] for name in names},
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
