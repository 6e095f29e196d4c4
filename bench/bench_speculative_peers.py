"""Speculative decoding by prompt lookup, side by side in one run: radixkv against transformers'
own prompt-lookup decoding, on the same weights.

radixkv-tiny's trained weights (the package's safetensors, in float32) loaded into transformers'
``LlamaForCausalLM`` as well. Two workloads, greedy, ``ignore_eos``-style (a fixed number of new
tokens, so every system does the same work):

* ``repeating``: prompts the model continues by repeating itself (a loop of code lines), where
  lookups find the continuation;
* ``code``: prompts of real code the model continues with code of its own, where little
  repeats.

Systems: radixkv without drafts and with ``num_speculative_tokens=8`` (all prompts submitted
together), and transformers ``generate`` without drafts and with ``prompt_lookup_num_tokens=8``
(one prompt at a time: its prompt lookup runs at batch size 1). Greedy outputs are compared token
by token with transformers' plain ``generate``. Rounds run every system once in a rotated order;
times are medians.

    python bench/bench_speculative_peers.py [--quick]

Needs transformers (the test extra). Writes bench/results/bench_speculative_peers.json. Not in CI.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from peerkit import (
    ROOT,
    add_round_arguments,
    hf_generate,
    identical,
    machine_dict,
    medians,
    print_rows,
    results_path,
    rotated_rounds,
    rounds_of,
    tiny_hf_model,
    utc_now,
    write_json,
)

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.tiny import tiny_tokenizer

RESULTS = results_path("bench_speculative_peers")
DRAFTS = 8


def workloads(quick: bool) -> dict[str, tuple[list[str], int]]:
    """name -> (prompts, new tokens each)."""
    code = (ROOT / "radixkv" / "engine" / "kv_manager.py").read_text()
    repeating = [
        "import os\n" * 3 + "def f(x):\n    return x\n" * 4,
        "for i in range(9):\n" * 3,
        "x = 1\ny = 2\n" * 5,
        "assert a == b\n" * 4,
    ]
    written = [code[2000:3200], code[5000:5800] + "\n\n    def ", "def read_lines(path):\n"]
    n = 2 if quick else None
    return {"repeating": (repeating[:n], 300), "code": (written[:n], 200)}


Run = Callable[[list[list[int]], int], list[list[int]]]  # (prompt ids, new tokens) -> outputs


def radixkv_system(k: int) -> Run:
    engine = Engine("radixkv-tiny", dtype="float32", num_pages=1024, num_speculative_tokens=k)

    def run(prompts: list[list[int]], new: int) -> list[list[int]]:
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    return run


def transformers_system(model: Any, lookup: int | None) -> Run:
    @torch.inference_mode()
    def run(prompts: list[list[int]], new: int) -> list[list[int]]:
        kw: dict[str, Any] = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
        return [hf_generate(model, torch.tensor([p]), new, hold_eos=True, **kw)[0].tolist()
                for p in prompts]  # fmt: skip

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(ap, RESULTS, quick="2 prompts a workload, one round")
    args = ap.parse_args(argv)
    rounds = rounds_of(args)
    tok = tiny_tokenizer()
    hf = tiny_hf_model()
    systems: dict[str, Run] = {
        "radixkv": radixkv_system(0),
        f"radixkv, {DRAFTS} drafts": radixkv_system(DRAFTS),
        "transformers": transformers_system(hf, None),
        f"transformers, prompt lookup {DRAFTS}": transformers_system(hf, DRAFTS),
    }
    rows = []
    for wname, (texts, new) in workloads(args.quick).items():
        prompts = [tok.encode(t) for t in texts]
        times, outs = rotated_rounds(
            {n: partial(run, prompts, new) for n, run in systems.items()},
            rounds,
            label=f"{wname} ",
        )
        secs = medians(times)
        base = secs[f"radixkv, {DRAFTS} drafts"]
        for name in systems:
            tokens = sum(len(o) for o in outs[name])
            rows.append(
                {
                    "workload": wname,
                    "system": name,
                    "seconds": round(secs[name], 3),
                    "tokens": tokens,
                    "tok_per_s": round(tokens / secs[name], 1),
                    "same_as_transformers": identical(outs[name], outs["transformers"]),
                    "time_vs_radixkv_drafts": round(secs[name] / base, 2),
                }
            )
    print_rows(rows)
    result = {
        "date": utc_now(),
        "machine": machine_dict(),
        "model": "radixkv-tiny (float32), the same weights in transformers",
        "drafts": DRAFTS,
        "rounds": rounds,
        "summary": rows,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
