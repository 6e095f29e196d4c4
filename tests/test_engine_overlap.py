"""Overlap (engine/overlap.py): step N+1 scheduled and prepared while step N's forward runs on
the device worker. Outputs must equal the sequential engine's, with pages and locks conserved
after every step (a step in flight included), under stops, aborts, preemption and a failing
forward. The device is a stand-in (radixkv/model/stand_in.py) whose forward also sleeps, so the
host's work really runs beside it."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from radixkv import onednn
from radixkv.engine.engine import Engine
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.model.llama import LlamaForCausalLM
from radixkv.model.loader import LoadedModel
from radixkv.model.stand_in import StandInDevice
from radixkv.model.tiny import tiny_config, tiny_tokenizer

DEVICE_SECONDS = 0.001  # the stand-in forward's own time: the host's work runs beside it


@pytest.fixture(scope="module", autouse=True)
def _plain_linears() -> Any:
    """Plain products on one thread: oneDNN's per-shape setup and OpenMP's spinning workers
    would dominate these tiny steps' time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn, "USE_ONEDNN", False)
        mp.setattr(onednn, "PREPACK", False)
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lm() -> Any:
    """A random hidden-64, two-layer Llama on radixkv-tiny's byte tokenizer: its forward costs
    next to nothing, so the tests' time is the engine's."""
    cfg = dataclasses.replace(
        tiny_config(), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
        num_kv_heads=1,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
    return LoadedModel(model.eval(), cfg, tiny_tokenizer(), "micro-llama")


def _engine(lm: Any, overlap: str, **kw: Any) -> Engine:
    eng = Engine(lm, overlap=overlap, **(dict(page_size=4, num_pages=400) | kw))
    eng.runner.model = StandInDevice(eng.runner.model, DEVICE_SECONDS)
    return eng


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing a system prompt (so the cache and cascade have something to share),
    some duplicates, lengths around page boundaries."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(13)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 24))]
        out.append(list(out[-1]) if i % 5 == 4 else (system + own if i % 2 else own))
    return out


def _drive(
    eng: Engine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    stream: bool = False,
    abort_at: dict[int, list[int]] | None = None,
) -> tuple[list[RequestOutput], dict[str, list[RequestOutput]]]:
    """Queue every prompt, step until done checking invariants after every step (a step in
    flight included); ``abort_at``: {step: indices of requests to abort then}. Returns the
    final outputs in order and every output seen per request."""
    ids = [eng.add_request(p, sp, stream=stream) for p, sp in zip(prompts, params)]
    seen: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    final: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished():
        for rid in [ids[j] for j in (abort_at or {}).get(steps, [])]:
            if eng.has_request(rid):
                out = eng.abort(rid)
                seen[rid].append(out)
                final[rid] = out
        outs = eng.step()
        for o in outs:
            seen[o.request_id].append(o)
            if o.finished:
                final[o.request_id] = o
        eng.check_invariants()
        steps += 1
        assert steps < 5000, "engine did not drain"
    for o in eng.drain():
        seen[o.request_id].append(o)
        final[o.request_id] = o
    eng.check_invariants()  # idle: every lock count zero, no private page left
    stats = eng.stats()
    assert stats.locked_pages == 0 and stats.private_pages == 0
    assert stats.kv_pages_free + stats.cached_pages == stats.kv_pages_total
    return [final[i] for i in ids], seen


def _key(o: RequestOutput) -> list[tuple[list[int], str | None, str]]:
    return [(c.token_ids, c.finish_reason, c.text) for c in o.outputs]


def _stopping_params(lm: Any, prompts: list[list[int]]) -> list[SamplingParams]:
    """Params that stop in every way, taken from a pilot run's outputs: a stop token met
    mid-output, a stop string met mid-output, max_tokens, EOS ignored or not."""
    pilot = Engine(lm, page_size=4, num_pages=400)
    outs = pilot.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    params = []
    for i, o in enumerate(outs):
        toks, text = o.outputs[0].token_ids, o.outputs[0].text
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=24, stop_token_ids=[toks[len(toks) // 2]]))
        elif kind == 1 and len(text) > 6:
            params.append(SamplingParams(max_tokens=24, stop=[text[len(text) // 2 :][:2]]))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=1 + i % 7))
        else:
            params.append(SamplingParams(max_tokens=24, ignore_eos=i % 2 == 1))
    return params


CONFIGS = [
    pytest.param(dict(), id="default"),
    pytest.param(dict(enable_prefix_cache=False), id="cache-off"),
    pytest.param(dict(chunked_prefill_size=7, max_prefill_tokens=12), id="chunked"),
    pytest.param(dict(page_size=16, num_pages=100, cascade="on"), id="page-16-cascade"),
    pytest.param(dict(num_pages=24, max_running_requests=8), id="preempting"),
    pytest.param(dict(schedule_policy="fcfs", max_running_requests=3), id="fcfs-3"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_greedy_outputs_identical_with_overlap(lm: Any, cfg: dict[str, Any]) -> None:
    prompts = _prompts(1, 16)
    params = _stopping_params(lm, prompts)
    ref, _ = _drive(_engine(lm, "off", **cfg), prompts, params)
    eng = _engine(lm, "on", **cfg)
    assert eng.overlap
    got, _ = _drive(eng, prompts, params)
    assert [_key(o) for o in got] == [_key(o) for o in ref]
    reasons = {c.finish_reason for o in got for c in o.outputs}
    assert {"stop", "length"} <= reasons
    if "num_pages" in cfg and cfg["num_pages"] == 24:  # the pool is small enough to preempt
        assert eng.stats().num_preemptions > 0
    eng.close()


def _late_priority_run(eng: Engine, prompts: list[list[int]]) -> list[RequestOutput]:
    """Low-priority requests fill the pool; after a few steps urgent ones arrive and preempt
    them. Invariants after every step."""
    low = SamplingParams(max_tokens=12, ignore_eos=True, priority=5)
    high = SamplingParams(max_tokens=8, ignore_eos=True, priority=0)
    half = len(prompts) // 2
    ids = [eng.add_request(p, low, stream=False) for p in prompts[:half]]
    final: dict[str, RequestOutput] = {}
    steps = 0
    while eng.has_unfinished():
        if steps == 3:
            ids += [eng.add_request(p, high, stream=False) for p in prompts[half:]]
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        eng.check_invariants()
        steps += 1
        assert steps < 2000
    eng.check_invariants()
    return [final[i] for i in ids]


def test_priority_preemption_identical(lm: Any) -> None:
    prompts = _prompts(2, 12)
    kw = dict(schedule_policy="priority", num_pages=40, max_running_requests=6)
    ref = _late_priority_run(_engine(lm, "off", **kw), prompts)
    eng = _engine(lm, "on", **kw)
    got = _late_priority_run(eng, prompts)
    assert [_key(o) for o in got] == [_key(o) for o in ref]
    assert eng.stats().num_preemptions > 0


def test_seeded_sampling_identical(lm: Any) -> None:
    prompts = _prompts(3, 12)
    params = [
        SamplingParams(
            max_tokens=16,
            temperature=0.0 if i % 4 == 3 else 0.8,
            top_p=0.9 if i % 2 else 1.0,
            top_k=20 if i % 3 == 0 else 0,
            min_p=0.05 if i % 5 == 1 else 0.0,
            seed=100 + i,
            n=2 if i % 6 == 0 else 1,
        )
        for i in range(12)
    ]
    ref, _ = _drive(_engine(lm, "off"), prompts, params)
    got, _ = _drive(_engine(lm, "on"), prompts, params)
    assert [_key(o) for o in got] == [_key(o) for o in ref]


def test_streamed_outputs_same_content(lm: Any) -> None:
    prompts = _prompts(4, 10)
    params = _stopping_params(lm, prompts)
    ref, ref_seen = _drive(_engine(lm, "off"), prompts, params, stream=True)
    got, seen = _drive(_engine(lm, "on"), prompts, params, stream=True)
    assert [_key(o) for o in got] == [_key(o) for o in ref]
    for rid, outs in seen.items():
        deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
        text = "".join(o.outputs[0].delta_text for o in outs)
        ref_outs = ref_seen[rid]
        assert deltas == [t for o in ref_outs for t in o.outputs[0].delta_token_ids]
        assert text == "".join(o.outputs[0].delta_text for o in ref_outs)
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished


def test_abort_mid_flight_conserves_pages(lm: Any) -> None:
    prompts = _prompts(5, 12)
    params = [SamplingParams(max_tokens=20, ignore_eos=True) for _ in prompts]
    abort_at = {0: [0], 2: [1, 2], 5: [3], 9: [4, 5], 14: [6]}
    eng = _engine(lm, "on", num_pages=60, max_running_requests=6)
    got, _ = _drive(eng, prompts, params, abort_at=abort_at)
    aborted = {j for js in abort_at.values() for j in js}
    ref, _ = _drive(_engine(lm, "off"), prompts, params)
    for j, (o, r) in enumerate(zip(got, ref)):
        if j in aborted:
            c = o.outputs[0]
            # whatever it had when aborted is a prefix of what it would have made
            assert c.finish_reason in ("abort", "length")
            assert c.token_ids == r.outputs[0].token_ids[: len(c.token_ids)]
        else:
            assert _key(o) == _key(r)
    assert any(o.outputs[0].finish_reason == "abort" for o in got)


class _FailingModel:
    """A stand-in model whose ``fail_on``-th forward (counting from 1) raises."""

    def __init__(self, model: Any, fail_on: int) -> None:
        self.model, self.calls, self.fail_on = model, 0, fail_on

    def __call__(self, *a: Any, **k: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("device fault")
        return self.model(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_failing_forward_ends_its_batch_others_go_on(lm: Any, overlap: str) -> None:
    prompts = _prompts(6, 10)
    params = [SamplingParams(max_tokens=14, ignore_eos=True) for _ in prompts]
    ref, _ = _drive(_engine(lm, "off"), prompts, params)
    eng = _engine(lm, overlap, max_running_requests=4)
    eng.runner.model = _FailingModel(eng.runner.model, fail_on=6)
    ids = [eng.add_request(p, sp, stream=False) for p, sp in zip(prompts, params)]
    final: dict[str, RequestOutput] = {}
    raised = 0
    steps = 0
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except RuntimeError as e:
            assert "device fault" in str(e)
            raised += 1
            outs = eng.drain()
        for o in outs:
            if o.finished:
                final[o.request_id] = o
        eng.check_invariants()
        steps += 1
        assert steps < 2000
    for o in eng.drain():
        final[o.request_id] = o
    eng.check_invariants()
    assert raised == 1
    errors = [i for i, rid in enumerate(ids) if final[rid].outputs[0].finish_reason == "error"]
    assert errors and len(errors) < len(ids)  # the batch failed, the others went on
    for i, rid in enumerate(ids):
        if i not in errors:
            assert _key(final[rid]) == _key(ref[i])
        else:
            assert "forward failed" in (final[rid].error or "")


def test_requests_that_need_the_host_run_sequentially(lm: Any) -> None:
    """Logprobs, penalties and beam search make steps sequential while such a request is
    live; the others' outputs do not change, and overlap resumes after."""
    prompts = _prompts(7, 8)
    params = [SamplingParams(max_tokens=10, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    params[5] = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3)
    params[6] = SamplingParams(max_tokens=5, ignore_eos=True, beam_width=2, n=2)
    ref, _ = _drive(_engine(lm, "off"), prompts, params)
    eng = _engine(lm, "on")
    got, _ = _drive(eng, prompts, params)
    assert [_key(o) for o in got] == [_key(o) for o in ref]
    assert got[2].outputs[0].logprobs == ref[2].outputs[0].logprobs
    # only plain requests now: steps overlap again (a launched step is in flight after a step)
    eng.add_request(prompts[0], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    assert eng._in_flight is not None
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
    assert eng._in_flight is None


def test_entry_points_finish_the_step_in_flight(lm: Any) -> None:
    eng = _engine(lm, "on")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    a = eng.add_request([5, 6, 7, 8, 9], params)
    b = eng.add_request([5, 6, 7, 10], params)
    for _ in range(4):
        eng.step()
    assert eng._in_flight is not None
    out = eng.abort(a)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng._in_flight is None
    eng.check_invariants()
    (c,) = eng.fork(b, 1, params)
    eng.reset_prefix_cache()
    for _ in range(3):
        eng.step()
    eng.close()  # finishes the step in flight, stops the worker
    assert eng._in_flight is None
    for rid in (b, c):
        eng.abort(rid)
    eng.check_invariants()


def test_overlap_option() -> None:
    from radixkv.engine.config import EngineConfig

    with pytest.raises(ValueError, match="overlap"):
        EngineConfig(overlap="sometimes")
    assert EngineConfig().overlap == "auto"


def test_auto_is_off_on_a_cpu_and_tiers_fall_back(lm: Any) -> None:
    assert not Engine(lm, page_size=4, num_pages=64).overlap  # auto on a CPU
    assert Engine(lm, page_size=4, num_pages=64, overlap="on").overlap
    tiered = Engine(lm, page_size=4, num_pages=64, overlap="on", host_cache_memory="1MiB")
    assert not tiered.overlap
    tiered.close()
    spec = Engine(lm, page_size=4, num_pages=64, overlap="on", num_speculative_tokens=2)
    assert not spec.overlap


def test_lora_rows_identical_and_loading_waits_for_the_step(lm: Any, tmp_path: Any) -> None:
    """Adapters' rows run in the same overlapped batches as the base model's; attaching an
    adapter first finishes the step in flight (its forward reads the model's adapters)."""
    from radixkv.model.lora import save_random_adapter

    path = save_random_adapter(lm.config, tmp_path / "a", seed=1, rank=4)
    prompts = _prompts(8, 8)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = {}
    for mode in ("off", "on"):
        eng = _engine(lm, mode)
        eng.load_lora("a", path)
        names = [None if i % 2 else "a" for i in range(len(prompts))]
        outs[mode] = eng.generate(prompts, params, use_tqdm=False, lora=names)
        eng.check_invariants()
        if mode == "on":
            eng.add_request(prompts[0], params)
            eng.step()
            eng.step()
            assert eng._in_flight is not None
            eng.attach_lora(eng.loras.read("b", path))
            assert eng._in_flight is None
            eng.close()
    assert [_key(o) for o in outs["on"]] == [_key(o) for o in outs["off"]]
    # the adapter changes the outputs: its rows really ran with it
    assert _key(outs["on"][0]) != _key(
        _engine(lm, "off").generate([prompts[0]], params, use_tqdm=False)[0]
    )


def test_switch_interval_lowered_while_a_worker_runs_and_restored(
    lm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device worker's GIL waits are bounded by the interpreter's switch interval: the
    first worker lowers it (never raises it), the last one to close puts it back."""
    import sys

    from radixkv.engine import overlap

    # (engines of other tests, never closed, may hold workers: count from none here)
    monkeypatch.setattr(overlap, "_switch_users", 0)
    monkeypatch.setattr(overlap, "_switch_saved", None)
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        a, b = _engine(lm, "on"), _engine(lm, "on")
        prompts = _prompts(7, 3)
        params = [SamplingParams(temperature=0.0, max_tokens=4)] * 3
        _drive(a, prompts, params)
        assert sys.getswitchinterval() == pytest.approx(overlap.SWITCH_INTERVAL)
        _drive(b, prompts, params)
        a.close()
        assert sys.getswitchinterval() == pytest.approx(overlap.SWITCH_INTERVAL)  # b's runs
        b.close()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        off = _engine(lm, "off")
        _drive(off, prompts, params)  # a sequential engine starts no worker
        assert sys.getswitchinterval() == pytest.approx(0.005)
        off.close()
    finally:
        sys.setswitchinterval(saved)
