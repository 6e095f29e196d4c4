"""``SamplingParams.logprobs``: every output token's log probability (and the top alternatives)
equals ``log_softmax`` of transformers' logits at that position, through batched decode, chunked
prefill, preemption and prefix-cache hits; requests without logprobs pay nothing for them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _model_hf_builders import hf_logits
from engine_helpers import (
    STEP_CONFIGS,
    check_logprob_entry,
    make_small_llama,
    run_checked,
    shared_prefix_prompts,
)

from radixkv.engine import engine as engine_module
from radixkv.engine.engine import Engine
from radixkv.engine.outputs import CompletionOutput
from radixkv.engine.params import SamplingParams

TOP = 4


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-logprobs"))


def _reference(hf: Any, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V]: log_softmax of transformers' logits at each output position."""
    logits = hf_logits(hf, prompt + out)
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(out) - 1], dim=-1)


def _check(hf: Any, prompt: list[int], c: CompletionOutput, top: int, *, greedy: bool) -> None:
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
    ref = _reference(hf, prompt, c.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        check_logprob_entry(entry, tok, ref[j], top)  # the sampled token first
        if greedy:
            assert entry[tok].rank == 1
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)


CONFIGS = STEP_CONFIGS


@pytest.mark.parametrize("cfg", CONFIGS)
def test_greedy_logprobs_equal_transformers(small: tuple[Any, Any], cfg: dict[str, Any]) -> None:
    hf, lm = small
    kw: dict[str, Any] = dict(page_size=4, num_pages=600)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=TOP)
    hits = 0
    for wave in (0, 0):  # the second wave hits the first's pages
        prompts = shared_prefix_prompts(wave)
        for p, o in zip(prompts, run_checked(eng, prompts, params)):
            _check(hf, p, o.outputs[0], TOP, greedy=True)
            hits += o.num_cached_tokens
    assert hits > 0
    if cfg.get("num_pages") == 40:
        assert eng.stats().num_preemptions > 0  # the tiny pool really preempted


def test_sampled_logprobs_are_the_raw_distribution(small: tuple[Any, Any]) -> None:
    """With temperature, top-k and min-p the logprobs are still the model's own distribution,
    and asking for them does not change which tokens are sampled."""
    hf, lm = small
    prompts = shared_prefix_prompts(2)[:4]
    kw: dict[str, Any] = dict(temperature=0.7, top_k=5, min_p=0.02, seed=5, n=2, max_tokens=8)
    eng = Engine(lm, page_size=4, num_pages=600)
    with_lp = eng.generate(prompts, SamplingParams(**kw, logprobs=2), use_tqdm=False)
    without = eng.generate(prompts, SamplingParams(**kw), use_tqdm=False)
    for p, a, b in zip(prompts, with_lp, without):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for c in a.outputs:
            _check(hf, p, c, 2, greedy=False)
            assert all(e[t].rank <= 5 for t, e in zip(c.token_ids, c.logprobs or []))  # top_k
        assert all(c.logprobs is None and c.cumulative_logprob is None for c in b.outputs)


def test_logprobs_zero_is_the_sampled_token_only(small: tuple[Any, Any]) -> None:
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=200)
    prompt = shared_prefix_prompts(3)[0]
    (o,) = eng.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=0), use_tqdm=False
    )
    c = o.outputs[0]
    assert c.logprobs is not None and [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]
    _check(hf, prompt, c, 0, greedy=True)


def test_streamed_outputs_carry_logprobs_of_every_token(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200)
    seen = []
    for out in eng.stream(list(range(3, 30)), SamplingParams(max_tokens=6, logprobs=1, seed=1)):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        seen.append(len(c.logprobs))
    assert seen == sorted(seen) and seen[-1] == 6


def test_no_logprobs_requested_costs_nothing(
    small: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("logprobs computed although no request asked for them")

    monkeypatch.setattr(engine_module, "step_logprobs", refuse)
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200)
    outs = eng.generate(
        shared_prefix_prompts(4)[:3], SamplingParams(max_tokens=4, seed=0), use_tqdm=False
    )
    assert all(c.logprobs is None for o in outs for c in o.outputs)
    # a request that asks for them reaches it (its failure ends that request alone)
    (out,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=0), use_tqdm=False)
    assert out.finish_reason == "error" and "no request asked" in (out.error or "")


def test_logprobs_validation(small: tuple[Any, Any]) -> None:
    _, lm = small
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=True)  # type: ignore[arg-type]
    eng = Engine(lm, page_size=4, num_pages=50)
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([3, 4], SamplingParams(logprobs=10_000))
    assert not eng.has_unfinished()
