"""A mixture-of-experts model against the peers: bench_peers.py on a random Qwen3-MoE.

The checkpoint: bench_peers.py's Llama shapes (hidden 512, 4 layers, 8 heads / 4 KV heads of
64, vocabulary 32,000) as ``Qwen3MoeForCausalLM``: q/k RMSNorm, and in every layer 32 experts
of SwiGLU width 384 of which each token runs 4 (renormalized top-4), so a token computes as
much as in the dense model's 1,536-wide MLP while the layer stores 8x its weights, as in
Qwen3-30B-A3B (128 experts, 8 active). Saved in float32 by transformers, converted to GGUF by
llama.cpp's own converter.

Everything else is bench_peers.py's: the same two workloads (32 requests, a 2,048-token shared
prefix + 64 unique tokens or 2,112 unique tokens, 32 greedy new tokens), the same systems
(radixkv's Engine; transformers batched and with its prefix-cache recipe; llama.cpp f32, bf16
and q8_0 one sequence at a time), float32 and bfloat16, interleaved rounds, medians, greedy
outputs compared token by token with transformers'. Usage::

    python bench/bench_moe_peers.py [--quick] [--runs 3] [--systems ...] [--fetch-converter]

Writes bench/results/bench_moe_peers.json. Not in CI.
"""

from __future__ import annotations

from collections.abc import Sequence

import bench_peers
from peerkit import results_path

RESULTS = results_path("bench_moe_peers")

QWEN3_MOE = bench_peers.Checkpoint(
    tag=f"qwen3moe-h512-l4-e32k4-v32000-s{bench_peers.SEED}",
    config_class="Qwen3MoeConfig",
    model_class="Qwen3MoeForCausalLM",
    config={
        **bench_peers.MODEL,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 384,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    vocab_as_llama=("conversion.qwen", "Qwen3MoeModel"),
)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_peers.main(
        argv,
        ckpt=QWEN3_MOE,
        results=RESULTS,
        description=__doc__.splitlines()[0],
        peak_repeats=0,  # the CPU's matmul peak is bench_peers.py's part
    )


if __name__ == "__main__":
    raise SystemExit(main())
