"""Multi-LoRA serving, side by side in one run: radixkv against transformers + PEFT, on the same
checkpoint and the same adapters.

bench_peers.py's random Llama (hidden 512, 4 layers, vocabulary 32,000), float32 on both sides,
and four random PEFT LoRA adapters of it (rank 16, alpha 16, on all seven linear layers:
q/k/v/o_proj and gate/up/down_proj), made with PEFT's ``get_peft_model`` and random factors
large enough to change greedy outputs, saved with ``save_pretrained`` (cached beside the
checkpoint). radixkv loads them by name (``Engine(lora_modules=...)``); PEFT loads them into one
``PeftModel`` (``from_pretrained`` for the first, ``load_adapter`` for the others).

The workload is a multi-tenant fine-tune service: 32 requests, 8 per adapter, the adapters
interleaved (request ``i`` uses adapter ``i % 4``); each adapter has its own 1,024-token system
prompt shared by its 8 requests, followed by 48-80 unique tokens of each request's own;
32 greedy new tokens each (EOS ignored: every system does the same work). Random token ids.

Systems, each timed end to end from the prompts' token ids to all output ids (radixkv's
prefix cache emptied before each run; model and adapter loading outside the timing):

* radixkv with the adapters: all 32 requests submitted at once, each with its adapter
  (``generate(..., lora=[...])``): mixed continuous batches, the prefix cache on (each
  adapter's requests share its system prompt's KV; never across adapters);
* radixkv on the base model: the same prompts without adapters (a second engine with none
  loaded), so the difference is radixkv's LoRA overhead;
* transformers + PEFT, one mixed batch: ``generate(input_ids, attention_mask,
  adapter_names=[...per row...])`` on the 32 rows, left-padded (PEFT's mixed-batch inference);
* transformers + PEFT, the usual recipe: ``set_adapter(name)`` then one batched ``generate``
  per adapter (8 rows each, left-padded);
* transformers on the base model (a plain ``LlamaForCausalLM``, no PEFT): one batched
  ``generate`` of the same 32 rows, the reference for radixkv's base run and PEFT's overhead.

transformers runs sdpa attention and has no prefix sharing across requests. Greedy outputs are
compared token by token: radixkv's adapter run with both PEFT systems, radixkv's base run with
transformers' base run (``identical``: requests whose 32 tokens all agree). Rounds run every
system once in a rotated order (peerkit.rotated_rounds); times are medians.

    python bench/bench_lora_peers.py [--quick] [--rounds 3] [--out PATH]

Needs transformers and peft (the test extra). Writes bench/results/bench_lora_peers.json.
Not in CI.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from peerkit import (
    CACHE,
    SEED,
    add_round_arguments,
    agreement,
    greedy,
    hf_generate,
    hf_model,
    machine_line,
    medians,
    peer_engine,
    print_rows,
    quiet,
    random_ids,
    results_path,
    rotated_rounds,
    rounds_of,
    utc_now,
    versions,
    write_json,
)
from peerkit import checkpoint as peer_checkpoint

RESULTS = results_path("bench_lora_peers")
ADAPTERS = 4
RANK = 16
ALPHA = 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PAD = 0  # <unk>: never in a prompt (prompts use ids from peerkit.FIRST_ID on)


# ---- the adapters --------------------------------------------------------------------------------
def _adapter_tag(checkpoint: Path, i: int) -> str:
    return f"{checkpoint.name}-lora-r{RANK}-a{ALPHA}-all-s{SEED + i}"


@torch.no_grad()
def make_adapters(checkpoint: Path, cache: Path, n: int) -> list[Path]:
    """``n`` random PEFT LoRA adapters of ``checkpoint`` saved with PEFT's ``save_pretrained``
    under ``cache`` (reused when there already): rank 16 on all seven linear layers, factors
    ``A, B ~ N(0, 1 / fan_in)`` so that each delta is about as large as the layer's own output
    (enough to change greedy outputs)."""
    folders = [cache / _adapter_tag(checkpoint, i) for i in range(n)]
    if all((f / "radixkv_bench.json").is_file() for f in folders):
        return folders
    from peft import LoraConfig, get_peft_model

    base = hf_model(checkpoint)
    for i, folder in enumerate(folders):
        if (folder / "radixkv_bench.json").is_file():
            continue
        cfg = LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=MODULES,
            lora_dropout=0.0,
            init_lora_weights=False,
        )
        with quiet():
            model = get_peft_model(copy.deepcopy(base), cfg)
        gen = torch.Generator().manual_seed(SEED + i)
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:  # A [r, in], B [out, r]
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        folder.mkdir(parents=True, exist_ok=True)
        with quiet():
            model.save_pretrained(folder)
        tag = _adapter_tag(checkpoint, i)
        (folder / "radixkv_bench.json").write_text(json.dumps({"tag": tag}))
    return folders


# ---- the workload --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    adapters: list[str]  # one adapter name per prompt
    system_prompt: int  # tokens each adapter's requests share
    new_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(quick: bool, names: list[str]) -> Workload:
    """Request ``i`` runs adapter ``i % len(names)``: its system prompt, then unique tokens."""
    n, system, (lo, hi), new = (8, 128, (16, 32), 8) if quick else (32, 1024, (48, 80), 32)
    rng = random.Random(SEED)
    systems = [random_ids(rng, system) for _ in names]
    prompts, adapters = [], []
    for i in range(n):
        a = i % len(names)
        prompts.append(systems[a] + random_ids(rng, rng.randint(lo, hi)))
        adapters.append(names[a])
    return Workload(prompts, adapters, system, new)


# ---- systems -------------------------------------------------------------------------------------
Run = Callable[[Workload], list[list[int]]]  # the workload -> each prompt's new token ids


@dataclass
class RadixRun:
    """The last run's prompt tokens served from the prefix cache (for the JSON)."""

    cached_tokens: int = 0


