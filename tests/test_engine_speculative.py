"""Speculative decoding by prompt lookup (``num_speculative_tokens``): greedy outputs equal
transformers' and the engine's own without it, token for token, through mixed batches, a tiny
pool that preempts, EOS and ``max_tokens``; a loop is generated in a fraction of the steps;
requests with logprobs take part and get the entries they would get without drafts (and,
sampled, the entries the model gives their tokens); guided requests in a mixed batch are
unchanged (test_engine_speculative_guided.py tests them alone); a failed forward leaves no draft behind; every page is accounted for after every
step."""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from typing import Any

import pytest
from _model_hf_builders import VOCAB, hf_greedy
from engine_helpers import make_small_llama, run_checked, shared_prefix_prompts

from radixkv.engine import speculative
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.speculative import propose_ngram
from radixkv.model.runner import ModelRunner


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-spec"))


def test_prompt_lookup_proposals() -> None:
    q = lambda *t: array("q", t)  # noqa: E731
    assert propose_ngram(q(1, 2, 3, 4, 1, 2), 4, 2, 4) == [3, 4, 1, 2]
    assert propose_ngram(q(1, 2, 3, 9, 1, 2, 3), 3, 2, 4) == [9, 1, 2]  # the longest n first
    assert propose_ngram(q(7, 7, 7, 7), 5, 2, 4) == [7] * 5  # a loop runs on past the end
    assert propose_ngram(q(1, 2, 1, 2, 1), 4, 1, 1) == [2, 1, 2, 1]
    assert propose_ngram(q(5, 6, 7), 3, 2, 4) == []  # nothing earlier
    assert propose_ngram(q(1, 2, 8, 1, 2), 2, 2, 2) == [8, 1]  # the latest occurrence
    assert propose_ngram(q(3, 1, 2, 4, 4, 1, 2), 1, 2, 2) == [4]
    assert propose_ngram(q(1, 2, 9, 4, 5, 6, 1, 2), 2, 2, 2, window=6) == []  # outside the window
    assert propose_ngram(q(1, 2, 9, 4, 1, 2, 6, 1, 2), 2, 2, 2, window=6) == [6, 1]
    # int64 bytes that match across a token boundary are not an occurrence: 256 = 00 01 00..,
    # so the bytes of [1, 0] appear inside [256, 0] shifted by one byte
    assert propose_ngram(q(256, 0, 0, 5, 1, 0), 3, 2, 2) == []


def _prompts(seed: int) -> list[list[int]]:
    """Shared-prefix prompts plus prompts that repeat themselves (where lookups find drafts)."""
    rng = random.Random(seed)
    loops = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))] * 5 for _ in range(4)]
    return shared_prefix_prompts(seed)[:6] + loops


@pytest.mark.parametrize("cfg", [dict(), dict(num_pages=48, max_prefill_tokens=64)])
def test_greedy_outputs_equal_transformers(small: tuple[Any, Any], cfg: dict[str, Any]) -> None:
    hf, lm = small
    prompts = _prompts(1)
    params = SamplingParams(temperature=0, max_tokens=24)
    kw: dict[str, Any] = dict(page_size=4, num_pages=600, num_speculative_tokens=4)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    outs = run_checked(eng, prompts, params)
    for p, o in zip(prompts, outs):
        ref = hf_greedy(hf, p, params.max_tokens)
        assert o.outputs[0].token_ids == ref, p
    st = eng.stats()
    assert st.speculative_accepted_tokens > 0 and st.speculative_draft_tokens > 0
    if "num_pages" in cfg:
        assert st.num_preemptions > 0


def test_a_loop_takes_a_fraction_of_the_steps() -> None:
    """radixkv-tiny falls into repeating itself on a repetitive prompt: with drafts of 8, the
    same 2 x 300 tokens in under a quarter of the steps."""
    prompts = ["import os\n" * 3 + "def f(x):\n    return x\n" * 4, "for i in range(9):\n" * 3]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    outs, steps = {}, {}
    for k in (0, 8):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=k)
        outs[k] = [o.outputs[0].token_ids for o in run_checked(eng, prompts, params)]
        steps[k] = eng.stats().num_steps
        if k:
            st = eng.stats()
            assert st.speculative_accepted_tokens > 0.8 * st.speculative_draft_tokens
    assert outs[8] == outs[0]
    assert steps[8] * 4 < steps[0]


