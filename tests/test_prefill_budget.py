"""The attention-aware prefill budget: its cost model, and that the scheduler splits a step
whose new tokens attend to a long cached prefix, while a lone long prompt still progresses."""

from __future__ import annotations

from typing import Any

import pytest
from engine_helpers import make_small_llama

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.prefill_cost import attention_cost_ratio, chunk_cost, max_chunk
from radixkv.model.tiny import tiny_config


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama"))


def test_ratio_of_tiny_and_cost_model() -> None:
    r = attention_cost_ratio(tiny_config())
    assert r == pytest.approx(37888.0)
    assert chunk_cost(128, 4096, None) == 128
    assert chunk_cost(128, 4096, r) == pytest.approx(128 + (128 * 4096 + 128 * 128 / 2) / r)


@pytest.mark.parametrize("past", [0, 1, 100, 4096, 100_000])
@pytest.mark.parametrize("budget", [0, 1, 7.5, 1000, 8192])
def test_max_chunk_is_the_largest_that_fits(past: int, budget: float) -> None:
    for ratio in (None, 3.0, 1536.0):
        n = max_chunk(budget, past, ratio)
        assert n >= 0
        assert chunk_cost(n, past, ratio) <= budget
        assert chunk_cost(n + 1, past, ratio) > budget


def test_engine_rejects_unknown_budget() -> None:
    with pytest.raises(ValueError, match="prefill_budget"):
        Engine("radixkv-tiny", num_pages=16, prefill_budget="flops")


def _record(eng: Engine) -> list[tuple[list[int], list[int], float]]:
    """Wraps the scheduler: per step, (new tokens per row, past tokens per row, prefill cost)."""
    rec: list[tuple[list[int], list[int], float]] = []
    sch = eng.scheduler
    orig = sch.schedule

    def schedule() -> Any:
        b = orig()
        rec.append((list(b.num_new), [s.num_computed for s in b.seqs], b.prefill_cost))
        return b

    sch.schedule = schedule  # type: ignore[method-assign]
    return rec