def radixkv_system(
    checkpoint: Path, loras: dict[str, Path] | None, w: Workload, stats: RadixRun
) -> Run:
    max_tokens = max(len(p) for p in w.prompts) + w.new_tokens
    modules = {k: str(v) for k, v in loras.items()} if loras else None
    engine = peer_engine(checkpoint, "float32", max_tokens, len(w.prompts), lora_modules=modules)

    def run(w: Workload) -> list[list[int]]:
        engine.reset_prefix_cache()  # every run starts cold, like the peers'
        outs = engine.generate(
            w.prompts, greedy(w.new_tokens), use_tqdm=False, lora=w.adapters if loras else None
        )
        engine.check_invariants()
        stats.cached_tokens = sum(o.num_cached_tokens for o in outs)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def peft_model(checkpoint: Path, loras: dict[str, Path]) -> Any:
    """One PeftModel holding every adapter under its name."""
    from peft import PeftModel

    names = list(loras)
    with quiet():
        model = PeftModel.from_pretrained(
            hf_model(checkpoint), str(loras[names[0]]), adapter_name=names[0]
        )
        for name in names[1:]:
            model.load_adapter(str(loras[name]), adapter_name=name)
    return model.eval()


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(model: Any, prompts: list[list[int]], new: int, **kw: Any) -> list[list[int]]:
    ids, mask = _left_padded(prompts)
    return hf_generate(model, ids, new, attention_mask=mask, **kw).tolist()


def peft_mixed_system(model: Any) -> Run:
    @torch.inference_mode()
    def run(w: Workload) -> list[list[int]]:
        return _generate(model, w.prompts, w.new_tokens, adapter_names=w.adapters)

    return run


def peft_per_adapter_system(model: Any) -> Run:
    @torch.inference_mode()
    def run(w: Workload) -> list[list[int]]:
        outs: list[list[int] | None] = [None] * len(w.prompts)
        for name in dict.fromkeys(w.adapters):
            rows = [i for i, a in enumerate(w.adapters) if a == name]
            model.set_adapter(name)
            got = _generate(model, [w.prompts[i] for i in rows], w.new_tokens)
            for i, o in zip(rows, got, strict=True):
                outs[i] = o
        return [o for o in outs if o is not None]

    return run


def hf_base_system(model: Any) -> Run:
    @torch.inference_mode()
    def run(w: Workload) -> list[list[int]]:
        return _generate(model, w.prompts, w.new_tokens)

    return run


