"""What hybrid window KV buys: the same KV memory caches more, for a sliding-window model.

The checkpoint: bench_peers.py's random model in Qwen3's layout with Gemma 3's mix of layers
(6 layers, the first five with a 512-token sliding window, the last in full; hidden 512, 8
query and 4 kv heads of 64, vocabulary 32,000; float32). The workload, document questions: 8
documents of 1,536 tokens, asked 3 questions each (16 tokens, 8 greedy tokens answered) in
turn, document 1 to 8 then again, one request at a time, under a KV budget that holds about 5
of the documents with every token's K/V in every layer.

Systems, interleaved, each on the same budget: radixkv with ``window_kv="full"`` (every
layer keeps every cached token's K/V), and with hybrid window KV at ``window_kv_ratio`` 0.75,
0.5 and 0.25 (the windowed layers keep K/V in window slots; the same bytes hold 1.3x, 1.7x and
2.7x the pages, with fewer slots each time). Reported per system: pages and window slots in the budget, the prefix-cache hit rate,
the mean time per request (each is mostly its prefill: its time to first token), the whole
run, and whether every output equals the full-KV system's (greedy, fp32: they must). The first
round's 8 outputs are also compared with transformers' greedy generate.

    python bench/bench_window_kv.py [--rounds 3] [--quick]

Writes bench/results/bench_window_kv.json (docs/benchmarks.md via make_report.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from peerkit import (
    CACHE,
    MODEL,
    SEED,
    Checkpoint,
    add_round_arguments,
    checkpoint,
    greedy,
    hf_generate,
    hf_model,
    load_average,
    machine_line,
    random_ids,
    results_path,
    rotated_rounds_all,
    rounds_of,
    utc_now,
    versions,
    write_json,
)

RESULTS = results_path("bench_window_kv")
WINDOW = 512
LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
GEMMA3_MIX = Checkpoint(
    f"qwen3-h512-l6-w{WINDOW}-5to1-v32000-s{SEED}", "Qwen3Config", "Qwen3ForCausalLM",
    MODEL | {"num_hidden_layers": 6, "head_dim": 64, "use_sliding_window": True,
             "sliding_window": WINDOW, "max_window_layers": 0, "layer_types": LAYERS,
             "max_position_embeddings": 8192},
)  # fmt: skip
PAGE = 16


def requests(docs: int, doc_tokens: int, questions: int) -> list[list[int]]:
    """Each document's questions, documents in turn: d1q1, d2q1, ..., d1q2, ..."""
    rng = random.Random(SEED)
    tok = lambda n: random_ids(rng, n)  # noqa: E731
    texts = [tok(doc_tokens) for _ in range(docs)]
    asks = [[tok(16) for _ in range(questions)] for _ in range(docs)]
    return [texts[d] + asks[d][q] for q in range(questions) for d in range(docs)]