def test_stop_strings_end_inside_a_run_of_drafts() -> None:
    """A stop string completed by a kept draft ends the output at that draft, as it would
    without speculation: same tokens, text and finish; the drafts after it are dropped and the
    engine's pages stay consistent."""
    prompts = ["for i in range(9):\n" * 3, "import os\n" * 3 + "def f(x):\n    return x\n" * 4]
    plain = Engine("radixkv-tiny", num_pages=256)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    texts = [o.outputs[0].text for o in run_checked(plain, prompts, greedy)]
    # stops cut from the text the model writes: somewhere inside its repetitions
    stops = [[t[40:46]] for t in texts] + [[t[75:79], "zzz"] for t in texts]
    cases = [(p, stop) for p in prompts for stop in stops if stop[0] in texts[prompts.index(p)]]
    assert len(cases) >= 4
    results = {}
    for k in (0, 8):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=k)
        ids = [
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=120, stop=stop))
            for p, stop in cases
        ]
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            eng.check_invariants()
        results[k] = [
            (done[r].outputs[0].token_ids, done[r].outputs[0].text, done[r].outputs[0].stop_reason)
            for r in ids
        ]
        if k:
            assert eng.stats().speculative_accepted_tokens > 0
        assert eng.seq_kv.num_private_pages == 0
        assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)
    assert results[8] == results[0]
    assert all(reason in stop for (_, _, reason), (_, stop) in zip(results[8], cases))


def test_mixed_requests_are_unchanged(small: tuple[Any, Any]) -> None:
    """One batch: greedy requests (drafted, one with a stop string, one with logprobs, some
    with penalties whose drafts are judged position by position, one guided): each output is
    what it is without speculation."""
    _, lm = small
    prompts = _prompts(2)
    kinds = [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, logit_bias={7: 2.0}),
        SamplingParams(temperature=0, max_tokens=20, logprobs=1),
        SamplingParams(temperature=0, max_tokens=20, stop=["ab"]),
        SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=20, guided={"regex": "[a-z ]{1,20}"}),
    ]
    results = {}
    for k in (0, 4):
        eng = Engine(lm, page_size=4, num_pages=800, num_speculative_tokens=k)
        ids = [
            eng.add_request(p, kinds[i % len(kinds)], stream=False) for i, p in enumerate(prompts)
        ]
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            eng.check_invariants()
        results[k] = [(done[r].outputs[0].token_ids, done[r].outputs[0].finish_reason) for r in ids]
        if k:
            assert eng.stats().speculative_draft_tokens > 0
    assert results[4] == results[0]


def test_logprobs_take_part() -> None:
    """Greedy requests with logprobs draft, and every token (kept draft or sampled) gets the
    entry it gets without drafts: same ids in the same order, same ranks, the same values up
    to the batch shape's rounding; a stop string inside a run of drafts cuts the entries with
    the tokens."""
    prompts = ["import os\n" * 3 + "def f(x):\n    return x\n" * 4, "for i in range(9):\n" * 3]
    outs, stats = {}, {}
    for k in (0, 8):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=k)
        params = [
            SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0, max_tokens=160, logprobs=0, stop=[" " * 37]),
        ]
        outs[k] = [o.outputs[0] for p in params for o in run_checked(eng, prompts, p)]
        stats[k] = eng.stats()
    assert stats[8].speculative_accepted_tokens > 0
    assert stats[8].num_steps < stats[0].num_steps
    assert [o.finish_reason for o in outs[8]] == ["length", "length", "stop", "stop"]
    for a, b in zip(outs[0], outs[8]):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        assert a.logprobs is not None and b.logprobs is not None
        assert len(b.logprobs) == len(b.token_ids)
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert list(eb) == list(ea)
            assert [e.rank for e in eb.values()] == [e.rank for e in ea.values()]
            got = [e.logprob for e in eb.values()]
            assert got == pytest.approx([e.logprob for e in ea.values()], abs=1e-4)
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_sampled_drafts_logprobs_are_the_models() -> None:
    """Sampled requests with logprobs draft too; each output token's entry is the model's log
    probability of it there, as scoring the whole output with prompt logprobs gives it."""
    prompt = "import os\n" * 3 + "def f(x):\n    return x\n" * 4
    eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=8)
    params = SamplingParams(temperature=0.3, seed=5, max_tokens=120, ignore_eos=True, logprobs=2)
    out = run_checked(eng, [prompt], params)[0]
    assert eng.stats().speculative_accepted_tokens > 0
    o = out.outputs[0]
    assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
    ids = list(out.prompt_token_ids) + o.token_ids
    score = SamplingParams(
        max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=len(out.prompt_token_ids)
    )
    ref = eng.generate([ids], score, use_tqdm=False)[0].prompt_logprobs
    assert ref is not None
    for tok, entry, want in zip(o.token_ids, o.logprobs, ref[len(out.prompt_token_ids) :]):
        assert next(iter(entry)) == tok and want is not None
        assert entry[tok].logprob == pytest.approx(want[tok].logprob, abs=1e-4)
        assert entry[tok].rank == want[tok].rank


