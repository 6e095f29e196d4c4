"""``SamplingParams.prompt_logprobs``: every prompt token's log probability (and the top
alternatives) equals ``log_softmax`` of transformers' logits at the position before it, through
batched and chunked prefill, preemption, ``n > 1`` and a prompt already in the prefix cache
(which such a request recomputes, leaving the cache as it was); requests that do not ask pay
nothing, and the generated tokens do not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _model_hf_builders import hf_logits
from engine_helpers import (
    LOGPROB_ATOL,
    STEP_CONFIGS,
    check_logprob_entry,
    make_small_llama,
    run_checked,
    shared_prefix_prompts,
)

from radixkv.engine import logprobs as logprobs_module
from radixkv.engine.engine import Engine
from radixkv.engine.outputs import Logprob, RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.model.runner import ModelRunner

TOP = 3


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-prompt-logprobs"))


def _check(hf: Any, prompt: list[int], entries: list[dict[int, Logprob] | None], top: int) -> None:
    """``entries`` are transformers' log_softmax at each prompt position, ranks and top-k."""
    assert len(entries) == len(prompt) and entries[0] is None
    ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # [P, V]
    for j in range(1, len(prompt)):
        entry = entries[j]
        assert entry is not None
        check_logprob_entry(entry, prompt[j], ref[j - 1], top)  # the prompt's own token first


@pytest.mark.parametrize("cfg", STEP_CONFIGS)
def test_prompt_logprobs_equal_transformers(small: tuple[Any, Any], cfg: dict[str, Any]) -> None:
    """A warm cache (the first wave's prompts, then the same prompts again asking for prompt
    logprobs): values exact, nothing reused by the asking requests, the same greedy tokens."""
    hf, lm = small
    kw: dict[str, Any] = dict(page_size=4, num_pages=600)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    prompts = shared_prefix_prompts(7)
    plain = run_checked(eng, prompts, SamplingParams(temperature=0.0, max_tokens=6))
    asked = run_checked(
        eng, prompts, SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=TOP)
    )
    for p, a, b in zip(prompts, asked, plain):
        assert a.prompt_logprobs is not None
        _check(hf, p, a.prompt_logprobs, TOP)
        assert a.num_cached_tokens == 0  # every prompt position's output was computed
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.prompt_logprobs is None
    if cfg.get("num_pages") == 40:
        assert eng.stats().num_preemptions > 0  # the tiny pool really preempted


def test_recomputed_prefix_stays_cached(small: tuple[Any, Any]) -> None:
    """The prompt's pages, already cached, are computed again as duplicates and given back: the
    trie keeps its pages, every page is accounted for, and the next plain request hits."""
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200)
    prompt = shared_prefix_prompts(8)[0]
    (first,) = run_checked(eng, [prompt], SamplingParams(max_tokens=3, seed=0))
    cached = eng.stats().cached_pages
    (asked,) = run_checked(eng, [prompt], SamplingParams(max_tokens=3, seed=0, prompt_logprobs=0))
    assert asked.num_cached_tokens == 0 and asked.prompt_logprobs is not None
    assert [list(e) for e in asked.prompt_logprobs[1:]] == [[t] for t in prompt[1:]]
    assert eng.stats().cached_pages >= cached
    (again,) = run_checked(eng, [prompt], SamplingParams(max_tokens=3, seed=0))
    assert again.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == asked.outputs[0].token_ids


def test_n_samples_share_one_prompt_pass(small: tuple[Any, Any]) -> None:
    """With n > 1 sample 0 computes the prompt logprobs; the others reuse its prompt pages."""
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=300)
    prompt = shared_prefix_prompts(9)[1]
    (o,) = run_checked(
        eng, [prompt], SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=4, prompt_logprobs=1)
    )
    assert len(o.outputs) == 3 and o.prompt_logprobs is not None
    _check(hf, prompt, o.prompt_logprobs, 1)
    st = eng.stats()
    assert st.prefill_tokens_computed < 2 * len(
        prompt
    )  # the prompt was prefilled once, not three times


