"""Engine end to end on a small saved Llama: equal to HF greedy, cache on/off identical across
scheduling configurations, multi-turn hits, n > 1, fork, sessions, stop strings, seeds."""

from __future__ import annotations

from typing import Any

import pytest
from _model_hf_builders import hf_greedy
from engine_helpers import make_small_llama, run_checked, shared_prefix_prompts

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.session import Session

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama"))


@pytest.fixture(scope="module")
def reference(small: tuple[Any, Any]) -> dict[tuple[int, ...], list[int]]:
    """HF transformers' greedy continuation of every test prompt (the ground truth)."""
    hf, _ = small
    prompts = shared_prefix_prompts(0) + shared_prefix_prompts(1)
    return {tuple(p): hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts}


def _expected(ref: dict[tuple[int, ...], list[int]], p: list[int]) -> list[int]:
    return ref[tuple(p)]


def test_greedy_equals_hf_generate(small: tuple[Any, Any], reference: dict) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=400)
    prompts = shared_prefix_prompts(0)
    outs = eng.generate(prompts, GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == _expected(reference, p), p
        assert o.prompt_token_ids == p
        assert o.finish_reason in ("stop", "length")
        assert o.metrics.ttft is not None and o.metrics.latency >= o.metrics.ttft >= 0
    eng.check_invariants()


CONFIGS = [
    pytest.param(dict(enable_prefix_cache=False), id="cache-off"),
    pytest.param(dict(schedule_policy="lpm"), id="lpm"),
    pytest.param(dict(schedule_policy="fcfs"), id="fcfs"),
    pytest.param(dict(max_running_requests=1), id="batch-1"),
    pytest.param(dict(max_running_requests=3), id="batch-3"),
    pytest.param(dict(chunked_prefill_size=7, max_prefill_tokens=12), id="chunked"),
    pytest.param(dict(chunked_prefill_size=7, enable_prefix_cache=False), id="chunked-off"),
    pytest.param(dict(page_size=1, num_pages=2000), id="page-1"),
    pytest.param(dict(page_size=16, num_pages=100), id="page-16"),
    pytest.param(dict(num_pages=40, max_prefill_tokens=64), id="tiny-pool"),
    pytest.param(dict(num_pages=40, enable_prefix_cache=False), id="tiny-pool-off"),
    pytest.param(dict(prefill_budget="attention", max_prefill_tokens=24), id="attn-budget"),
    pytest.param(
        dict(prefill_budget="attention", max_prefill_tokens=24, chunked_prefill_size=None),
        id="attn-budget-unchunked",
    ),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_greedy_identical_across_configs(
    small: tuple[Any, Any], reference: dict, cfg: dict[str, Any]
) -> None:
    _, lm = small
    kw: dict[str, Any] = dict(page_size=4, num_pages=600)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    for wave in (0, 1):  # the second wave runs against a warm cache
        prompts = shared_prefix_prompts(wave)
        outs = run_checked(eng, prompts, GREEDY)
        for p, o in zip(prompts, outs):
            assert o.token_ids == _expected(reference, p), (cfg, wave, p)
    st = eng.stats()
    if eng.config.enable_prefix_cache:
        assert st.prefix_cache_hit_tokens > 0
    else:
        assert st.prefix_cache_hit_tokens == 0
    if kw["num_pages"] == 40:
        assert st.num_preemptions > 0  # the tiny pool really forced preemption


def test_cache_saves_prefill(small: tuple[Any, Any]) -> None:
    _, lm = small
    system = list(range(3, 3 + 64))
    prompts = [[*system, 100 + i, 101 + i, 102 + i] for i in range(6)]
    stats = {}
    for on in (False, True):
        eng = Engine(lm, page_size=4, num_pages=400, enable_prefix_cache=on)
        run_checked(eng, prompts, GREEDY)
        stats[on] = eng.stats()
    # on: the system prompt is computed once (in-batch sharing), each request computes its tail
    assert stats[True].prefill_tokens_computed == 67 + 5 * 3
    assert stats[False].prefill_tokens_computed == 6 * 67
    assert stats[True].prefix_cache_hit_tokens == 5 * 64


def test_multi_turn_hits_whole_history(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    eng = Engine(lm, page_size=ps, num_pages=400)
    history = list(range(10, 33))
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    prev_computed = 0
    for turn in range(4):
        out = eng.generate([history], params, use_tqdm=False)[0]
        if turn > 0:
            # everything computed before (prompt + all outputs but the last) minus partial page
            assert out.num_cached_tokens == (prev_computed // ps) * ps
        prev_computed = len(history) + len(out.token_ids) - 1
        history = history + out.token_ids + [40 + turn, 41 + turn, 42]
    eng.check_invariants()


def test_n_samples_prefill_once_and_seeded(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    prompt = list(range(5, 5 + 30))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    eng = Engine(lm, page_size=ps, num_pages=400)
    out = run_checked(eng, [prompt], params)[0]
    assert len(out.outputs) == 4 and all(len(c.token_ids) == 8 for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # samples differ
    tail = len(prompt) - ((len(prompt) - 1) // ps) * ps
    assert eng.stats().prefill_tokens_computed == len(prompt) + 3 * tail
    # same seed, fresh engine, other requests in the batch: same samples
    eng2 = Engine(lm, page_size=ps, num_pages=400, seed=99)
    other = SamplingParams(temperature=0.7, max_tokens=5)
    outs = run_checked(eng2, [[7, 8, 9] * 5, prompt, [30, 31] * 9], params if False else other)
    assert len(outs) == 3
    again = run_checked(eng2, [prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    different = run_checked(
        eng2, [prompt], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=12, ignore_eos=True)
    )[0]
    assert [c.token_ids for c in different.outputs] != [c.token_ids for c in out.outputs]


def test_fork_running_request_continues_its_state(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    eng = Engine(lm, page_size=ps, num_pages=400)
    prompt = list(range(50, 77))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    rid = eng.add_request(prompt, params, stream=True)
    generated: list[int] = []  # the parent's output so far, from its streamed outputs
    for _ in range(8):
        for o in eng.step():
            generated = o.token_ids
        eng.check_invariants()
    state = prompt + generated
    kids = eng.fork(rid, 3, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.check_invariants()
    gen = state[len(prompt) :]
    full = done[rid].token_ids
    assert full[: len(gen)] == gen
    for k in kids:
        # a greedy branch of the state continues exactly as the parent did
        assert done[k].token_ids == full[len(gen) : len(gen) + 6]
        assert done[k].num_cached_tokens == ((len(state) - 1) // ps) * ps


def test_session_branches_share_and_pin(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    eng = Engine(lm, page_size=ps, num_pages=400)
    with eng.session(list(range(20, 61))) as root:
        first = root.generate(SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        assert len(root.tokens) == 41 + 5
        branches = root.fork(3)
        for i, b in enumerate(branches):
            b.extend([100 + i])
        eng.cache.evict(10_000)  # pins keep the shared state cached
        assert root.num_pinned_tokens == ((41 + 5 - 1) // ps) * ps
        outs = Session.generate_all(
            branches, SamplingParams(temperature=1.0, max_tokens=4, seed=5, ignore_eos=True)
        )
        for o in outs:
            assert o.num_cached_tokens == root.num_pinned_tokens
        assert all(len(b.tokens) == 41 + 5 + 1 + 4 for b in branches)
        assert first.finish_reason == "length"
        with pytest.raises(AssertionError):  # pins are locks: a drained engine still has them
            _assert_no_locks(eng)
        for b in branches:
            b.close()
    eng.check_invariants()
    _assert_no_locks(eng)
    with pytest.raises(ValueError, match="closed"):
        root.generate()


def test_session_generate_all_aborts_its_requests_when_interrupted(
    small: tuple[Any, Any],
) -> None:
    """An exception in the middle of generate_all (here KeyboardInterrupt from a step) aborts
    the branches' requests: nothing stays queued, no branch changes, and once the sessions
    close every lock is back to zero with every page free or cached."""
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=400)
    root = eng.session(list(range(20, 61)))
    branches = root.fork(3)
    for i, b in enumerate(branches):
        b.extend([100 + i])
    before = [list(b.tokens) for b in branches]
    real_step = eng.step
    steps = 0

    def interrupted_step() -> list[Any]:
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return real_step()

    eng.step = interrupted_step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        Session.generate_all(
            branches, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        )
    eng.step = real_step  # type: ignore[method-assign]
    assert steps == 3 and not eng.has_unfinished()
    st = eng.stats()
    assert st.num_aborted == 3 and st.finish_reasons == {"abort": 3}
    assert [b.tokens for b in branches] == before
    eng.check_invariants()  # page accounting holds while the pins remain
    for s in (root, *branches):
        s.close()
    eng.check_invariants()  # drained and unpinned: every lock count is zero
    _assert_no_locks(eng)
    assert eng.pool.num_free + eng.cache.num_cached_pages == eng.pool.num_pages


def _assert_no_locks(eng: Engine) -> None:
    assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)


def test_stop_strings_and_stop_tokens(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=400)
    prompt = "The quick brown fox"
    base = eng.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0]
    text = base.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.find(stop)
    o = eng.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop, "\x00never"]),
        use_tqdm=False,
    )[0]
    assert o.finish_reason == "stop" and o.outputs[0].stop_reason == stop
    assert o.text == text[:cut]
    # streamed deltas add up to the same text, and never include the stop string
    deltas = list(
        eng.stream(
            prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop)
        )
    )
    assert "".join(d.outputs[0].delta_text for d in deltas) == text[:cut]
    assert deltas[-1].finished and sum(len(d.outputs[0].delta_token_ids) for d in deltas) == len(
        deltas[-1].token_ids
    )
    # a stop token: the output ends at its first occurrence (kept in token_ids)
    t = base.token_ids[4]
    o = eng.generate(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[t]),
        use_tqdm=False,
    )[0]
    assert o.token_ids == base.token_ids[: base.token_ids.index(t) + 1]
    assert o.finish_reason == "stop" and o.outputs[0].stop_reason == t
    eng.check_invariants()


def test_stream_close_aborts_and_abort_releases(small: tuple[Any, Any]) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=400)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    it = eng.stream(list(range(3, 40)), params)
    first = next(it)
    assert not first.finished
    it.close()
    assert not eng.has_unfinished()
    eng.check_invariants()
    rid = eng.add_request(list(range(3, 40)), params)
    other = eng.add_request(list(range(3, 30)), params)
    eng.step()
    eng.step()
    final = eng.abort(rid)
    assert final.finished and final.finish_reason == "abort"
    eng.check_invariants()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().finish_reasons == {"abort": 2, "length": 1}
    eng.check_invariants()
    with pytest.raises(ValueError, match="unknown"):
        eng.abort(other)  # already finished


def test_chunks_are_published_before_the_prompt_finishes(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    eng = Engine(lm, page_size=ps, num_pages=400, chunked_prefill_size=16, max_prefill_tokens=16)
    prompt = list(range(3, 3 + 70))
    eng.add_request(prompt, GREEDY)
    eng.step()  # first chunk: 16 tokens
    assert eng.cache.match_prefix(prompt).num_tokens == 16
    eng.step()
    assert eng.cache.match_prefix(prompt).num_tokens == 32
    # a second request with the same prompt now starts from the published chunks
    rid = eng.add_request(prompt, GREEDY, stream=False)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
        eng.check_invariants()
    assert outs[rid].num_cached_tokens >= 32


def test_preempted_request_resumes_from_its_own_pages(small: tuple[Any, Any]) -> None:
    _, lm = small
    ps = 4
    # two long decodes that cannot both fit: the newer is preempted and later resumes
    eng = Engine(lm, page_size=ps, num_pages=30, max_prefill_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a, b = list(range(3, 40)), list(range(100, 137))
    outs = run_checked(eng, [a, b], params)
    st = eng.stats()
    assert st.num_preemptions >= 1
    # resuming hit pages: fewer prompt tokens were recomputed than a restart from scratch
    restart_cost = st.num_preemptions * len(a)
    assert st.prefill_tokens_computed < len(a) + len(b) + restart_cost
    ref = Engine(lm, page_size=ps, num_pages=200).generate([a, b], params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