@pytest.mark.parametrize(
    "adjust",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.3, presence_penalty=0.2),
        dict(logit_bias={ord("e"): -100.0, ord("x"): 1.0}),  # no "e" at all
        dict(min_tokens=200, stop_token_ids=[ord(":")]),
    ],
)
def test_penalties_bias_and_min_tokens_take_part(adjust: dict[str, Any]) -> None:
    """Drafts of requests whose logits depend on their history are judged with each position's
    own history (the drafts before it included): greedy outputs equal those without drafts,
    and drafts are proposed and kept. Judging every position by the first one's history
    (``adjust_logits`` of the row's state before the step) fails this."""
    prompts = ["import os\n" * 3 + "def f(x):\n    return x\n" * 4, "for i in range(9):\n" * 3]
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True, **adjust)
    outs, stats = {}, {}
    for k in (0, 8):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=k)
        outs[k] = [o.outputs[0].token_ids for o in run_checked(eng, prompts, params)]
        stats[k] = eng.stats()
    assert outs[8] == outs[0]
    assert stats[8].speculative_accepted_tokens > 0
    assert stats[8].num_steps < stats[0].num_steps


def test_eos_and_max_tokens_end_where_they_would(small: tuple[Any, Any]) -> None:
    """A draft that is EOS is never accepted (the model's own choice ends the output), and a
    step never runs past max_tokens: finish reasons and lengths are the same."""
    _, lm = small
    prompts = _prompts(3)
    got = {}
    for k in (0, 6):
        eng = Engine(lm, page_size=4, num_pages=800, num_speculative_tokens=k)
        for max_tokens in (1, 2, 7, 40):
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
            outs = run_checked(eng, prompts, params)
            got[k, max_tokens] = [
                (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs
            ]
    for max_tokens in (1, 2, 7, 40):
        assert got[6, max_tokens] == got[0, max_tokens]
        assert all(len(t) <= max_tokens for t, _ in got[6, max_tokens])
    assert any(r == "stop" for _, r in got[6, 40])  # some ended at EOS


def test_failed_forward_leaves_no_draft(
    small: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=300, num_speculative_tokens=4)
    prompt = [5, 6, 7, 8] * 6
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=30))
    before = 0
    for _ in range(3):
        before = max([len(o.outputs[0].token_ids) for o in eng.step()], default=before)
    assert 0 < before < 30
    original = ModelRunner.forward_hidden

    def boom(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(ModelRunner, "forward_hidden", boom)
    monkeypatch.setattr(speculative, "propose_ngram", lambda *a: [5, 6, 7])  # drafts for sure
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()  # drafted: the forward that keeps hidden states runs, and fails
    out = next(o for o in eng.drain() if o.request_id == rid)
    c = out.outputs[0]
    assert c.finish_reason == "error"
    assert len(c.token_ids) == before  # the drafts were taken back out
    monkeypatch.setattr(ModelRunner, "forward_hidden", original)
    eng.check_invariants()
    assert eng.stats().locked_pages == 0 and not eng.has_unfinished()
    # the engine goes on serving
    (again,) = run_checked(eng, [prompt], SamplingParams(temperature=0, max_tokens=5))
    assert again.outputs[0].finish_reason in ("length", "stop")


def test_config_is_checked() -> None:
    for bad in (
        dict(num_speculative_tokens=-1),
        dict(num_speculative_tokens=True),
        dict(num_speculative_tokens=1, prompt_lookup_min=0),
        dict(num_speculative_tokens=1, prompt_lookup_min=5, prompt_lookup_max=3),
    ):
        with pytest.raises(ValueError, match=r"speculative|prompt_lookup"):
            Engine("radixkv-tiny", num_pages=16, **bad)


def test_speculative_sampling_keeps_the_distribution() -> None:
    """accept_sampled against drafts that are sometimes likely, sometimes not: each position's
    token frequencies over 20,000 draws match the target distribution (the first position's
    directly; the second's given the first draft kept), and a banned draft is never kept."""
    import torch

    from radixkv.engine.speculative import accept_sampled

    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7], [0.25, 0.25, 0.25, 0.25]])
    drafts = [1, 3]
    n = 20_000
    first = torch.zeros(4)
    second = torch.zeros(4)
    kept_first = 0
    for _ in range(n):
        a, tok = accept_sampled(q, drafts, (), g)
        first[drafts[0] if a >= 1 else tok] += 1
        if a >= 1:
            kept_first += 1
            second[drafts[1] if a >= 2 else tok] += 1
    assert torch.allclose(first / n, q[0], atol=0.015)
    assert abs(kept_first / n - 0.3) < 0.015  # the first draft kept with its probability
    assert torch.allclose(second / kept_first, q[1], atol=0.02)
    for _ in range(200):
        a, tok = accept_sampled(q, [2, 3], {2}, g)
        assert a == 0  # a stop token is not offered; the token comes from q[0] whole
    assert accept_sampled(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), [1], (), g) == (1, 0)


