"""Engine.update_weights: new weights in place (RL rollouts, online fine-tuning).

The contract under test: after an update every token comes from the new weights over KV the new
weights computed (nothing cached under the old ones is reused: device tier, host tier, session
pins, storage), requests in flight are retracted (recomputed, generation goes on) or aborted,
bad weights change nothing, and pages and locks are accounted for throughout.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, save_hf_folder

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.errors import ModelLoadError
from radixkv.model.loader import load_model

OPTS: dict[str, Any] = dict(page_size=4, num_pages=256, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(seed: int = 0, n: int = 3, shared: int = 40, own: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(5, 250) for _ in range(shared)]
    return [system + [rng.randrange(5, 250) for _ in range(own)] for _ in range(n)]


@pytest.fixture(scope="module")
def new_weights() -> dict[str, torch.Tensor]:
    """The 'trained' weights: radixkv-tiny-random's (same shapes, different values)."""
    return {k: v.clone() for k, v in load_model("radixkv-tiny-random").model.state_dict().items()}


@pytest.fixture(scope="module")
def old_ref() -> Engine:
    return Engine("radixkv-tiny", **OPTS)


@pytest.fixture(scope="module")
def new_ref() -> Engine:
    return Engine("radixkv-tiny-random", **OPTS)


def greedy(eng: Engine, ps: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.token_ids) for o in eng.generate(ps, sp, use_tqdm=False)]


def params_of(eng: Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.model.model.state_dict().items()}


