"""Hybrid window KV end to end: the sliding-window layers' K/V in window slots, fewer than the
pages (radixkv/cache/window_slots.py, kv/hybrid_pool.py, attention/hybrid.py, the engine's
SeqKV). The same memory holds more pages; outputs stay transformers' greedy ones with so few
slots that they are taken from cached pages all the time and matches are cut back to where
their windows still have slots; forks (beams), drafts, aborts and weight updates keep the pins
right (the engine's invariant check after every step compares them with the running
sequences'); what cannot combine is refused by name. test_model_window.py and
test_model_gemma.py run every windowed family in both modes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _model_hf_builders import build_hf_model, hf_greedy, save_hf_folder
from engine_helpers import run_checked, shared_prefix_prompts

from radixkv.cache import WindowSlots
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.hybrid_pool import HybridKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


@pytest.fixture(scope="module")
def swa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """Qwen2 with a window of 9 on its second layer (the first attends in full)."""
    hf = build_hf_model("qwen2_swa", seed=50)
    return hf, load_model(save_hf_folder(hf, tmp_path_factory.mktemp("qwen2-swa")))


def test_the_same_memory_holds_more_pages(swa: tuple[Any, Any]) -> None:
    """One full layer and one windowed: a page with its slot at ratio r costs 1 + r layers'
    worth, against 2 for a page without hybrid KV."""
    _, lm = swa
    budget = 4 << 20
    full = Engine(lm, page_size=4, kv_cache_memory=budget, window_kv="full")
    assert isinstance(full.kv_pool, KVPool)
    for ratio in (0.5, 0.25):
        eng = Engine(lm, page_size=4, kv_cache_memory=budget, window_kv_ratio=ratio)
        kv = eng.kv_pool
        assert isinstance(kv, HybridKVPool) and kv.total_bytes <= budget
        assert kv.num_pages == pytest.approx(full.kv_pool.num_pages * 2 / (1 + ratio), abs=2)
        assert kv.num_slots == int(kv.num_pages * ratio)
        assert eng.pool.num_pages == kv.num_pages and eng.stats().window_slots_total == kv.num_slots


def test_few_slots_evict_and_cut_matches_and_outputs_stay_transformers(
    swa: tuple[Any, Any],
) -> None:
    """Six slots (a window of 9 at page size 4 needs three, plus one for the next page): slots
    are taken from cached pages all the time, and a later request's match is cut back to where
    its window still has slots. Waves of shared-prefix prompts, batched and one at a time."""
    hf, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=0.01)
    assert eng.kv_pool.num_slots == 6
    for wave in range(3):
        prompts = shared_prefix_prompts(wave, 6)
        batched = wave != 1
        outs = (
            run_checked(eng, prompts, GREEDY)
            if batched
            else [run_checked(eng, [p], GREEDY)[0] for p in prompts]
        )
        for p, o in zip(prompts, outs, strict=True):
            assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens), (wave, p)
    st = eng.stats()
    assert st.window_slots_evicted > 0 and st.window_trimmed_tokens > 0
    assert st.prefix_cache_hit_tokens > 0  # cut matches still serve their usable part
    assert st.window_slots_pinned == 0 and st.window_slots_free + st.window_slots_cached == 6


def test_the_lpm_estimate_counts_only_what_a_match_keeps(swa: tuple[Any, Any]) -> None:
    """``peek_match_len`` (the lpm order and priority preemption read it) is the hit a match
    keeps, not the whole cached prefix: six slots, one request at a time, each prompt's estimate
    taken just before its admission equals its ``num_cached_tokens``, and some are below what
    the trie holds (their windows had lost slots)."""
    _, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=0.01)
    kv = eng.scheduler.kv
    cut = 0
    for prompt in shared_prefix_prompts(7, 12):
        rid = eng.add_request(prompt, GREEDY, stream=False)
        (seq,) = eng.scheduler.waiting
        estimate = kv.peek_match_len(seq)
        cached = eng.cache.peek_prefix(seq.token_ids[: seq.reuse_limit])
        assert estimate <= cached
        cut += estimate < cached
        outs = [o for _ in range(100) if eng.has_unfinished() for o in eng.step() if o.finished]
        eng.check_invariants()
        assert [o.request_id for o in outs] == [rid]
        assert outs[0].num_cached_tokens == estimate, prompt
    assert cut > 0 and eng.stats().window_trimmed_tokens > 0


@pytest.mark.parametrize("plain_lru", [False, True])
def test_windows_before_sequence_ends_and_branches_outlast_passed_ones(
    swa: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, plain_lru: bool
) -> None:
    """32 slots, a window of 9 (3 pages of 4): a conversation turn A (system prompt S and its
    question), three unrelated 80-token prompts, then A's next turn: it hits all of A's 19
    whole pages, because the pages other prompts' windows merely passed are taken first. S's
    end becomes a branch point when a second question on S arrives; after three more
    unrelated prompts a third one hits all of S. With one least-recently-unpinned order for
    every cached slot (``plain_lru``), the unrelated prompts' passed pages outlast both
    windows and both hits are lost (the tokens are recomputed: outputs are the same)."""
    hf, lm = swa
    if plain_lru:
        unpin = WindowSlots.unpin
        monkeypatch.setattr(
            WindowSlots,
            "unpin",
            lambda self, pages, keep=True, passed=False: unpin(self, pages, keep=keep),
        )
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=32 / 600)
    assert eng.kv_pool.num_slots == 32
    rng = random.Random(1)
    tok = lambda n: [rng.randrange(3, 320) for _ in range(n)]  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(prompt: list[int]) -> Any:
        (out,) = run_checked(eng, [prompt], params)
        assert out.token_ids == hf_greedy(hf, prompt, params.max_tokens)
        return out

    system = tok(40)
    turn = system + tok(30)
    a = run(turn)
    run_checked(eng, [tok(80) for _ in range(3)], params)
    assert run(turn + list(a.token_ids) + tok(5)).num_cached_tokens == (0 if plain_lru else 76)
    run(system + tok(20))  # S's end is a branch point from now on
    run_checked(eng, [tok(80) for _ in range(3)], params)
    assert run(system + tok(20)).num_cached_tokens == (0 if plain_lru else 40)


def test_a_session_pin_keeps_its_window(swa: tuple[Any, Any]) -> None:
    """A session's pin keeps its state cached (a lock) and, with window slots, the window before
    the state's end: ten unrelated prompts later (their kept windows alone would fill the 32
    slots), the next turn still hits the whole state; closing the session lets go of both."""
    hf, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=32 / 600)
    rng = random.Random(4)
    tok = lambda n: [rng.randrange(3, 320) for _ in range(n)]  # noqa: E731
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    session = eng.session(tok(40))
    session.generate(params)  # the state is 48 tokens; the 11 whole pages computed are pinned
    assert eng.stats().window_slots_pinned == 2  # the pages of tokens 36..43 (window 9)
    evicted = eng.stats().window_slots_evicted
    run_checked(eng, [tok(80) for _ in range(10)], params)
    assert eng.stats().window_slots_evicted > evicted
    state = list(session.tokens)
    session.extend(tok(5))
    out = session.generate(params)
    assert out.num_cached_tokens == 44
    assert out.token_ids == hf_greedy(hf, state + session.tokens[len(state) : -8], 8)
    session.close()
    eng.check_invariants()
    assert eng.stats().window_slots_pinned == 0


def test_a_prompt_longer_than_all_slots_runs_in_chunks(swa: tuple[Any, Any]) -> None:
    """A 300-token prompt needs 75 pages; 6 slots hold a window and a few new pages, so its
    prefill goes in chunks that fit them (whatever chunked_prefill_size allows)."""
    hf, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=0.01, chunked_prefill_size=0)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 320) for _ in range(300)]
    (out,) = run_checked(eng, [prompt], GREEDY)
    assert out.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(SamplingParams(beam_width=3, n=2, max_tokens=12), id="beams"),
        pytest.param(SamplingParams(temperature=0.0, n=3, max_tokens=12), id="n3-greedy"),
    ],
)
@pytest.mark.parametrize("ratio", [0.5, 0.05])
def test_forks_keep_their_windows(
    swa: tuple[Any, Any], params: SamplingParams, ratio: float
) -> None:
    """Beams and parallel samples fork a parent's pages (a copy of its private tail, window
    slot included): the same outputs as with every token's K/V kept."""
    _, lm = swa
    prompts = shared_prefix_prompts(3, 5)
    want = [
        [c.token_ids for c in o.outputs]
        for o in Engine(lm, page_size=4, num_pages=600, window_kv="full").generate(
            prompts, params, use_tqdm=False
        )
    ]
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=ratio)
    got = run_checked(eng, prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == want


def test_speculative_drafts_and_their_rollback(swa: tuple[Any, Any]) -> None:
    """Prompt-lookup drafts reserve pages (and slots) past the sequence; refused ones go back."""
    hf, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600, window_kv_ratio=0.05, num_speculative_tokens=4)
    rng = random.Random(3)
    motif = [rng.randrange(3, 320) for _ in range(6)]
    prompts = [motif * 6 + [rng.randrange(3, 320)], [7, 8, 9] + motif * 4]
    for p, o in zip(prompts, run_checked(eng, prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert eng.stats().speculative_draft_tokens > 0


def test_abort_and_preemption_release_the_pins(swa: tuple[Any, Any]) -> None:
    _, lm = swa
    eng = Engine(lm, page_size=4, num_pages=26, max_running_requests=8, window_kv_ratio=0.5)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in shared_prefix_prompts(5, 8)]
    for _ in range(6):
        eng.step()
        eng.check_invariants()
    assert eng.stats().window_slots_pinned > 0
    for i in ids[::2]:
        eng.abort(i)
    while eng.has_unfinished():
        eng.step()
        eng.check_invariants()
    eng.check_invariants()  # idle: no pin left
    st = eng.stats()
    assert st.window_slots_pinned == 0 and st.num_aborted == len(ids[::2])
    assert st.num_preemptions > 0


def test_new_weights_drop_every_window_slot(swa: tuple[Any, Any]) -> None:
    hf, lm = swa
    eng = Engine(lm, page_size=4, num_pages=600)
    prompts = shared_prefix_prompts(1, 4)
    run_checked(eng, prompts, GREEDY)
    assert eng.stats().window_slots_cached > 0
    eng.update_weights({k: v.clone() for k, v in hf.state_dict().items()})
    st = eng.stats()
    assert st.window_slots_cached == 0 and st.window_slots_free == st.window_slots_total
    for p, o in zip(prompts, run_checked(eng, prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


def test_every_layer_windowed_keeps_no_full_pool(tmp_path: Path) -> None:
    """Mistral's window on every layer: pages are ids only, all K/V is in window slots."""
    hf = build_hf_model("mistral_swa", seed=50)
    eng = Engine(load_model(save_hf_folder(hf, tmp_path)), page_size=4, kv_cache_memory=1 << 20)
    kv = eng.kv_pool
    assert isinstance(kv, HybridKVPool) and kv.full is None and kv.total_bytes <= 1 << 20
    assert not eng.runner.supports_cascade  # nothing to read once per group
    prompts = shared_prefix_prompts(2, 5)
    for p, o in zip(prompts, run_checked(eng, prompts, GREEDY), strict=True):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


def test_what_cannot_be_hybrid_is_refused_by_name(swa: tuple[Any, Any], tmp_path: Path) -> None:
    _, lm = swa
    with pytest.raises(ValueError, match="host_cache_memory, kv_storage"):
        Engine(lm, page_size=4, num_pages=64, window_kv="hybrid", host_cache_memory="1MiB")
    # auto keeps every token's K/V where a tier copies whole pages
    eng = Engine(lm, page_size=4, num_pages=64, host_cache_memory="1MiB")
    assert isinstance(eng.kv_pool, KVPool) and eng.window_slots is None
    llama = load_model(save_hf_folder(build_hf_model("llama", seed=1), tmp_path))
    with pytest.raises(ValueError, match="needs a model with sliding-window layers"):
        Engine(llama, page_size=4, num_pages=64, window_kv="hybrid")
    assert isinstance(Engine(llama, page_size=4, num_pages=64).kv_pool, KVPool)  # auto
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="window_kv_ratio"):
            Engine(lm, page_size=4, num_pages=64, window_kv_ratio=bad)
    with pytest.raises(ValueError, match="window_kv must be one of"):
        Engine(lm, page_size=4, num_pages=64, window_kv="sliding")


def test_hybrid_pool_checks_and_copies() -> None:
    kv = HybridKVPool.build((0, 5, 5), 8, 4, 2, 1, 2)
    assert (kv.full.num_layers, kv.window.num_layers) == (1, 2)
    assert kv.route == ((False, 0), (True, 0), (True, 1)) and kv.window_tokens == 5
    kv.slots.attach([1, 2])
    kv.window.k[:, kv.slots.slot_of[1]] = 3.0
    kv.full.k[:, 1] = 4.0
    kv.copy_pages([1, 3], [2, 4])  # page 3 has no slot: only its full layers are copied
    assert torch.equal(kv.window.k[:, kv.slots.slot_of[2]], kv.window.k[:, kv.slots.slot_of[1]])
    assert torch.equal(kv.full.k[:, 2], kv.full.k[:, 1])
    with pytest.raises(ValueError, match="no window slot"):
        kv.copy_pages([1], [5])
    with pytest.raises(ValueError, match="no layer has a sliding window"):
        HybridKVPool((0, 0), None, KVPool(1, 4, 2, 1, 2), WindowSlots(4, 8))
    with pytest.raises(ValueError, match="window pool has 4 pages for 3"):
        HybridKVPool((4,), None, KVPool(1, 4, 2, 1, 2), WindowSlots(3, 8))
    with pytest.raises(ValueError, match="full pool has 6 pages"):
        HybridKVPool((0, 4), KVPool(1, 6, 2, 1, 2), KVPool(1, 4, 2, 1, 2), WindowSlots(4, 8))
