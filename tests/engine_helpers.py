"""Helpers for the engine tests: a small saved HF Llama loaded into radixkv, workloads, a loop
that checks invariants after every step."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, hf_greedy, save_hf_folder

from radixkv.engine.engine import Engine
from radixkv.engine.outputs import Logprob, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.model.loader import load_model

VOCAB = 320  # _model_hf_builders.SMALL
MAX_CONTEXT = 512
LOGPROB_ATOL = 1e-4

# engine shapes each model family's greedy test runs through (page size 4 and 600 pages unless
# given): no prefix cache, small prefill chunks, page 16 with cascade decode forced on, a pool
# small enough to preempt
FAMILY_CONFIGS = [
    pytest.param(dict(enable_prefix_cache=False), id="cache-off"),
    pytest.param(dict(chunked_prefill_size=7, max_prefill_tokens=12), id="chunked"),
    pytest.param(dict(page_size=16, num_pages=100, cascade="on"), id="page-16-cascade"),
    pytest.param(dict(num_pages=40, max_running_requests=8), id="preempting"),
]


def engine_greedy_equals_transformers(
    hf: Any, folder: Path, cfg: dict[str, Any], params: SamplingParams
) -> Engine:
    """An engine on the checkpoint ``folder`` with ``cfg``: two waves of shared-prefix prompts
    (the second against a warm cache), invariants after every step, each output equal to
    transformers' greedy ``generate`` on ``hf``. Returns the engine, for further checks."""
    kw: dict[str, Any] = dict(page_size=4, num_pages=600) | cfg
    eng = Engine(load_model(folder), **kw)
    for wave in (0, 1):
        prompts = shared_prefix_prompts(wave, 6)
        for p, o in zip(prompts, run_checked(eng, prompts, params), strict=True):
            assert o.token_ids == hf_greedy(hf, p, params.max_tokens), (cfg, wave, p)
    return eng


# engine shapes the logprob tests run through: one batch, small prefill chunks, a pool that preempts
STEP_CONFIGS = [
    pytest.param(dict(), id="batched"),
    pytest.param(dict(chunked_prefill_size=7, max_prefill_tokens=12), id="chunked"),
    pytest.param(dict(num_pages=40, max_prefill_tokens=64), id="preempting"),
]


def check_logprob_entry(entry: dict[int, Logprob], tok: int, ref: torch.Tensor, top: int) -> None:
    """One position's logprob entry against ``ref [V]``, the reference log_softmax there:
    ``tok`` first, its logprob and rank, then up to ``top`` alternatives, each with its own
    logprob and among the ``top`` most likely."""
    assert next(iter(entry)) == tok  # the position's own token first
    lp = entry[tok]
    assert abs(lp.logprob - ref[tok].item()) <= LOGPROB_ATOL, (lp, ref[tok])
    better = int((ref > ref[tok] + LOGPROB_ATOL).sum())
    at_least = int((ref >= ref[tok] - LOGPROB_ATOL).sum())
    assert better + 1 <= lp.rank <= at_least, (lp.rank, better, at_least)
    alts = [t for t in entry if t != tok]
    assert len(entry) in (max(top, 1), top + 1) and len(alts) <= top
    kth = ref.topk(top).values[-1].item() if top else float("inf")
    for t, v in entry.items():
        assert abs(v.logprob - ref[t].item()) <= LOGPROB_ATOL
        assert v.decoded_token is not None
    for t in alts:
        assert entry[t].logprob >= kth - LOGPROB_ATOL  # the alternatives are the top ones


def make_small_llama(folder: Path) -> tuple[Any, Any]:
    """(transformers model, radixkv LoadedModel) of the same small random Llama."""
    from radixkv.model.loader import load_model

    hf = build_hf_model("llama", seed=3)
    save_hf_folder(hf, folder)
    return hf, load_model(folder)


def shared_prefix_prompts(seed: int, n: int = 10) -> list[list[int]]:
    """Prompts sharing a system prompt, some sharing more (few-shot), duplicates, a prompt that
    is a prefix of another, different lengths around page boundaries."""
    rng = random.Random(seed)
    tok = lambda k: [rng.randrange(3, VOCAB) for _ in range(k)]  # noqa: E731 (ids 0-2 special)
    system = tok(37)
    shot = tok(21)
    prompts = []
    for i in range(n):
        if i % 4 == 0:
            prompts.append(system + shot + tok(rng.randrange(1, 20)))
        elif i % 4 == 1:
            prompts.append(system + tok(rng.randrange(1, 40)))
        elif i % 4 == 2:
            prompts.append(list(prompts[-1]))  # duplicate
        else:
            prompts.append(tok(rng.randrange(2, 30)))
    prompts.append(system[:16])  # prefix of the others, page aligned at 16
    return prompts


def run_checked(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    check_every_step: bool = True,
) -> list[RequestOutput]:
    """Add all prompts, step to completion checking invariants after every step; outputs in
    input order. Asserts the drained state (zero locks, zero private pages)."""
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        if check_every_step:
            engine.check_invariants()
        steps += 1
        assert steps < 10_000, "engine did not drain"
    engine.check_invariants()
    return [done[i] for i in ids]


def scripted_sampler(script: list[int]) -> Any:
    """A stand-in for ``radixkv.engine.engine.sample`` (monkeypatch it) that writes ``script``,
    one token per sampling call (jump-forward off), each where the step's mask allows it and
    the best allowed token where it does not; past the script's end, its last token."""
    pos = [0]

    def sample(logits: torch.Tensor, params: Any, generators: Any) -> list[int]:
        tok = script[min(pos[0], len(script) - 1)]
        pos[0] += 1
        return [tok if torch.isfinite(row[tok]) else int(row.argmax()) for row in logits]

    return sample


def save_tiny_folder(name: str, folder: Path) -> Path:
    """radixkv-tiny(-random) as a Hugging Face checkpoint folder (config.json + safetensors)."""
    from safetensors.torch import save_file

    from radixkv.model.loader import load_model

    lm = load_model(name)
    c = lm.config
    folder.mkdir(parents=True)
    config = {
        "architectures": [c.architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in lm.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder
