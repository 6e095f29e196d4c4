"""radixkv against what its users would otherwise run, side by side in one process and one run.

One checkpoint for everyone: a random Llama (hidden 512, 4 layers, 8 heads / 4 KV heads of 64,
SwiGLU 1536, vocabulary 32,000), built with transformers and saved as a Hugging Face folder
in float32 (safetensors, a Llama-style byte-fallback tokenizer.json). The peers:

* ``transformers`` (sdpa attention), two ways: one batched ``generate`` over all prompts, and the
  shared-prefix recipe its docs give: prefill the prefix once into a ``DynamicCache``, then
  ``generate`` each request from a ``copy.deepcopy`` of it (also timed with the copy expanded to
  the whole batch, one batched ``generate``: whichever is faster is "transformers best");
* llama.cpp through ``llama-cpp-python`` (built from source on this machine), on GGUF files made
  from the same folder by the converter in llama.cpp's own source (``convert_hf_to_gguf.py``):
  f32, bf16 and q8_0. ``Llama.generate`` runs one sequence at a time and reuses the longest
  prefix its context shares with the previous request, which is its shared-prefix recipe.
  The KV cache is kept in the weights' precision (f32, bf16; llama.cpp's default f16 for q8_0).

Every system runs at both precisions where it has them: float32, and bfloat16 (radixkv's
``dtype="bfloat16"``, transformers' model in bf16, llama.cpp's bf16 GGUF). Two workloads, all
requests submitted at once, greedy, exactly ``--new`` tokens each (EOS ignored):

* ``shared_prefix``: 32 requests, a 2,048-token shared prefix + 64 unique tokens, 32 new tokens;
* ``no_sharing``: 32 requests of 2,112 unique tokens, 32 new tokens.

Timing: wall clock from the prompts' token ids to all output ids (radixkv's prefix cache is
emptied before each run; model loading and GGUF conversion are outside). ``--runs`` rounds
(default 3); in each round every (workload, system) runs once, in an order shuffled per round,
so a slow spell of a shared machine hits every system alike; the table gives the median of the
rounds (and every round's time in the JSON). Greedy outputs are compared token by token with
transformers' batched ``generate`` at the same precision (and, for bf16 and q8_0, with the float32
reference too): requests whose outputs are identical, and the mean number of leading tokens that
agree.

Close to the CPU's limit (``cpu_limit``): in the same run, the machine's matmul peak (the best of
square and model-shaped matmuls, fp32 and bf16) and radixkv-tiny's 4,096-token prefill in fp32
and bf16 as a share of it, interleaved, best of ``--peak-repeats``.

Writes bench/results/bench_peers.json. Usage::

    python bench/bench_peers.py [--quick] [--runs 3] [--workloads shared_prefix,no_sharing]
        [--systems radixkv,transformers,llama.cpp] [--converter PATH | --fetch-converter]

The llama.cpp part needs ``llama-cpp-python``, ``gguf`` and ``sentencepiece`` (the converter
imports it) and the converter script: ``--converter`` names convert_hf_to_gguf.py inside a
llama.cpp source tree; ``--fetch-converter`` downloads the sdist of the installed
llama-cpp-python with pip and takes the converter from its vendored llama.cpp (``nox -s
bench_peers`` does all of it).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peerkit import (
    CACHE,
    FIRST_ID,
    LLAMA,
    MODEL,
    ROOT,
    SEED,
    Checkpoint,
    System,
    Workload,
    add_gguf_arguments,
    agreement,
    build_checkpoint,
    checkpoint,
    convert,
    converter_from,
    cpu_limit,
    cpu_name,
    extract_converter,
    f32_checkpoint,
    fetch_converter,
    llama_cpp_system,
    machine_line,
    radixkv_system,
    results_path,
    rotated_rounds,
    timed,
    transformers_systems,
    utc_now,
    versions,
    write_json,
)

# what the other peer scripts (and the tests) import from here: peerkit's, re-exported
__all__ = [
    "CACHE", "FIRST_ID", "LLAMA", "MODEL", "RESULTS", "ROOT", "SEED", "Checkpoint", "System",
    "Workload", "add_gguf_arguments", "agreement", "build_checkpoint", "checkpoint", "convert",
    "cpu_limit", "cpu_name", "extract_converter", "f32_checkpoint", "fetch_converter",
    "llama_cpp_system", "main", "make_workloads", "radixkv_system", "rotated_rounds",
    "transformers_systems", "versions",
]  # fmt: skip

RESULTS = results_path("bench_peers")


def make_workloads(quick: bool, vocab: int) -> dict[str, Workload]:
    n, prefix, unique, new = (8, 512, 32, 8) if quick else (32, 2048, 64, 32)
    rng = random.Random(SEED)

    def toks(k: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab) for _ in range(k)]

    shared = toks(prefix)
    return {
        "shared_prefix": Workload(
            "shared_prefix", [shared + toks(unique) for _ in range(n)], new, prefix
        ),
        "no_sharing": Workload("no_sharing", [toks(prefix + unique) for _ in range(n)], new, 0),
    }


def main(
    argv: Sequence[str] | None = None,
    *,
    ckpt: Checkpoint = LLAMA,
    results: Path = RESULTS,
    description: str | None = None,
    peak_repeats: int = 7,
) -> int:
    """The benchmark on ``ckpt`` (other scripts run it on their own checkpoint: a different
    ``results`` file and ``description``; ``peak_repeats`` is ``--peak-repeats``'s default)."""
    ap = argparse.ArgumentParser(description=description or __doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 requests, 512 + 32 tokens, 8 new")
    ap.add_argument("--runs", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--workloads", default="shared_prefix,no_sharing")
    ap.add_argument("--systems", default="radixkv,transformers,llama.cpp")
    ap.add_argument("--precisions", default="float32,bfloat16,q8_0")
    add_gguf_arguments(ap)
    ap.add_argument("--peak-repeats", type=int, default=peak_repeats,
                    help="cpu_limit: best of N (0: skip)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=results)
    args = ap.parse_args(argv)

    from radixkv.model.cpu_bf16 import cpu_bf16

    engines = set(args.systems.split(","))
    precisions = set(args.precisions.split(","))
    folder = checkpoint(args.cache, ckpt)
    workloads = {k: v for k, v in make_workloads(args.quick, ckpt.config["vocab_size"]).items()
                 if k in args.workloads.split(",")}  # fmt: skip
    longest = max(len(p) for w in workloads.values() for p in w.prompts)
    max_tokens = longest + max(w.new_tokens for w in workloads.values())
    num_seqs = max(len(w.prompts) for w in workloads.values())
    systems: list[System] = []
    torch_dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for prec in ("float32", "bfloat16"):
        if prec not in precisions:
            continue
        if "radixkv" in engines:
            systems.append(radixkv_system(folder, prec, max_tokens, num_seqs))
        if "transformers" in engines:
            systems += transformers_systems(folder, torch_dtypes[prec])
    if "llama.cpp" in engines:
        converter = converter_from(args, ap, "llama.cpp needs its GGUF files")
        for outtype, prec in (("f32", "float32"), ("bf16", "bfloat16"), ("q8_0", "q8_0")):
            if prec in precisions:
                gguf = convert(folder, converter, outtype, args.cache, ckpt.tag,
                               ckpt.vocab_as_llama)  # fmt: skip
                systems.append(llama_cpp_system(gguf, outtype, max_tokens + 64))

    rng = random.Random(SEED)
    times: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    outputs: dict[str, dict[str, list[list[int]]]] = {w: {} for w in workloads}
    for rnd in range(args.runs):
        jobs = [(w, s) for w in workloads.values() for s in systems if s.applies(w)]
        rng.shuffle(jobs)
        for w, s in jobs:
            dt, out = timed(lambda w=w, s=s: s.run(w))
            times[w.name].setdefault(s.name, []).append(dt)
            prev = outputs[w.name].setdefault(s.name, out)
            if prev != out:  # greedy and deterministic: every round must answer the same
                raise RuntimeError(f"{s.name} answered {w.name} differently in round {rnd + 1}")
            print(f"round {rnd + 1}/{args.runs} {w.name:14s} {s.name:45s} {dt:8.2f} s", flush=True)

    results: dict[str, Any] = {}
    by_name = {s.name: s for s in systems}
    for wname, per in times.items():
        rows = []
        refs = {p: outputs[wname].get(f"transformers {p} batched") for p in torch_dtypes}
        radix = {p: statistics.median(per[f"radixkv {p}"]) for p in torch_dtypes
                 if f"radixkv {p}" in per}  # fmt: skip
        for sname, ts in per.items():
            s = by_name[sname]
            med = statistics.median(ts)
            row: dict[str, Any] = {"system": sname, "precision": s.precision,
                                   "median_s": med, "runs_s": ts, "note": s.note}  # fmt: skip
            same = "bfloat16" if s.precision == "bfloat16" else "float32"
            if same in radix and s.engine != "radixkv":
                row["vs_radixkv_same_precision"] = med / radix[same]
            for ref_prec, ref in refs.items():
                if ref is not None and (ref_prec == same or ref_prec == "float32"):
                    row[f"agreement_vs_transformers_{ref_prec}"] = agreement(
                        outputs[wname][sname], ref
                    )
            rows.append(row)
        results[wname] = rows

    bf16 = cpu_bf16()
    data: dict[str, Any] = {
        "machine": machine_line(),
        "date": utc_now(),
        "checkpoint": {
            "architecture": ckpt.model_class,
            **ckpt.config,
            "saved_dtype": "float32",
            "seed": SEED,
        },
        "cpu_native_bf16": {"native": bf16.native, "evidence": bf16.evidence},
        "torch_threads": torch.get_num_threads(),
        "versions": versions("torch", "transformers", "llama-cpp-python", "gguf", "radixkv"),
        "runs": args.runs,
        "quick": args.quick,
        "workloads": {w.name: _describe(w) for w in workloads.values()},
        **results,
    }
    if args.peak_repeats > 0:
        data["cpu_limit"] = cpu_limit(args.peak_repeats)
    write_json(args.out, data)
    _print_table(data, workloads)
    return 0


def _describe(w: Workload) -> dict[str, int]:
    return {
        "requests": len(w.prompts),
        "shared_prefix": w.shared_prefix,
        "prompt_tokens": w.prompt_tokens,
        "new_tokens": w.new_tokens,
    }


def _print_table(data: dict[str, Any], workloads: dict[str, Workload]) -> None:
    for wname in workloads:
        print(f"\n{wname}")
        for row in sorted(data[wname], key=lambda r: (r["precision"], r["median_s"])):
            ratio = row.get("vs_radixkv_same_precision")
            agree = row.get("agreement_vs_transformers_float32", {}).get("identical", "-")
            print(f"  {row['system']:45s} {row['median_s']:8.2f} s"
                  f"  {'' if ratio is None else f'{ratio:5.2f}x radixkv'}"
                  f"  fp32 agreement {agree}")  # fmt: skip
    lim = data.get("cpu_limit")
    for label in ("all_cores", "one_thread"):
        part = (lim or {}).get(label)
        if not part:
            continue
        for dt in ("float32", "bfloat16"):
            d = part[dt]
            print(
                f"{label} ({part['threads']} threads) {dt}: peak {d['peak_gflops']:.0f} GFLOP/s, "
                f"tiny prefill {d['prefill_s'] * 1e3:.0f} ms = {d['prefill_gflops']:.0f} "
                f"GFLOP/s = {d['prefill_share_of_peak']:.0%} of peak"
            )


if __name__ == "__main__":
    raise SystemExit(main())
