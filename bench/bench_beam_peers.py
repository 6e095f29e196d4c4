"""Beam search, side by side in one run: radixkv against transformers' ``generate(num_beams=W)``
on the same weights, and against vLLM's way of doing it, replayed on radixkv's own engine.

radixkv-tiny's trained weights (the package's safetensors, in float32) loaded into transformers'
``LlamaForCausalLM`` as well. Beam width 4, all 4 hypotheses returned, a fixed number of new
tokens (EOS held back: transformers' ``min_new_tokens``, radixkv's ``ignore_eos``), so every
system does the same search. Two workloads:

* ``shared_prefix``: 8 prompts, one ~1,000-token stretch of code and a different line each;
* ``one_prompt``: one ~1,500-token prompt.

Systems:

* ``radixkv``: ``SamplingParams(beam_width=4, n=4)``, all prompts submitted together: beams
  fork by sharing pages (engine/beam_search.py), prompts share their prefix through the cache;
* ``transformers``: ``generate(num_beams=4, num_return_sequences=4)`` one prompt at a time (it
  prefills the prompt once per beam, and reorders its KV cache every step);
* ``radixkv, vLLM's algorithm``: what vLLM's ``LLM.beam_search`` does, driven through radixkv's
  engine: every step, each beam is a new one-token request (``logprobs=2W``) whose prompt is
  the beam's tokens, and the prefix cache serves what it can (whole pages: the rest of the
  beam's last page is computed again each step).

Hypotheses are compared token by token with transformers'. Rounds run every system once in a
rotated order; times are medians.

    python bench/bench_beam_peers.py [--quick]

Needs transformers (the test extra). Writes bench/results/bench_beam_peers.json. Not in CI.
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

from radixkv.engine.beam_search import BeamSearch
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.tiny import tiny_tokenizer

RESULTS = results_path("bench_beam_peers")
WIDTH = 4

# (prompt ids, new tokens) -> each prompt's W hypotheses (output ids), best first
Run = Callable[[list[list[int]], int], list[list[list[int]]]]


def workloads(quick: bool) -> dict[str, tuple[list[str], int]]:
    """name -> (prompts, new tokens each)."""
    code = (ROOT / "radixkv" / "engine" / "scheduler.py").read_text()
    shared = code[:1000]  # radixkv-tiny's tokenizer is byte-level: ~1,000 tokens
    lines = [line for line in code[1000:].splitlines() if len(line.strip()) > 12][:8]
    prompts = [shared + "\n" + line + "\n" for line in lines]
    one = [code[4000:5500]]
    new = 8 if quick else 32
    return {"shared_prefix": (prompts[: 2 if quick else 8], new), "one_prompt": (one, new)}


def radixkv_system() -> Run:
    engine = Engine("radixkv-tiny", dtype="float32", num_pages=2048)

    def run(prompts: list[list[int]], new: int) -> list[list[list[int]]]:
        engine.reset_prefix_cache()
        params = SamplingParams(beam_width=WIDTH, n=WIDTH, max_tokens=new, ignore_eos=True)
        outs = engine.generate(prompts, params, use_tqdm=False)
        return [[o.token_ids for o in out.outputs] for out in outs]

    return run


def vllm_algorithm_system() -> Run:
    """vLLM's ``LLM.beam_search`` loop over radixkv's engine: a one-token request per beam per
    step; the same selection (BeamSearch) from each request's top 2W logprobs."""
    engine = Engine("radixkv-tiny", dtype="float32", num_pages=2048)
    vocab = engine.vocab_size

    def run(prompts: list[list[int]], new: int) -> list[list[list[int]]]:
        engine.reset_prefix_cache()
        step = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * WIDTH, ignore_eos=True)
        beam = SamplingParams(beam_width=WIDTH, n=WIDTH, max_tokens=new, ignore_eos=True)
        searches = [BeamSearch(beam, stop_ids=()) for _ in prompts]
        live: list[list[tuple[list[int], float]]] = [[([], 0.0)] for _ in prompts]
        while any(not s.done for s in searches):
            todo = [(i, b) for i, s in enumerate(searches) if not s.done for b in live[i]]
            outs = engine.generate([prompts[i] + b[0] for i, b in todo], step, use_tqdm=False)
            rows: dict[int, list[torch.Tensor]] = {}
            for (i, _), out in zip(todo, outs):
                row = torch.full((vocab,), -torch.inf)
                for tok, lp in out.outputs[0].logprobs[0].items():  # type: ignore[index]
                    row[tok] = lp.logprob
                rows.setdefault(i, []).append(row)
            for i, r in rows.items():
                beams = live[i]
                nxt = searches[i].step(
                    [c for _, c in beams],
                    torch.stack(r),
                    len(beams[0][0]),
                    lambda j, b=beams: b[j][0],
                )
                live[i] = [(beams[c.parent][0] + [c.token], c.cumulative_logprob) for c in nxt]
        return [[h.token_ids for h in s.finished] for s in searches]

    return run


def transformers_system(model: Any) -> Run:
    @torch.inference_mode()
    def run(prompts: list[list[int]], new: int) -> list[list[list[int]]]:
        return [
            hf_generate(model, torch.tensor([p]), new, hold_eos=True, num_beams=WIDTH,
                        num_return_sequences=WIDTH).tolist()
            for p in prompts
        ]  # fmt: skip

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(ap, RESULTS, quick="2 prompts, 8 new tokens, one round")
    args = ap.parse_args(argv)
    rounds = rounds_of(args)
    tok = tiny_tokenizer()
    systems: dict[str, Run] = {
        "radixkv": radixkv_system(),
        "transformers": transformers_system(tiny_hf_model()),
        "radixkv, vLLM's algorithm": vllm_algorithm_system(),
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
        for name in systems:
            rows.append(
                {
                    "workload": wname,
                    "system": name,
                    "prompts": len(prompts),
                    "prompt_tokens": sum(map(len, prompts)),
                    "new_tokens": new,
                    "seconds": round(secs[name], 3),
                    "same_as_transformers": identical(outs[name], outs["transformers"]),
                    "time_vs_radixkv": round(secs[name] / secs["radixkv"], 2),
                }
            )
    print_rows(rows)
    result = {
        "date": utc_now(),
        "machine": machine_dict(),
        "model": "radixkv-tiny (float32), the same weights in transformers",
        "beam_width": WIDTH,
        "rounds": rounds,
        "summary": rows,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
