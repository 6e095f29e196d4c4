"""Engine with cascade decode attention on/off/auto: identical greedy outputs, fewer KV reads."""

from __future__ import annotations

import random

import pytest

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams


def _branching_prompts(seed: int) -> list[list[int]]:
    """A trunk, two sub-branches of it, several leaves each, plus one unrelated prompt."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1, 250) for _ in range(n)]

    trunk = toks(150)
    subs = [trunk + toks(40), trunk + toks(33)]
    prompts = [s + toks(rng.randint(1, 9)) for s in subs for _ in range(3)]
    prompts.append(trunk + toks(5))
    prompts.append(toks(20))
    return prompts


def _run(mode: str, page_size: int, prompts: list[list[int]]):
    eng = Engine(
        "radixkv-tiny", page_size=page_size, num_pages=512, cascade=mode, attention_backend="torch"
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # warm the trie with the shared parts so every branch starts decoding from locked nodes
    eng.generate([p[:-1] for p in prompts[:1]], SamplingParams(max_tokens=1), use_tqdm=False)
    outs = eng.generate(prompts, params, use_tqdm=False)
    eng.check_invariants()
    return [o.token_ids for o in outs], eng.stats()


@pytest.mark.parametrize("page_size", [4, 16])
def test_greedy_outputs_identical_with_cascade_on_off_auto(page_size: int) -> None:
    prompts = _branching_prompts(page_size)
    off, st_off = _run("off", page_size, prompts)
    on, st_on = _run("on", page_size, prompts)
    auto, st_auto = _run("auto", page_size, prompts)
    assert on == off
    assert auto == off
    assert st_off.cascade_steps == 0
    assert st_off.kv_bytes_read_cascade == st_off.kv_bytes_read_plain > 0
    assert st_on.cascade_steps > 0
    assert st_on.kv_bytes_read_plain == st_off.kv_bytes_read_plain
    assert st_on.kv_bytes_read_cascade < 0.6 * st_on.kv_bytes_read_plain
    assert st_auto.kv_bytes_read_cascade <= st_auto.kv_bytes_read_plain


def test_fork_branches_share_through_cascade() -> None:
    eng = Engine("radixkv-tiny", page_size=16, num_pages=256, cascade="on")
    prompt = list(range(1, 200))
    outs = eng.generate(
        [prompt], SamplingParams(temperature=0.8, n=4, seed=3, max_tokens=10), use_tqdm=False
    )
    st = eng.stats()
    assert len(outs[0].outputs) == 4
    assert st.cascade_steps > 0 and st.kv_bytes_read_cascade < st.kv_bytes_read_plain
    eng.check_invariants()
    ref = Engine("radixkv-tiny", page_size=16, num_pages=256, cascade="off").generate(
        [prompt], SamplingParams(temperature=0.8, n=4, seed=3, max_tokens=10), use_tqdm=False
    )
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in ref[0].outputs]


def test_bad_cascade_mode_rejected() -> None:
    with pytest.raises(ValueError, match="cascade"):
        Engine("radixkv-tiny", cascade="always")


def test_decodes_of_mixed_steps_use_the_cascade() -> None:
    """Branches arrive one by one, so most steps prefill a newcomer while the others decode:
    those decodes read the shared prompt once too, and greedy outputs equal cascade off."""
    rng = random.Random(5)
    trunk = [rng.randrange(1, 250) for _ in range(160)]
    prompts = [[*trunk, *[rng.randrange(1, 250) for _ in range(20)]] for _ in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs, stats = {}, {}
    for mode in ("off", "on"):
        eng = Engine("radixkv-tiny", page_size=4, num_pages=512, cascade=mode)
        eng.generate([trunk], SamplingParams(max_tokens=1), use_tqdm=False)
        ids, mixed_cascade = [], 0
        for p in prompts:
            ids.append(eng.add_request(p, params, stream=False))
            before = eng.stats()
            eng.step()  # the newcomer's prefill alongside the running decodes
            after = eng.stats()
            prefilled = after.prefill_tokens_computed > before.prefill_tokens_computed
            mixed_cascade += int(prefilled and after.cascade_steps > before.cascade_steps)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                done[o.request_id] = o.token_ids
        eng.check_invariants()
        outs[mode] = [done[i] for i in ids]
        stats[mode] = mixed_cascade
    assert outs["on"] == outs["off"]
    assert stats["off"] == 0 and stats["on"] >= 3  # steps 3-5 mix a prefill with 2-4 decodes
