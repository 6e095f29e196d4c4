"""Sliding-window attention at long context: radixkv against transformers on one windowed
checkpoint, side by side in one run.

The checkpoint: bench_peers.py's random model in Mistral's layout (hidden 512, 4 layers, 8
query and 4 kv heads of 64, vocabulary 32,000; float32) with ``sliding_window`` 1,024 and a
16,384-token context. The workload: 4 requests of 8,192 distinct tokens each, 32 greedy tokens.

Systems: radixkv as the config says (every layer reads its last 1,024 keys: prefill in query
chunks over the pages of their window, decode over the window's pages); radixkv on the same
weights with the window removed from config.json (full attention: what the window saves, and
what serving this model cost before radixkv had windows: its context was capped at the window);
transformers' batched ``generate`` on the windowed checkpoint (SDPA under its sliding mask).
Medians of interleaved rounds; greedy outputs of radixkv windowed against transformers', token
by token (fp32: they should agree).

    python bench/bench_window.py [--rounds 3] [--quick]

Writes bench/results/bench_window.json (docs/benchmarks.md via make_report.py).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from peerkit import (
    CACHE,
    MODEL,
    SEED,
    Checkpoint,
    Workload,
    add_round_arguments,
    agreement,
    checkpoint,
    load_average,
    machine_line,
    medians,
    radixkv_system,
    random_ids,
    results_path,
    rotated_rounds,
    rounds_of,
    transformers_systems,
    utc_now,
    versions,
    write_json,
)

RESULTS = results_path("bench_window")
WINDOW = 1024
MISTRAL = Checkpoint(
    f"mistral-h512-l4-v32000-w{WINDOW}-s{SEED}", "MistralConfig", "MistralForCausalLM",
    MODEL | {"sliding_window": WINDOW, "max_position_embeddings": 16384},
)  # fmt: skip


def unwindowed_copy(folder: Path) -> Path:
    """The same checkpoint with ``sliding_window`` null (full attention), weights linked."""
    out = folder.parent / (folder.name + "-full")
    out.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = None
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def workload(n: int, length: int, new: int, vocab: int) -> Workload:
    rng = random.Random(SEED)
    prompts = [random_ids(rng, length, vocab) for _ in range(n)]
    return Workload("long_context", prompts, new, 0)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_arguments(ap, RESULTS, quick="2 x 4,096 tokens, 8 new, 1 round")
    args = ap.parse_args(argv)
    n, length, new = (2, 4096, 8) if args.quick else (4, 8192, 32)
    rounds = rounds_of(args)
    started, load = utc_now(), load_average()
    torch.manual_seed(0)
    folder = checkpoint(CACHE, MISTRAL)
    full = unwindowed_copy(folder)
    w = workload(n, length, new, MODEL["vocab_size"])
    max_tokens = length + new
    windowed = radixkv_system(folder, "float32", max_tokens, n)
    plain = radixkv_system(full, "float32", max_tokens, n)
    hf = transformers_systems(folder, torch.float32)[0]  # one batched generate
    systems = {
        f"radixkv float32, window {WINDOW}": lambda: windowed.run(w),
        "radixkv float32, window removed (full attention)": lambda: plain.run(w),
        f"transformers float32 batched, window {WINDOW}": lambda: hf.run(w),
    }
    times, outs = rotated_rounds(systems, rounds)
    names = list(systems)
    ref = outs[names[2]]
    secs = medians(times)
    rows = []
    for name in names:
        row: dict[str, Any] = {"system": name, "seconds": round(secs[name], 2),
                               "vs_radixkv_windowed": round(secs[name] / secs[names[0]], 2)}  # fmt: skip
        if name != names[2]:
            row |= {"vs_transformers": agreement(outs[name], ref)["identical"]}
        rows.append(row)
    data = {
        "machine": machine_line(load),
        "date": started,
        "threads": torch.get_num_threads(), "rounds": rounds,
        "checkpoint": MISTRAL.tag, "sliding_window": WINDOW,
        "workload": {"requests": n, "prompt_tokens": length, "new_tokens": new},
        "versions": versions("torch", "transformers"),
        "summary": rows,
        "times_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
    }  # fmt: skip
    write_json(args.out, data)
    for r in rows:
        print(f"{r['system']:<52} {r['seconds']:>8.2f} s  x{r['vs_radixkv_windowed']:<5} "
              f"{r.get('vs_transformers', '')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
