"""Engine robustness: bad input at submission, a seeded random interleaving of add/step/abort on
a small pool with invariants after every step, a failing forward, and AsyncEngine."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import re
from typing import Any

import pytest
from engine_helpers import MAX_CONTEXT, VOCAB, make_small_llama

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.lora import save_random_adapter


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_small_llama(tmp_path_factory.mktemp("small-llama"))[1]


@pytest.fixture(scope="module")
def adapters(lm: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": str(save_random_adapter(lm.config, root / "a", seed=1, rank=4)),
        "b": str(
            save_random_adapter(lm.config, root / "b", seed=2, rank=4, modules=["q_proj", "v_proj"])
        ),
    }


def _drain(eng: Engine) -> None:
    for _ in range(2000):
        if not eng.has_unfinished():
            return
        eng.step()
        eng.check_invariants()
    raise AssertionError("engine did not drain (livelock)")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda e: e.add_request(""), "empty"),
        (lambda e: e.add_request([]), "empty"),
        (lambda e: e.add_request([1, VOCAB]), "outside the vocabulary"),
        (lambda e: e.add_request([1, -3]), "outside the vocabulary"),
        (lambda e: e.add_request([1, 2.0]), "not an int"),
        (lambda e: e.add_request([5] * 500, SamplingParams(max_tokens=20)), "context"),
        (lambda e: e.add_request([5] * 10, SamplingParams(max_tokens=MAX_CONTEXT)), "context"),
        (lambda e: e.add_request([5] * 300, SamplingParams(max_tokens=50)), "never fit"),
        (lambda e: e.add_request([5], SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda e: e.add_request([5], SamplingParams(temperature=-1)), "temperature"),
        (lambda e: e.add_request([5], SamplingParams(top_p=0)), "top_p"),
        (lambda e: e.add_request([5], SamplingParams(top_p=1.5)), "top_p"),
        (lambda e: e.add_request([5], SamplingParams(stop=7)), "stop"),
        (lambda e: e.add_request([5], SamplingParams(stop=[None])), "stop"),
        (lambda e: e.abort("no-such-request"), "unknown"),
        (lambda e: e.add_request([5], request_id="live"), "already in use"),
        (lambda e: e.generate([[5, 6], []], use_tqdm=False), "empty"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(lm: Any, call: Any, match: str) -> None:
    eng = Engine(lm, page_size=4, num_pages=80)  # 320 token slots: "never fit" above
    live = eng.add_request(
        [7, 8, 9, 10, 11], SamplingParams(temperature=0, max_tokens=6), request_id="live"
    )
    eng.step()
    before = (eng.stats().num_requests, eng.pool.num_free)
    with pytest.raises(ValueError, match=match):
        call(eng)
    assert (eng.stats().num_requests, eng.pool.num_free) == before  # nothing changed
    eng.check_invariants()
    _drain(eng)
    assert not eng.has_request(live) and eng.stats().finish_reasons == {"length": 1}


def test_bad_params_type_and_namespace(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=80)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.add_request([1, 2], {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hashable"):
        eng.add_request([1, 2], namespace=["not", "hashable"])
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(lm, schedule_policy="random")
    with pytest.raises(ValueError, match="page_size"):
        Engine(lm, page_size=0)


def test_namespaces_never_share(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=200)
    p = list(range(3, 43))
    g = SamplingParams(temperature=0, max_tokens=3)
    a1 = eng.generate([p], g, use_tqdm=False, namespace="tenant-a")[0]
    b1 = eng.generate([p], g, use_tqdm=False, namespace="tenant-b")[0]
    a2 = eng.generate([p], g, use_tqdm=False, namespace="tenant-a")[0]
    assert a1.num_cached_tokens == 0 and b1.num_cached_tokens == 0
    assert a2.num_cached_tokens == 36
    assert a1.token_ids == b1.token_ids == a2.token_ids


def _check_extras(out: Any, params: SamplingParams) -> None:
    """Prompt logprobs whole (None before the start) when the prefill finished; sample
    logprobs one entry per output token, the token first; a guided output that ended without a
    stop string matches its language."""
    if params.logprobs is not None:
        for c in out.outputs:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            assert all(next(iter(e)) == t for e, t in zip(c.logprobs, c.token_ids))
    pl = out.prompt_logprobs
    if pl is not None:
        ids = out.prompt_token_ids
        start = max(1, params.prompt_logprobs_start)
        assert len(pl) == len(ids) and pl[:start] == [None] * start
        assert all(e is not None and next(iter(e)) == t for e, t in zip(pl[start:], ids[start:]))
    g = params.guided
    if g is None:
        return
    pattern = g.regex if g.regex is not None else "|".join(g.choice or ())
    for c in out.outputs:
        if c.finish_reason == "stop" and not isinstance(c.stop_reason, str):
            assert re.fullmatch(pattern, c.text), (pattern, c.text, c.stop_reason)


@pytest.mark.parametrize("seed", range(16))
def test_random_interleaving_keeps_invariants(lm: Any, adapters: dict[str, str], seed: int) -> None:
    rng = random.Random(seed)
    ps = rng.choice([1, 4, 8])
    with_lora = rng.random() < 0.5
    eng = Engine(
        lm,
        page_size=ps,
        num_pages=(120 // ps) + 2,  # about one long request's worth: lots of eviction/preemption
        max_running_requests=rng.choice([2, 5, 64]),
        max_prefill_tokens=rng.choice([16, 64, 512]),
        chunked_prefill_size=rng.choice([None, 5, 32]),
        schedule_policy=rng.choice(["lpm", "fcfs", "priority"]),
        seed=seed,
        num_speculative_tokens=rng.choice([0, 3]),
        guided_jump_forward=rng.random() < 0.5,
        lora_modules=adapters if with_lora else None,
    )
    stems = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(4)]
    stems.append([rng.randrange(3, VOCAB) for _ in range(5)] * 8)  # repeats: drafts to verify
    live: list[str] = []
    sent: dict[str, SamplingParams] = {}
    adapter_of: dict[str, str | None] = {}
    finished = 0
    for _ in range(250):
        op = rng.random()
        if op < 0.3:
            prompt = list(rng.choice(stems))[: rng.randrange(1, 60)]
            prompt += [rng.randrange(3, VOCAB) for _ in range(rng.randrange(0, 30))]
            params = SamplingParams(
                n=rng.choice([1, 1, 1, 2, 3]),
                temperature=rng.choice([0.0, 0.9]),
                max_tokens=rng.randrange(1, 20),
                stop=rng.choice([(), ("a",), ("xyz", "e")]),
                ignore_eos=rng.random() < 0.5,
                seed=rng.choice([None, 7]),
                prompt_logprobs=rng.choice([None, None, 1]),
                logprobs=rng.choice([None, None, 0, 2]),
                guided=rng.choice([None, None, {"regex": "[a-z]{2,9}"}, {"choice": ["ab", "cd"]}]),
                # history-dependent logits, drafted too (speculation judges them per position)
                repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
                frequency_penalty=rng.choice([0.0, 0.0, 0.4]),
                priority=rng.choice([0, 1, -1]) if eng.config.schedule_policy == "priority" else 0,
            )
            if params.prompt_logprobs is not None and rng.random() < 0.5:
                start = rng.randrange(0, len(prompt))
                params = dataclasses.replace(params, prompt_logprobs_start=start)
            if rng.random() < 0.15:  # a beam search: beams fork, park, get preempted, pruned
                width = rng.choice([w for w in (2, 3) if w <= eng.config.max_running_requests])
                params = dataclasses.replace(
                    params,
                    beam_width=width,
                    n=rng.randrange(1, width + 1),
                    stop=(),
                    guided=None,
                    repetition_penalty=1.0,
                    frequency_penalty=0.0,
                    min_tokens=rng.choice([0, min(2, params.max_tokens)]),
                    length_penalty=rng.choice([1.0, 0.0, 2.0]),
                    early_stopping=rng.choice([False, True, "never"]),
                )
            ns = rng.choice([None, None, "t1"])
            loaded = [i.name for i in eng.list_loras()]
            lora = rng.choice([None, None, *loaded])
            rid = eng.add_request(
                prompt, params, namespace=ns, stream=rng.random() < 0.5, lora=lora
            )
            live.append(rid)
            sent[rid] = params
            adapter_of[rid] = lora
        elif op < 0.33 and with_lora:  # unload "b" (refused while in use), or load it again
            if "b" in eng.loras:
                try:
                    eng.unload_lora("b")
                except ValueError as e:
                    assert "'b' is in use by request" in str(e)
            else:
                eng.load_lora("b", adapters["b"])
        elif op < 0.4 and live:
            rid = live.pop(rng.randrange(len(live)))
            if eng.has_request(rid):
                assert eng.abort(rid).finished
        else:
            for o in eng.step():
                if o.finished:
                    finished += 1
                    assert all(c.finish_reason for c in o.outputs)
                    assert o.lora == adapter_of[o.request_id]
                    _check_extras(o, sent[o.request_id])
        eng.check_invariants()
        assert len(eng.scheduler.running) <= eng.config.max_running_requests
    _drain(eng)
    st = eng.stats()
    assert st.num_running == 0 and st.num_waiting == 0
    assert eng.seq_kv.num_private_pages == 0
    assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)
    assert eng.pool.num_free + eng.cache.num_cached_pages == eng.pool.num_pages
    assert st.num_finished == st.num_requests


def test_failed_forward_releases_and_engine_recovers(lm: Any) -> None:
    eng = Engine(lm, page_size=4, num_pages=100)
    g = SamplingParams(temperature=0, max_tokens=5)
    a = eng.add_request(list(range(3, 30)), g)
    eng.step()
    real = eng.runner.forward
    calls = {"n": 0}

    def boom(seqs: Any, **kw: Any) -> Any:
        calls["n"] += 1
        raise RuntimeError("injected failure")

    eng.runner.forward = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.runner.forward = real  # type: ignore[method-assign]
    eng.check_invariants()
    assert not eng.has_unfinished()
    outs = eng.step()  # the failed request's final output is reported
    assert [(o.request_id, o.finish_reason, o.finished) for o in outs] == [(a, "error", True)]
    assert calls["n"] == 1
    b = eng.generate([list(range(3, 30))], g, use_tqdm=False)[0]
    assert b.finish_reason == "length" and len(b.token_ids) == 5
    eng.check_invariants()


def test_async_engine_streams_cancels_and_rejects(lm: Any) -> None:
    async def main() -> None:
        aeng = AsyncEngine(engine=Engine(lm, page_size=4, num_pages=200))
        g = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

        async def collect(prompt: list[int], params: SamplingParams = g) -> list[Any]:
            return [o async for o in aeng.generate(prompt, params)]

        prompts = [list(range(3, 20 + i)) for i in range(5)]
        results = await asyncio.gather(*(collect(p) for p in prompts))
        for outs in results:
            assert outs[-1].finished and len(outs[-1].token_ids) == 8
            assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == 8
        # same answers as the synchronous engine
        ref = Engine(lm, page_size=4, num_pages=200).generate(prompts, g, use_tqdm=False)
        assert [r[-1].token_ids for r in results] == [o.token_ids for o in ref]

        # a consumer that stops early aborts its request
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        agen = aeng.generate(list(range(3, 40)), long)
        first = await agen.__anext__()
        assert not first.finished
        await agen.aclose()
        # a cancelled task aborts too
        task = asyncio.create_task(collect(list(range(5, 50)), long))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await aeng.wait_idle()
        await aeng.check_invariants()
        st = await aeng.stats()
        assert st.num_running == 0 and st.finish_reasons.get("abort", 0) >= 1
        with pytest.raises(ValueError, match="empty"):
            aeng.submit([])
        await aeng.shutdown()

    asyncio.run(main())