def run_system(engine: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    engine.reset_prefix_cache()  # every round starts cold
    before = engine.stats()
    params = greedy(new)
    outs, times = [], []
    t0 = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        (o,) = engine.generate([p], params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        outs.append(list(o.token_ids))
    total = time.perf_counter() - t0
    engine.check_invariants()
    st = engine.stats()
    hits = st.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    queried = st.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    return {
        "seconds": total,
        "mean_request_s": statistics.mean(times),
        "hit_rate": hits / max(1, queried),
        "trimmed_tokens": st.window_trimmed_tokens - before.window_trimmed_tokens,
        "outputs": outs,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_round_arguments(ap, RESULTS, quick="4 documents of 768 tokens, 1 round")
    args = ap.parse_args(argv)
    docs, doc_tokens, questions, new = (4, 768, 2, 4) if args.quick else (8, 1536, 3, 8)
    rounds = rounds_of(args)
    started, load = utc_now(), load_average()
    torch.manual_seed(0)
    folder = checkpoint(CACHE, GEMMA3_MIX)
    prompts = requests(docs, doc_tokens, questions)

    from radixkv.engine.engine import Engine
    from radixkv.kv.kv_pool import KVPool

    heads, dim = MODEL["num_key_value_heads"], 64
    per_token = KVPool.page_bytes(len(LAYERS), PAGE, heads, dim, torch.float32) // PAGE
    # about 5 documents' worth of every layer's K/V: fewer than the 8 asked about in turn
    budget = int(5.2 * (doc_tokens + 16 + new) * per_token)
    configs = {
        "full KV (window_kv=full)": {"window_kv": "full"},
        "hybrid window KV, ratio 0.75": {"window_kv": "hybrid", "window_kv_ratio": 0.75},
        "hybrid window KV, ratio 0.5 (default)": {"window_kv": "hybrid", "window_kv_ratio": 0.5},
        "hybrid window KV, ratio 0.25": {"window_kv": "hybrid", "window_kv_ratio": 0.25},
    }
    common = dict(dtype="float32", device="cpu", page_size=PAGE, kv_cache_memory=budget)
    engines = {name: Engine(str(folder), **common, **cfg) for name, cfg in configs.items()}
    names = list(engines)
    _, runs = rotated_rounds_all(
        {name: (lambda e=e: run_system(e, prompts, new)) for name, e in engines.items()}, rounds
    )

    hf = hf_model(folder, torch.float32, attn_implementation=None)
    with torch.no_grad():
        hf_first = [
            hf_generate(hf, torch.tensor([p]), new, hold_eos=True)[0].tolist()
            for p in prompts[:docs]
        ]

    ref = runs[names[0]][-1]["outputs"]
    rows = []
    for name in names:
        eng, rs = engines[name], runs[name]
        kv = eng.kv_pool
        rows.append({
            "system": name,
            "pages": kv.num_pages,
            "window_slots": getattr(kv, "num_slots", 0),
            "kv_mib": round(kv.total_bytes / 2**20, 1),
            "cacheable_tokens": kv.num_pages * PAGE,
            "hit_rate": round(statistics.median(x["hit_rate"] for x in rs), 3),
            "mean_request_s": round(statistics.median(x["mean_request_s"] for x in rs), 3),
            "seconds": round(statistics.median(x["seconds"] for x in rs), 2),
            "trimmed_tokens": rs[-1]["trimmed_tokens"],
            "same_outputs_as_full": all(x["outputs"] == ref for x in rs),
            "first_round_vs_transformers": sum(
                a == b for a, b in zip(rs[-1]["outputs"][:docs], hf_first, strict=True)
            ),
        })  # fmt: skip
    base = rows[0]["seconds"]
    for row in rows:
        row["speedup_vs_full"] = round(base / row["seconds"], 2)
    data = {
        "machine": machine_line(load),
        "date": started,
        "threads": torch.get_num_threads(), "rounds": rounds,
        "checkpoint": GEMMA3_MIX.tag, "sliding_window": WINDOW, "layers": LAYERS,
        "kv_budget_mib": round(budget / 2**20, 1),
        "workload": {"documents": docs, "document_tokens": doc_tokens,
                     "questions_each": questions, "question_tokens": 16, "new_tokens": new,
                     "order": "each document once, in turn, then again"},
        "versions": versions("torch", "transformers"),
        "summary": rows,
        "times_s": {n: [round(x["seconds"], 3) for x in runs[n]] for n in names},
    }  # fmt: skip
    write_json(args.out, data)
    for r in rows:
        print(f"{r['system']:<30} pages {r['pages']:>5} slots {r['window_slots']:>5} "
              f"hit {r['hit_rate']:.3f} req {r['mean_request_s']:.3f} s total {r['seconds']:.2f} s "
              f"x{r['speedup_vs_full']} same={r['same_outputs_as_full']} "
              f"hf {r['first_round_vs_transformers']}/{docs}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
