"""Scoring items against a query (SGLang's ``/v1/score``), side by side in one run: radixkv's
``Engine.score`` against transformers on the same weights.

radixkv-tiny's trained weights (the package's safetensors, in float32) loaded into transformers'
``LlamaForCausalLM`` as well. The workload: a ~1,000-token query (a stretch of code) and 64
items (lines of code, 10 to 60 tokens each); for every item, the probability of 3 label tokens
as the next token after ``query + item``. Systems:

* ``radixkv``: ``Engine.score(query, items, labels)``: one request per item, all submitted
  together; the prefix cache computes the query once (reset before every round);
* ``transformers batched``: the 64 prompts in batches of 16, right-padded with an attention
  mask, one forward per batch; each row's logits at its last real token;
* ``transformers query cache``: the query prefilled once into a ``DynamicCache``, then each
  batch of 16 items run on a copy of it repeated to the batch (the shared-prefix recipe of
  transformers' docs, as in bench_peers.py).

Scores are compared with transformers batched (largest absolute difference of a probability).
Rounds run every system once in a rotated order; times are medians.

    python bench/bench_score_peers.py [--quick]

Needs transformers (the test extra). Writes bench/results/bench_score_peers.json. Not in CI.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from peerkit import (
    ROOT,
    add_round_arguments,
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
from radixkv.model.tiny import tiny_tokenizer

RESULTS = results_path("bench_score_peers")
BATCH = 16  # transformers' items per forward

# (query ids, item ids, labels) -> per item, the labels' probabilities
Run = Callable[[list[int], list[list[int]], list[int]], list[list[float]]]


def workload(quick: bool) -> tuple[list[int], list[list[int]], list[int]]:
    tok = tiny_tokenizer()
    code = (ROOT / "radixkv" / "engine" / "scheduler.py").read_text()
    query = tok.encode(code[:1000])  # byte-level: ~1,000 tokens
    lines = [ln for ln in code[1000:].splitlines() if 10 <= len(ln.strip()) <= 60]
    items = [tok.encode("\n" + ln, add_special_tokens=False) for ln in lines[: 8 if quick else 64]]
    labels = [tok.encode(c, add_special_tokens=False)[-1] for c in ("\n", " ", "(")]
    return query, items, labels


def radixkv_system() -> Run:
    engine = Engine("radixkv-tiny", dtype="float32", num_pages=4096)

    def run(query: list[int], items: list[list[int]], labels: list[int]) -> list[list[float]]:
        engine.reset_prefix_cache()
        return engine.score(query, items, labels)

    return run


def _label_probs(logits: torch.Tensor, labels: list[int]) -> list[list[float]]:
    """[B, V] logits -> per row the labels' probabilities under the whole vocabulary."""
    return torch.softmax(logits.float(), dim=-1)[:, labels].tolist()


def _padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], their attention mask and each row's last real index."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask, torch.tensor([len(r) - 1 for r in rows])


def transformers_batched(model: Any) -> Run:
    @torch.inference_mode()
    def run(query: list[int], items: list[list[int]], labels: list[int]) -> list[list[float]]:
        out: list[list[float]] = []
        for a in range(0, len(items), BATCH):
            ids, mask, last = _padded([query + it for it in items[a : a + BATCH]])
            logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
            out += _label_probs(logits[torch.arange(len(last)), last], labels)
        return out

    return run


def transformers_query_cache(model: Any) -> Run:
    from transformers import DynamicCache

    @torch.inference_mode()
    def run(query: list[int], items: list[list[int]], labels: list[int]) -> list[list[float]]:
        cache = DynamicCache(config=model.config)
        model(torch.tensor([query]), past_key_values=cache, logits_to_keep=1)
        out: list[list[float]] = []
        for a in range(0, len(items), BATCH):
            ids, mask, last = _padded(items[a : a + BATCH])
            c = copy.deepcopy(cache)
            c.batch_repeat_interleave(len(last))
            full = torch.cat([torch.ones(len(last), len(query), dtype=torch.long), mask], dim=1)
            logits = model(input_ids=ids, attention_mask=full, past_key_values=c).logits
            out += _label_probs(logits[torch.arange(len(last)), last], labels)
        return out

    return run


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(ap, RESULTS, quick="8 items, one round")
    args = ap.parse_args(argv)
    rounds = rounds_of(args)
    query, items, labels = workload(args.quick)
    model = tiny_hf_model()
    systems: dict[str, Run] = {
        "radixkv": radixkv_system(),
        "transformers batched": transformers_batched(model),
        "transformers query cache": transformers_query_cache(model),
    }
    times, outs = rotated_rounds(
        {n: (lambda run=run: run(query, items, labels)) for n, run in systems.items()}, rounds
    )
    ref = outs["transformers batched"]
    secs = medians(times)
    rows = []
    for name in systems:
        diff = max(abs(a - b) for x, y in zip(outs[name], ref) for a, b in zip(x, y))
        rows.append(
            {
                "system": name,
                "seconds": round(secs[name], 3),
                "items_per_second": round(len(items) / secs[name], 1),
                "max_abs_diff_vs_transformers": float(f"{diff:.2e}"),
                "time_vs_radixkv": round(secs[name] / secs["radixkv"], 2),
            }
        )
    print_rows(rows)
    result = {
        "date": utc_now(),
        "machine": machine_dict(),
        "model": "radixkv-tiny (float32), the same weights in transformers",
        "workload": {
            "query_tokens": len(query),
            "items": len(items),
            "item_tokens": sum(map(len, items)),
            "labels": len(labels),
            "transformers_batch": BATCH,
        },
        "rounds": rounds,
        "summary": rows,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