def lora_delta_seconds(run: Run, w: Workload) -> dict[str, Any]:
    """Where radixkv's LoRA time goes: one more (untimed) run of ``run`` with the adapters'
    per-layer deltas (``LoRALayer.add_delta``: two thin products per adapter group, or for
    several adapters two stacked products) timed; calls of more than 64 rows counted as
    prefill, the rest as decode."""
    from radixkv.model import lora

    inner = lora.LoRALayer.add_delta
    acc = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_calls": 0, "decode_calls": 0}

    def timed(self: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        t0 = time.perf_counter()
        inner(self, x, y)
        kind = "prefill" if x.shape[0] > 64 else "decode"
        acc[f"{kind}_s"] += time.perf_counter() - t0
        acc[f"{kind}_calls"] += 1

    lora.LoRALayer.add_delta = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        run(w)
        total = time.perf_counter() - t0
    finally:
        lora.LoRALayer.add_delta = inner  # type: ignore[method-assign]
    return {"run_s": round(total, 3), **{k: round(v, 3) for k, v in acc.items()}}


# ---- main ----------------------------------------------------------------------------------------
RADIX_LORA = "radixkv, 4 adapters (one mixed batch)"
RADIX_BASE = "radixkv, base model (no adapters)"
PEFT_MIXED = "transformers + PEFT, one mixed batch (adapter_names)"
PEFT_EACH = "transformers + PEFT, set_adapter + one batch per adapter"
HF_BASE = "transformers, base model (no adapters)"
# each system's outputs are checked against this one's
COMPARED_WITH = {
    RADIX_LORA: PEFT_MIXED,
    RADIX_BASE: HF_BASE,
    PEFT_MIXED: RADIX_LORA,
    PEFT_EACH: RADIX_LORA,
    HF_BASE: RADIX_BASE,
}
OVERHEAD = {RADIX_LORA: RADIX_BASE, PEFT_MIXED: HF_BASE, PEFT_EACH: HF_BASE}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(ap, RESULTS, quick="8 requests, 128 + 16-32 tokens, 8 new, one round")
    ap.add_argument("--cache", type=Path, default=CACHE, help="checkpoint and adapter folders")
    args = ap.parse_args(argv)
    rounds = rounds_of(args)

    checkpoint = peer_checkpoint(args.cache)
    folders = make_adapters(checkpoint, args.cache, ADAPTERS)
    loras = {f"tenant{i}": f for i, f in enumerate(folders)}
    w = make_workload(args.quick, list(loras))
    radix_lora, radix_base = RadixRun(), RadixRun()
    peft = peft_model(checkpoint, loras)
    systems: dict[str, Run] = {
        RADIX_LORA: radixkv_system(checkpoint, loras, w, radix_lora),
        RADIX_BASE: radixkv_system(checkpoint, None, w, radix_base),
        PEFT_MIXED: peft_mixed_system(peft),
        PEFT_EACH: peft_per_adapter_system(peft),
        HF_BASE: hf_base_system(hf_model(checkpoint)),
    }
    times, outs = rotated_rounds({name: partial(run, w) for name, run in systems.items()}, rounds)

    delta = lora_delta_seconds(systems[RADIX_LORA], w)
    secs = medians(times)
    rows = []
    for name in systems:
        tokens = sum(len(o) for o in outs[name])
        agree = agreement(outs[name], outs[COMPARED_WITH[name]])
        rows.append(
            {
                "system": name,
                "seconds": round(secs[name], 3),
                "runs_s": [round(t, 3) for t in times[name]],
                "output_tokens": tokens,
                "output_tok_per_s": round(tokens / secs[name], 1),
                "time_vs_radixkv": round(secs[name] / secs[RADIX_LORA], 2),
            }
        )
        if name in OVERHEAD:  # the time over the same library's base-model run
            rows[-1]["lora_overhead"] = round(secs[name] / secs[OVERHEAD[name]], 2)
        rows[-1]["compared_with"] = COMPARED_WITH[name]
        rows[-1]["identical"] = agree["identical"]
        rows[-1]["mean_agreeing_prefix"] = round(agree["mean_agreeing_prefix"], 2)
    print_rows(rows)
    changed = sum(a != b for a, b in zip(outs[RADIX_LORA], outs[RADIX_BASE], strict=True))
    result = {
        "date": utc_now(),
        "machine": machine_line(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "versions": versions("torch", "transformers", "peft", "radixkv"),
        "checkpoint": checkpoint.name,  # the model tag (peerkit.checkpoint)
        "adapters": {
            "count": ADAPTERS,
            "rank": RANK,
            "lora_alpha": ALPHA,
            "target_modules": MODULES,
            "made_with": "peft get_peft_model, random factors, save_pretrained",
        },
        "workload": {
            "requests": len(w.prompts),
            "per_adapter": len(w.prompts) // ADAPTERS,
            "system_prompt_tokens": w.system_prompt,
            "unique_tokens": [
                min(len(p) for p in w.prompts) - w.system_prompt,
                max(len(p) for p in w.prompts) - w.system_prompt,
            ],
            "prompt_tokens": w.prompt_tokens,
            "new_tokens": w.new_tokens,
            "greedy": True,
            "rounds": rounds,
            "quick": args.quick,
        },
        "radixkv_cached_prompt_tokens": {
            "adapters": radix_lora.cached_tokens,
            "base": radix_base.cached_tokens,
        },
        "adapters_change_outputs": f"{changed}/{len(w.prompts)}",
        # one more radixkv run with adapters, its per-layer LoRA deltas timed (untimed otherwise)
        "radixkv_lora_delta_time": delta,
        "summary": rows,
    }
    print(f"adapter outputs differing from the base model's: {changed}/{len(w.prompts)}")
    print(f"radixkv's LoRA deltas in one more run: {delta}")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