def test_sampled_requests_draft_too() -> None:
    """Sampled requests on a repeating prompt keep most drafts (the loop is likely) and stay
    reproducible by seed."""
    prompts = ["import os\n" * 3 + "def f(x):\n    return x\n" * 4]
    params = SamplingParams(temperature=0.1, top_k=20, seed=11, max_tokens=120, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=6)
        runs.append([o.outputs[0].token_ids for o in run_checked(eng, prompts, params)])
        st = eng.stats()
        assert st.speculative_accepted_tokens > 0.8 * st.speculative_draft_tokens > 0
        assert st.num_steps < 0.3 * 120
    assert runs[0] == runs[1]


def test_text_that_does_not_repeat_backs_off() -> None:
    """radixkv-tiny writing code that does not repeat itself: refused drafts make a sequence
    look up less and less often, so it drafts fewer tokens than it generates (407 drafts for
    600 tokens; without the back off 1,644), and the outputs are unchanged."""
    code = Path(__file__).read_text()[:1500]
    prompts = [code, code[:700] + "\n\ndef ", "def read_lines(path):\n"]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = {}
    for k in (0, 5):
        eng = Engine("radixkv-tiny", num_pages=512, num_speculative_tokens=k)
        outs[k] = [o.outputs[0].token_ids for o in run_checked(eng, prompts, params)]
        st = eng.stats()
    assert outs[5] == outs[0]
    assert 0 < st.speculative_draft_tokens < st.generated_tokens


def test_drafts_alongside_cascade_decode() -> None:
    """Branches of one long prompt: cascade on or off, drafts on or off, the same greedy tokens;
    drafted rows leave the cascade to the plain decode rows of the step."""
    prefix = (Path(__file__).parents[1] / "radixkv" / "engine" / "scheduler.py").read_text()[:3000]
    prompts = [prefix + f"\n# branch {i}\n" + "x = 1\n" * 3 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    got = {}
    for cascade in ("off", "on"):
        for k in (0, 4):
            eng = Engine("radixkv-tiny", num_pages=1024, cascade=cascade, num_speculative_tokens=k)
            got[cascade, k] = [o.outputs[0].token_ids for o in run_checked(eng, prompts, params)]
            st = eng.stats()
            assert (st.cascade_steps > 0) == (cascade == "on")
            assert (st.speculative_draft_tokens > 0) == (k > 0)
    assert all(v == got["off", 0] for v in got.values())