def test_attention_budget_splits_the_step_over_a_cached_prefix(small: tuple[Any, Any]) -> None:
    _, lm = small
    ratio = attention_cost_ratio(lm.config)
    prefix = [3 + (i % 90) for i in range(160)]
    prompts = [prefix + [100 + 8 * i + j for j in range(8)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = {}
    prefill_steps = {}
    for budget in ("tokens", "attention"):
        eng = Engine(lm, page_size=4, num_pages=400, max_prefill_tokens=128, prefill_budget=budget)
        eng.scheduler.step_overhead_tokens = None  # the budget alone sizes the steps here
        eng.generate([prompts[0]], params, use_tqdm=False)  # the prefix is cached now
        rec = _record(eng)
        outs[budget] = [o.token_ids for o in eng.generate(prompts[1:], params, use_tqdm=False)]
        eng.check_invariants()
        prefill_steps[budget] = sum(1 for new, _, _ in rec if any(n > 1 for n in new))
        for new, past, cost in rec:
            prefill = [(n, p) for n, p in zip(new, past) if n > 1]
            if budget == "attention" and len(prefill) > 1:
                assert cost == pytest.approx(sum(chunk_cost(n, p, ratio) for n, p in prefill))
                assert cost <= 128
    # 11 x 8 new tokens fit 128 tokens in one step; with their attention to 160 cached
    # tokens priced in, they do not
    assert prefill_steps["tokens"] == 1
    assert prefill_steps["attention"] > 1
    assert outs["tokens"] == outs["attention"]


@pytest.mark.parametrize("chunk", [2048, None])
def test_long_prompt_progresses_under_a_tiny_budget(small: tuple[Any, Any], chunk: Any) -> None:
    _, lm = small
    eng = Engine(
        lm,
        page_size=4,
        num_pages=400,
        max_prefill_tokens=2,
        chunked_prefill_size=chunk,
        prefill_budget="attention",
    )
    rec = _record(eng)
    prompt = [3 + (i % 90) for i in range(150)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    out = eng.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.token_ids) == 2
    ref = Engine(lm, page_size=4, num_pages=400).generate([prompt], params, use_tqdm=False)
    assert out.token_ids == ref[0].token_ids
    if chunk is not None:
        assert all(new[0] >= 2 for new, _, _ in rec[:-2])  # a page (or the rest) per step
        assert len(rec) > 3  # really chunked


@pytest.mark.parametrize(
    ("max_prefill", "chunk", "budget"), [(64, 24, 24), (20, 24, 20), (40, None, 40)]
)
def test_step_prefill_tokens_stay_within_the_step_budget(
    small: tuple[Any, Any], max_prefill: int, chunk: Any, budget: int
) -> None:
    """A burst of short prompts runs as several steps of at most
    min(max_prefill_tokens, chunked_prefill_size) prefill tokens, as in SGLang."""
    _, lm = small
    eng = Engine(
        lm, page_size=4, num_pages=400, max_prefill_tokens=max_prefill, chunked_prefill_size=chunk
    )
    assert eng.scheduler.step_budget == budget
    rec = _record(eng)
    prompts = [[3 + (7 * i + j) % 90 for j in range(10)] for i in range(9)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = eng.generate(prompts, params, use_tqdm=False)
    prefill = [cost for _, _, cost in rec]  # the "tokens" budget: prefill tokens of the step
    assert sum(prefill) == 90
    assert max(prefill) <= budget
    assert sum(1 for p in prefill if p) >= -(-90 // budget)  # so the burst took several steps
    ref = Engine(lm, page_size=4, num_pages=400, chunked_prefill_size=None)
    assert [o.token_ids for o in outs] == [
        o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)
    ]


def test_short_requests_are_not_held_behind_a_long_chunked_prefill(
    small: tuple[Any, Any],
) -> None:
    """While requests wait, a running chunked prefill takes at most half the step budget: a short
    request arriving behind a long prompt starts before the long prompt's prefill is done, and
    budget the admissions leave unused goes back to the long prompt."""
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=600, chunked_prefill_size=32, max_prefill_tokens=64)
    rec = _record(eng)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long_prompt = [3 + (i * 7) % 90 for i in range(400)]
    long_id = eng.add_request(long_prompt, params)
    eng.step()  # the long prompt is running now, 32 tokens in
    short_id = eng.add_request([5, 6, 7, 8, 9, 10], params)
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    # step 2: the long prompt's chunk is held to 16 (half of 32), the short prompt takes 6 and
    # the 10 left over go back to the long prompt
    assert rec[1][0] == [26, 6]
    long_done = next(i for i, (new, past, _) in enumerate(rec) if past[0] + new[0] >= 400)
    assert long_done > 1  # so the short one really started first
    assert all(cost <= 32 for _, _, cost in rec)
    ref = Engine(lm, page_size=4, num_pages=600)
    assert outs[long_id] == ref.generate([long_prompt], params, use_tqdm=False)[0].token_ids
    assert (
        outs[short_id] == ref.generate([[5, 6, 7, 8, 9, 10]], params, use_tqdm=False)[0].token_ids
    )


def test_a_burst_of_short_prefills_is_admitted_in_sqrt_sized_groups(
    small: tuple[Any, Any],
) -> None:
    """Twelve requests hit a cached prefix at once: with a step overhead of d budget units, a
    step admits at most ceil(sqrt(waiting * (d + decode rows) / cost)) of them (the first
    admission's cost), so the first ones get their first token after a short step; outputs do
    not change."""
    _, lm = small
    prefix = [3 + (i % 90) for i in range(160)]
    prompts = [prefix + [100 + 8 * i + j for j in range(8)] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs, groups = {}, {}
    for d in (None, 8.0):
        eng = Engine(lm, page_size=4, num_pages=400, max_prefill_tokens=128)
        eng.scheduler.step_overhead_tokens = d
        eng.generate([prefix], params, use_tqdm=False)  # the prefix is cached now
        rec = _record(eng)
        outs[d] = [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
        eng.check_invariants()
        groups[d] = [
            sum(1 for n, p in zip(new, past) if p == 160 and n == 8) for new, past, _ in rec
        ]
        groups[d] = [g for g in groups[d] if g]
    assert groups[None] == [12]  # 96 new tokens fit the budget of 128: one step
    # d = 8 + a token per decode row: waiting 12, no decodes: ceil(sqrt(12 * 8 / 8)) = 4;
    # waiting 8, 4 decoding: ceil(sqrt(8 * 12 / 8)) = 4; waiting 4, 8 decoding: 3; then 1
    assert groups[8.0] == [4, 4, 3, 1]
    assert outs[8.0] == outs[None]


def test_the_burst_cap_keeps_a_held_back_prefill_at_half_the_budget(
    small: tuple[Any, Any],
) -> None:
    """When the cap stops admission (requests still wait), a running prefill held to half the
    budget is not topped up with what the admissions left: the step stays short."""
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=600, chunked_prefill_size=32, max_prefill_tokens=64)
    eng.scheduler.step_overhead_tokens = 1.0  # cap = ceil(sqrt(waiting / cost)): one per step
    rec = _record(eng)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    eng.add_request([3 + (i * 7) % 90 for i in range(400)], params)
    eng.step()  # the long prompt is running now, 32 tokens in
    for i in range(3):
        eng.add_request([5 + i, 6, 7, 8, 9, 10], params)
    eng.step()
    # the long prompt's chunk stays at 16 (half of 32), one short prompt is admitted (6 tokens)
    assert rec[1][0] == [16, 6]
    while eng.has_unfinished():
        eng.step()
    eng.check_invariants()
