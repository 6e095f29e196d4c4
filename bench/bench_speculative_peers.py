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
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_peers  # noqa: E402

from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.params import SamplingParams  # noqa: E402
from radixkv.model.tiny import TINY_WEIGHTS, tiny_config, tiny_tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "bench_speculative_peers.json"
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


def hf_model() -> Any:
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    c = tiny_config()
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=False, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids), attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LlamaForCausalLM(cfg).float().eval()
    state = {k: v.float() for k, v in load_file(str(TINY_WEIGHTS)).items()}
    model.load_state_dict(state, strict=True)
    return model


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
        outs = []
        for p in prompts:
            kw: dict[str, Any] = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ids = model.generate(
                    torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw,
                )  # fmt: skip
            outs.append(ids[0, len(p) :].tolist())
        return outs

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 prompts a workload, one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    tok = tiny_tokenizer()
    hf = hf_model()
    systems: dict[str, Run] = {
        "radixkv": radixkv_system(0),
        f"radixkv, {DRAFTS} drafts": radixkv_system(DRAFTS),
        "transformers": transformers_system(hf, None),
        f"transformers, prompt lookup {DRAFTS}": transformers_system(hf, DRAFTS),
    }
    names = list(systems)
    rows = []
    for wname, (texts, new) in workloads(args.quick).items():
        prompts = [tok.encode(t) for t in texts]
        times, outs = bench_peers.rotated_rounds(
            {n: partial(run, prompts, new) for n, run in systems.items()},
            rounds,
            label=f"{wname} ",
        )
        ref = outs["transformers"]
        base = statistics.median(times[f"radixkv, {DRAFTS} drafts"])
        for name in names:
            secs = statistics.median(times[name])
            same = sum(a == b for a, b in zip(outs[name], ref))
            rows.append(
                {
                    "workload": wname,
                    "system": name,
                    "seconds": round(secs, 3),
                    "tokens": sum(len(o) for o in outs[name]),
                    "tok_per_s": round(sum(len(o) for o in outs[name]) / secs, 1),
                    "same_as_transformers": f"{same}/{len(prompts)}",
                    "time_vs_radixkv_drafts": round(secs / base, 2),
                }
            )
    for row in rows:
        print(row)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "model": "radixkv-tiny (float32), the same weights in transformers",
        "drafts": DRAFTS,
        "rounds": rounds,
        "summary": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