def test_streamed_outputs_carry_them_from_the_first_token(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200, chunked_prefill_size=8, max_prefill_tokens=8)
    prompt = list(range(3, 40))
    seen = []
    for out in eng.stream(prompt, SamplingParams(max_tokens=4, seed=1, prompt_logprobs=0)):
        if out.outputs[0].token_ids or out.finished:
            assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
            seen.append(out.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None  # not complete yet
    assert len(seen) >= 2 and all(s == seen[0] for s in seen)
    eng.check_invariants()


def test_blocks_give_the_same_values(
    small: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits are built a few rows at a time (bounded memory); the values do not depend on it."""
    _, lm = small
    prompt = shared_prefix_prompts(10)[0]
    params = SamplingParams(max_tokens=2, seed=0, prompt_logprobs=2)
    whole = run_checked(Engine(lm, page_size=4, num_pages=100), [prompt], params)[0]
    vocab = lm.config.vocab_size
    monkeypatch.setattr(logprobs_module, "PROMPT_BLOCK_VALUES", 3 * vocab)  # 3 rows a block
    calls = []
    original = ModelRunner.logits

    def counting(self: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.shape[0])
        return original(self, hidden)

    monkeypatch.setattr(ModelRunner, "logits", counting)
    blocked = run_checked(Engine(lm, page_size=4, num_pages=100), [prompt], params)[0]
    assert max(calls) == 3 and sum(calls) == len(prompt) - 1
    assert blocked.prompt_logprobs is not None and whole.prompt_logprobs is not None
    for a, b in zip(blocked.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) <= 1e-5 for t in a)


def test_not_asking_costs_nothing(small: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("hidden states kept although nobody asked for prompt logprobs")

    monkeypatch.setattr(ModelRunner, "forward_hidden", refuse)
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200)
    outs = run_checked(eng, shared_prefix_prompts(11)[:4], SamplingParams(max_tokens=3, seed=0))
    assert all(o.prompt_logprobs is None for o in outs)
    with pytest.raises(AssertionError, match="nobody asked"):
        eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)


def test_edges_and_bad_values(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=100)
    (one,) = run_checked(eng, [[7]], SamplingParams(max_tokens=2, prompt_logprobs=5))
    assert one.prompt_logprobs == [None]  # a one-token prompt has nothing to predict it
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"prompt_logprobs=.* vocabulary"):
        eng.add_request([3, 4], SamplingParams(prompt_logprobs=10_000))
    assert not eng.has_unfinished()


def test_abort_during_prefill_releases_everything(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=200, chunked_prefill_size=8, max_prefill_tokens=8)
    rid = eng.add_request(list(range(3, 60)), SamplingParams(max_tokens=4, prompt_logprobs=0))
    eng.step()  # one chunk of the prompt
    out: RequestOutput = eng.abort(rid)
    assert out.prompt_logprobs is None and out.outputs[0].finish_reason == "abort"
    eng.check_invariants()
    assert eng.stats().locked_pages == 0


def test_preempted_mid_prompt_resumes_without_gaps_or_repeats(small: tuple[Any, Any]) -> None:
    """Two long decodes outgrow a tiny pool while a prompt asking for logprobs is prefilled a
    few tokens at a time: it is preempted mid-prompt, resumes by recomputing positions that
    already have their logprobs (those are not appended again), and the list comes out whole
    and exact."""
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=20, chunked_prefill_size=4, max_prefill_tokens=4)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(2):
        eng.add_request(list(range(3 + i, 13 + i)), greedy)
    eng.step()
    eng.step()
    prompt = list(range(50, 110))
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_invariants()
    assert eng.stats().num_preemptions > 0
    pl = done[rid].prompt_logprobs
    assert pl is not None
    _check(hf, prompt, pl, 1)


def test_start_scores_a_continuation_on_the_cached_context(small: tuple[Any, Any]) -> None:
    """``prompt_logprobs_start``: a multiple-choice question's context is cached once; each
    answer's logprobs come with the context served from the cache (up to the page before the
    start), exact, and None before the start."""
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=300)
    context = shared_prefix_prompts(12)[0]
    answers = [[41, 42, 43], [44, 45], [46, 47, 48, 49, 50]]
    run_checked(eng, [context], SamplingParams(max_tokens=1, seed=0))  # caches the context
    start = len(context)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=start)
    outs = run_checked(eng, [context + a for a in answers], params)
    for a, o in zip(answers, outs):
        pl = o.prompt_logprobs
        assert pl is not None and pl[:start] == [None] * start
        assert o.num_cached_tokens == (start - 1) // 4 * 4 > 0
        ref = torch.log_softmax(hf_logits(hf, context + a), dim=-1)
        for j, tok in enumerate(a):
            entry = pl[start + j]
            assert entry is not None and next(iter(entry)) == tok
            assert abs(entry[tok].logprob - ref[start + j - 1, tok].item()) <= LOGPROB_ATOL
    # submitted together to a cold cache: one computes the context, the others wait for it
    cold = Engine(lm, page_size=4, num_pages=300)
    together = run_checked(cold, [context + a for a in answers], params)
    assert sorted(o.num_cached_tokens for o in together) == [0] + [(start - 1) // 4 * 4] * 2
    for a, b in zip(together, outs):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) <= LOGPROB_ATOL for t in x)
    with pytest.raises(ValueError, match="prompt_logprobs_start needs prompt_logprobs"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(ValueError, match="prompt_logprobs_start must be an integer"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=-1)
    with pytest.raises(ValueError, match="less than the prompt's length"):
        eng.add_request([3, 4, 5], SamplingParams(prompt_logprobs=0, prompt_logprobs_start=3))
    assert not eng.has_unfinished()