def test_update_serves_the_new_weights_and_drops_every_old_page(
    new_weights: dict[str, torch.Tensor], old_ref: Engine, new_ref: Engine
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    ps = prompts(0)
    assert greedy(eng, ps) == greedy(old_ref, ps)
    cached = eng.stats().cached_pages
    assert cached > 0
    u = eng.update_weights(new_weights, weight_version="step-1")
    assert (u.weight_version, u.tensors, u.complete) == ("step-1", 21, True)
    assert u.dropped_pages == cached and u.retracted == u.aborted == 0
    assert eng.stats().cached_pages == 0 and eng.stats().weight_updates == 1
    eng.check_invariants()
    outs = eng.generate(ps, GREEDY, use_tqdm=False)
    # the same prompts again: computed from scratch (the old pages are gone), as the new model
    assert outs[0].num_cached_tokens == 0
    assert [list(o.token_ids) for o in outs] == greedy(new_ref, ps)
    assert {o.weight_version for o in outs} == {"step-1"}
    # and back: a second update with the original tensors restores the original outputs
    eng.update_weights(params_of(old_ref), weight_version="step-2")
    assert greedy(eng, ps) == greedy(old_ref, ps)
    eng.check_invariants()


def test_retracted_requests_continue_under_the_new_weights(
    new_weights: dict[str, torch.Tensor], old_ref: Engine, new_ref: Engine
) -> None:
    """The tokens before the update are the old model's; every later one is the new model's
    greedy continuation of the prompt plus those tokens (their KV recomputed)."""
    eng = Engine("radixkv-tiny", **OPTS)
    ps = prompts(1, n=3)
    ids = [eng.add_request(p, GREEDY, stream=True) for p in ps]
    got: dict[str, list[int]] = {}
    while min((len(got.get(r, [])) for r in ids), default=0) < 4:
        for o in eng.step():
            got[o.request_id] = list(o.token_ids)
    before = [got[r] for r in ids]
    u = eng.update_weights(new_weights, weight_version="v1")
    assert u.retracted == 3 and eng.stats().weight_update_retracted == 3
    eng.check_invariants()
    final: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        eng.check_invariants()
    old_full = greedy(old_ref, ps)
    for p, rid, b, ref in zip(ps, ids, before, old_full):
        out = final[rid]
        k = len(b)
        assert out.token_ids[:k] == b == ref[:k]
        cont = greedy(new_ref, [p + b], max_tokens=12 - k)[0]
        assert out.token_ids[k:] == cont
        assert out.weight_version == "v1" and out.finish_reason == "length"
    eng.check_invariants()


def test_abort_ends_every_request_in_flight(
    new_weights: dict[str, torch.Tensor], new_ref: Engine
) -> None:
    eng = Engine("radixkv-tiny", max_running_requests=2, **OPTS)
    ps = prompts(2, n=4)
    ids = [eng.add_request(p, GREEDY, stream=False) for p in ps]
    eng.step()
    eng.step()
    u = eng.update_weights(new_weights, in_flight="abort")
    assert u.aborted == 4 and u.retracted == 0 and u.weight_version == "default"
    assert not eng.has_unfinished()
    outs = eng.drain()
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    eng.check_invariants()
    assert greedy(eng, ps[:2]) == greedy(new_ref, ps[:2])


BAD = [
    pytest.param({"model.nope.weight": torch.zeros(3)}, ValueError, "not a parameter", id="name"),
    pytest.param({"lm_head.weight": torch.zeros(3, 3)}, ValueError, "has shape", id="shape"),
    pytest.param({"lm_head.weight": [1.0]}, TypeError, "torch.Tensor", id="not-tensor"),
    pytest.param(
        {"model.norm.weight": torch.ones(512, dtype=torch.int64)}, TypeError, "floating", id="int"
    ),
    pytest.param({}, ValueError, "no tensors", id="empty"),
    pytest.param(42, TypeError, "checkpoint folder, a mapping", id="not-weights"),
    pytest.param([("model.norm.weight",)], TypeError, "pair", id="not-pairs"),
    pytest.param("/nonexistent/ckpt", ModelLoadError, "not a weights folder", id="no-folder"),
]


@pytest.mark.parametrize(("weights", "error", "match"), BAD)
def test_bad_weights_change_nothing(
    weights: Any, error: type[Exception], match: str, old_ref: Engine
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    ps = prompts(3, n=2)
    want = greedy(old_ref, ps)
    rid = eng.add_request(ps[0], GREEDY, stream=False)
    eng.step()
    before = params_of(eng)
    cached = eng.stats().cached_pages
    with pytest.raises(error, match=match):
        eng.update_weights(weights)
    after = params_of(eng)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng.stats().cached_pages == cached and eng.stats().weight_updates == 0
    assert eng.has_request(rid)  # still running, and it ends as if nothing happened
    rid2 = eng.add_request(ps[1], GREEDY, stream=False)
    outs: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert [list(outs[rid].token_ids), list(outs[rid2].token_ids)] == want
    eng.check_invariants()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(in_flight="keep"), "in_flight must be one of"),
        (dict(weight_version=""), "weight_version must be a non-empty string"),
        (dict(weight_version=3), "weight_version must be a non-empty string"),
    ],
)
def test_bad_options_are_refused_before_anything(
    options: dict[str, Any], match: str, new_weights: dict[str, torch.Tensor]
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    before = params_of(eng)
    with pytest.raises(ValueError, match=match):
        eng.update_weights(new_weights, **options)
    assert all(torch.equal(before[k], v) for k, v in params_of(eng).items())


def test_partial_update_replaces_only_the_given_tensors(
    new_weights: dict[str, torch.Tensor], old_ref: Engine
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    ps = prompts(4, n=2)
    greedy(eng, ps)
    u = eng.update_weights({"lm_head.weight": new_weights["lm_head.weight"]})
    assert (u.tensors, u.complete) == (1, False) and u.dropped_pages > 0
    ref_model = load_model("radixkv-tiny")
    with torch.no_grad():
        ref_model.model.lm_head.weight.copy_(new_weights["lm_head.weight"])
    want = greedy(Engine(ref_model, **OPTS), ps)
    assert greedy(eng, ps) == want != greedy(old_ref, ps)
    eng.check_invariants()


def test_a_checkpoint_folder_updates_like_a_fresh_load(tmp_path: Path) -> None:
    """From disk: the HF folder of the same architecture, other values; a folder whose
    config.json describes another computation is refused naming the field."""
    a, b = tmp_path / "a", tmp_path / "b"
    save_hf_folder(build_hf_model("llama", seed=3), a)
    save_hf_folder(build_hf_model("llama", seed=4), b)
    ps = [[5 + (7 * i) % 300 for i in range(30)], [9 + (5 * i) % 300 for i in range(23)]]
    fresh = greedy(Engine(str(b), **OPTS), ps)
    eng = Engine(str(a), **OPTS)
    assert greedy(eng, ps) != fresh
    u = eng.update_weights(str(b), weight_version="b")
    assert u.complete and u.bytes > 0
    assert greedy(eng, ps) == fresh
    other = tmp_path / "other"
    save_hf_folder(build_hf_model("llama", seed=4, rope_theta=5000.0), other)
    with pytest.raises(ModelLoadError, match="rope_theta"):
        eng.update_weights(str(other))
    # a checkpoint lacking a weight, or with one of another shape: named, nothing changes
    from safetensors.torch import load_file, save_file

    state = load_file(str(b / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, str(other / "model.safetensors"))
    (other / "config.json").write_bytes((b / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="missing weight"):
        eng.update_weights(str(other))
    save_file({**state, name: state[name][:, :-1].contiguous()}, str(other / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"{name}.*has shape"):
        eng.update_weights(str(other))
    assert greedy(eng, ps) == fresh
    eng.check_invariants()


def test_session_pins_are_dropped_and_the_session_recomputes(
    new_weights: dict[str, torch.Tensor], new_ref: Engine
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    state = prompts(5, n=1)[0]
    s = eng.session(state)
    s.generate(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert s.num_pinned_tokens > 0
    u = eng.update_weights(new_weights)
    assert u.pins == 1 and eng.stats().cached_pages == 0 and eng.seq_kv.num_pins == 0
    eng.check_invariants()
    tokens = list(s.tokens)
    out = s.generate(GREEDY)
    assert list(out.token_ids) == greedy(new_ref, [tokens])[0]
    assert out.num_cached_tokens == 0  # nothing of the old state's KV was reused
    s.close()
    eng.check_invariants()  # idle: every lock count back to zero


def test_host_tier_pages_are_dropped(new_weights: dict[str, torch.Tensor], new_ref: Engine) -> None:
    opts = dict(OPTS, num_pages=48, host_cache_memory=4_000_000)
    eng = Engine("radixkv-tiny", **opts)
    for seed in range(6):  # more than the device pool holds: evictions back pages to host
        greedy(eng, prompts(10 + seed, n=2))
    assert eng.cache.num_host_pages > 0
    u = eng.update_weights(new_weights)
    assert u.dropped_host_pages > 0 and eng.cache.num_host_pages == 0
    eng.check_invariants()
    ps = prompts(10, n=2)
    host_hits = eng.stats().prefix_cache_host_hit_tokens
    outs = eng.generate(ps, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == greedy(new_ref, ps)
    assert outs[0].num_cached_tokens == 0  # its old pages were in the host tier: gone
    assert eng.stats().prefix_cache_host_hit_tokens == host_hits
    eng.check_invariants()


def test_storage_is_keyed_by_the_new_weights(
    new_weights: dict[str, torch.Tensor], new_ref: Engine, tmp_path: Path
) -> None:
    """Pages stored under the old weights are never loaded after the update; pages stored
    after it are found by a fresh engine started on the new weights (the same identity), and
    not by one on the old weights."""
    url = f"file://{tmp_path}/kv"
    opts = dict(OPTS, host_cache_memory=2_000_000, kv_storage=url)
    ps = prompts(20, n=2)
    with Engine("radixkv-tiny", **opts) as eng:
        greedy(eng, ps)
        eng.flush_storage()
        assert eng.stats().storage_write_pages > 0
        eng.update_weights(new_weights)
        outs = eng.generate(ps, GREEDY, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == greedy(new_ref, ps)
        assert outs[0].num_cached_tokens == 0  # the old pages in storage were not loaded
        assert eng.stats().prefix_cache_storage_hit_tokens == 0
        eng.flush_storage()
    with Engine("radixkv-tiny-random", **opts) as fresh:
        assert greedy(fresh, ps) == greedy(new_ref, ps)
        assert fresh.stats().prefix_cache_storage_hit_tokens > 0
    with Engine("radixkv-tiny", **opts) as eng:  # partial update: its own identity
        eng.update_weights({"lm_head.weight": new_weights["lm_head.weight"]})
        greedy(eng, [ps[0][:20]])
        assert eng.stats().prefix_cache_storage_hit_tokens == 0


def test_beam_search_in_flight_is_retracted_and_finishes(
    new_weights: dict[str, torch.Tensor],
) -> None:
    eng = Engine("radixkv-tiny", **OPTS)
    beam = SamplingParams(beam_width=3, max_tokens=10, temperature=0.0, ignore_eos=True)
    rid = eng.add_request(prompts(6, n=1)[0], beam, stream=False)
    other = eng.add_request(prompts(7, n=1)[0], GREEDY, stream=False)
    for _ in range(5):
        eng.step()
        eng.check_invariants()
    u = eng.update_weights(new_weights)
    assert u.retracted >= 2
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
        eng.check_invariants()
    assert set(done) == {rid, other}
    assert done[rid].finish_reason == "length" and len(done[rid].token_ids) == 10
    eng.check_invariants()


def test_async_engine_updates_between_steps(
    new_weights: dict[str, torch.Tensor], old_ref: Engine, new_ref: Engine
) -> None:
    ps = prompts(8, n=2)
    old = greedy(old_ref, ps)

    async def main() -> tuple[list[Any], Any, list[Any]]:
        eng = AsyncEngine("radixkv-tiny", **OPTS)
        seen: list[Any] = []

        async def consume(p: list[int], started: asyncio.Event | None = None) -> Any:
            last = None
            async for o in eng.generate(p, GREEDY):
                last = o
                seen.append(o)
                if started is not None:
                    started.set()
            return last

        tasks = [asyncio.create_task(consume(p)) for p in ps]
        while len(seen) < 6:
            await asyncio.sleep(0.001)
        u = await eng.update_weights(new_weights, weight_version="w2")
        finals = await asyncio.gather(*tasks)
        # abort: a stream in flight ends with "abort", at once
        started = asyncio.Event()
        t = asyncio.create_task(consume(ps[0], started))
        await started.wait()
        await eng.update_weights(new_weights, in_flight="abort")
        aborted = await t
        await eng.check_invariants()
        await eng.shutdown()
        return finals, u, [aborted]

    finals, u, (aborted,) = asyncio.run(main())
    assert u.retracted == 2 and u.weight_version == "w2"
    for p, f, o in zip(ps, finals, old):
        k = next(i for i, (x, y) in enumerate(zip([*f.token_ids, -1], [*o, -2])) if x != y)
        assert k >= 1  # tokens before the update are the old model's
        assert f.weight_version == "w2" and len(f.token_ids) == 12
        assert f.token_ids[k:] == greedy(new_ref, [p + f.token_ids[:k]], 12 - k)[0]
    assert aborted.finished and aborted.finish_reason == "abort"
