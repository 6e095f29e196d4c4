"""Beam search (engine/beam_search.py): the same hypotheses and scores as Hugging Face's
``generate(num_beams=W)`` on the same checkpoint, under every engine shape (one batch, chunked
prefill, a pool small enough to preempt beams, the prefix cache off); beams share pages; pages
and locks are all accounted for after every step, however a search ends; bad combinations are
refused."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
from _model_hf_builders import EOS_ID, build_hf_model, save_hf_folder
from engine_helpers import VOCAB, run_checked

from radixkv.engine.beam_search import BeamSearch
from radixkv.engine.engine import Engine
from radixkv.engine.params import GuidedDecodingParams, SamplingParams
from radixkv.engine.request import SeqStatus
from radixkv.engine.scheduler import Scheduler
from radixkv.model.loader import load_model

W = 4
MAX_TOKENS = 14
SCORE_ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The small random Llama with its EOS row tilted towards two common tokens', so that
    beams end with EOS now and then (an untouched random model almost never writes it)."""
    hf = build_hf_model("llama", seed=3)
    with torch.no_grad():
        w = hf.lm_head.weight
        w[EOS_ID] = w[137] * 0.9 + w[284] * 0.3
    folder = tmp_path_factory.mktemp("beam-llama")
    save_hf_folder(hf, folder)
    return hf, load_model(folder)


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [1] + [rng.randrange(3, VOCAB) for _ in range(9)]
    out = [
        shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(n)
    ]
    out.append([1] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 25))])
    return out


def _hf_beams(
    hf: Any, prompt: list[int], params: SamplingParams, **extra: Any
) -> tuple[list[list[int]], list[float]]:
    """Hugging Face's n best hypotheses (output tokens, cut after EOS) and their scores;
    ``extra``: more ``generate`` arguments."""
    ref = hf.generate(
        torch.tensor([prompt]),
        num_beams=params.beam_width,
        num_return_sequences=params.n,
        do_sample=False,
        max_new_tokens=params.max_tokens,
        min_new_tokens=params.min_tokens or None,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        **extra,
    )
    seqs = []
    for row in ref.sequences[:, len(prompt) :].tolist():
        seqs.append(row[: row.index(EOS_ID) + 1] if EOS_ID in row else row)
    return seqs, ref.sequences_scores.tolist()


SETTINGS = [
    pytest.param(dict(length_penalty=1.0, early_stopping=False), id="lp1"),
    pytest.param(dict(length_penalty=0.0, early_stopping="never"), id="lp0-never"),
    pytest.param(dict(length_penalty=2.0, early_stopping="never"), id="lp2-never"),
    pytest.param(dict(length_penalty=1.0, early_stopping=True, min_tokens=3), id="early-min"),
    pytest.param(dict(length_penalty=-1.0, early_stopping=False), id="lp-1"),
]
SHAPES = [
    pytest.param(dict(page_size=4), id="batched"),
    pytest.param(dict(page_size=4, num_pages=24, max_prefill_tokens=32), id="preempting"),
    pytest.param(dict(page_size=4, enable_prefix_cache=False), id="no-cache"),
    pytest.param(dict(page_size=16, chunked_prefill_size=5, max_prefill_tokens=8), id="chunked"),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_beams_are_hugging_faces(
    models: tuple[Any, Any], shape: dict[str, Any], setting: dict[str, Any]
) -> None:
    hf, lm = models
    engine = Engine(lm, max_model_len=256, **shape)
    params = SamplingParams(beam_width=W, n=3, max_tokens=MAX_TOKENS, **setting)
    prompts = _prompts(0)  # beams end with EOS in every setting
    outs = run_checked(engine, prompts, params)
    stops = 0
    for prompt, out in zip(prompts, outs):
        want, scores = _hf_beams(hf, prompt, params)
        assert [o.token_ids for o in out.outputs] == want
        for o, score in zip(out.outputs, scores):
            assert o.score == pytest.approx(score, rel=1e-5, abs=SCORE_ATOL)
            n = len(o.token_ids)
            assert o.score == pytest.approx(o.cumulative_logprob / n**params.length_penalty)
            ended = o.token_ids[-1] == EOS_ID
            assert o.finish_reason == ("stop" if ended else "length")
            assert o.stop_reason == (EOS_ID if ended else None)
            assert EOS_ID not in o.token_ids[:-1]
            assert o.text == engine.tokenizer.decode(
                o.token_ids[:-1] if ended else o.token_ids, skip_special_tokens=True
            )
            stops += ended
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert out.finished and out.token_ids == out.outputs[0].token_ids
        m = out.metrics
        assert m.ttft is not None and 0 < m.ttft <= m.latency
    assert stops, "no hypothesis ended with EOS: the test would not exercise it"
    if shape.get("num_pages"):
        assert engine.stats().num_preemptions > 0


def test_beams_share_pages_and_cache_what_they_computed(models: tuple[Any, Any]) -> None:
    """While decoding, every beam holds at most its tail page privately (the rest are trie
    pages under one lock each); afterwards the best hypothesis is a cache hit."""
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    prompt = _prompts(1)[0] * 3
    params = SamplingParams(beam_width=W, n=W, max_tokens=12, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    assert len(engine._live[rid].seqs) == 1  # the prompt is one beam until its logits come
    widths = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
        engine.check_invariants()
        group = engine._live.get(rid)
        if group is None:
            continue
        beams = [s for s in group.seqs if not s.finished]
        widths.append(len(beams))
        for s in beams:
            if s.status is SeqStatus.RUNNING:
                assert len(s.page_table) - s.num_shared_pages <= 1, s
                assert s.num_shared_pages >= len(prompt) // 4
    assert max(widths) == W
    assert final is not None and final.finished and len(final.outputs) == W
    best = final.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in final.outputs}) == W  # distinct hypotheses
    hit = engine.generate([prompt + best + [5]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert hit[0].num_cached_tokens == (len(prompt) + len(best)) // 4 * 4


def test_beam_width_one_is_greedy(models: tuple[Any, Any]) -> None:
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    prompts = _prompts(2)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    beams = engine.generate(prompts, SamplingParams(beam_width=1, max_tokens=10), use_tqdm=False)
    for g, b in zip(greedy, beams):
        assert b.outputs[0].token_ids == g.outputs[0].token_ids


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "priority"])
@pytest.mark.parametrize("max_running", [256, 4, 3])
def test_beams_run_beside_sampled_requests(
    models: tuple[Any, Any], max_running: int, policy: str
) -> None:
    """A batch mixing beam searches and greedy requests gives each what it gives alone, and
    never runs more sequences than ``max_running_requests`` (a search holds its W slots from
    its first admission: its forks join the running list without one)."""
    _, lm = models
    prompts = _prompts(3)
    beam = SamplingParams(beam_width=3, n=2, max_tokens=9)
    greedy = SamplingParams(temperature=0, max_tokens=9)
    alone = Engine(lm, page_size=4, max_model_len=256)
    want_beam = alone.generate(prompts[:3], beam, use_tqdm=False)
    want_greedy = alone.generate(prompts[3:], greedy, use_tqdm=False)
    mixed = Engine(
        lm,
        page_size=4,
        max_model_len=256,
        max_running_requests=max_running,
        schedule_policy=policy,
    )
    # under priority the greedy requests come first and may take the slots of a running search
    urgent = dict(priority=-1) if policy == "priority" else {}
    ids = [mixed.add_request(p, beam) for p in prompts[:3]]
    ids += [mixed.add_request(p, dataclasses.replace(greedy, **urgent)) for p in prompts[3:]]
    done: dict[str, Any] = {}
    most = 0
    while mixed.has_unfinished():
        for o in mixed.step():
            done[o.request_id] = o
        mixed.check_invariants()
        most = max(most, len(mixed.scheduler.running))
    assert most <= max_running
    assert most >= 3  # a search's beams did run at once
    outs = [done[i] for i in ids]
    for got, want in zip(outs, want_beam + want_greedy):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


def test_a_beam_width_above_max_running_requests_is_refused(models: tuple[Any, Any]) -> None:
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256, max_running_requests=3)
    with pytest.raises(ValueError, match="beam_width=4 exceeds max_running_requests=3"):
        engine.add_request([1, 5, 6], SamplingParams(beam_width=4))
    assert not engine.has_unfinished()
    engine.check_invariants()


def test_a_pool_that_holds_one_beam_at_a_time_still_finishes(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With pages for one sequence, beams parked until their siblings catch up must make way
    for them (else the step would schedule nothing forever); the result is unchanged."""
    hf, lm = models
    unparks = []
    real = Scheduler._unpark

    def unpark(self: Scheduler, batch: Any) -> None:
        unparks.append(sum(s.parked for s in self.running))
        real(self, batch)

    monkeypatch.setattr(Scheduler, "_unpark", unpark)
    for seed in (4, 5):
        prompt = _prompts(seed)[0]
        params = SamplingParams(beam_width=W, n=W, max_tokens=8)
        engine = Engine(lm, page_size=4, num_pages=-(-(len(prompt) + 8) // 4), max_model_len=256)
        out = run_checked(engine, [prompt], params)[0]
        want, _ = _hf_beams(hf, prompt, params)
        assert [o.token_ids for o in out.outputs] == want
        assert engine.stats().num_preemptions > 0
    assert any(unparks), "no parked beam had to make way: the test would not exercise it"


def test_abort_returns_the_best_so_far_and_releases_everything(models: tuple[Any, Any]) -> None:
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    rid = engine.add_request(
        _prompts(5)[0], SamplingParams(beam_width=W, n=W, max_tokens=50, ignore_eos=True)
    )
    for _ in range(6):
        engine.step()
    out = engine.abort(rid)
    assert out.finished and len(out.outputs) == W
    assert all(o.finish_reason == "abort" for o in out.outputs)
    scores = [o.score for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert all(len(o.token_ids) == len(out.outputs[0].token_ids) for o in out.outputs)
    assert not engine.has_unfinished()
    engine.check_invariants()  # idle: no lock, no private page left


def test_a_failed_forward_ends_the_search_with_error_and_others_go_on(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    rid = engine.add_request(
        _prompts(6)[0], SamplingParams(beam_width=W, max_tokens=20, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    real = engine.runner.forward
    monkeypatch.setattr(
        engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    monkeypatch.setattr(engine.runner, "forward", real)
    final = {o.request_id: o for o in engine.drain()}
    assert final[rid].finished
    assert {o.finish_reason for o in final[rid].outputs} <= {"error"}
    engine.check_invariants()
    again = engine.generate(
        [_prompts(6)[0]], SamplingParams(beam_width=2, max_tokens=4), use_tqdm=False
    )
    assert again[0].outputs[0].finish_reason == "length"
    engine.check_invariants()


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]])
@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_are_each_tokens_under_the_beam_that_chose_it(
    models: tuple[Any, Any], shape: dict[str, Any], top: int
) -> None:
    """With ``logprobs``, every token of every hypothesis has its entry, checked against
    Hugging Face's log_softmax of the hypothesis re-read in one forward: the token's own log
    probability and rank and the ``top`` most likely tokens there; the entries add up to the
    hypothesis's total; the hypotheses are the ones without logprobs."""
    hf, lm = models
    engine = Engine(lm, max_model_len=256, **shape)
    plain = SamplingParams(beam_width=W, n=3, max_tokens=MAX_TOKENS, min_tokens=2)
    params = SamplingParams(beam_width=W, n=3, max_tokens=MAX_TOKENS, min_tokens=2, logprobs=top)
    prompts = _prompts(7)
    without = run_checked(engine, prompts, plain)
    outs = run_checked(engine, prompts, params)
    for prompt, out, ref in zip(prompts, outs, without):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ref.outputs]
        for o in out.outputs:
            assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + o.token_ids])).logits[0].float()
            want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # [T, V]
            total = 0.0
            for pos, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
                row = want[pos]
                first = next(iter(entry))
                assert first == tok  # the chosen token comes first
                assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
                assert entry[tok].rank == int((row > row[tok] + 1e-5).sum()) + 1
                assert entry[tok].decoded_token == engine.tokenizer.decode(
                    [tok], skip_special_tokens=False
                )
                top_ids = row.topk(top).indices.tolist() if top else []
                assert set(entry) == {tok, *top_ids}
                for rank, alt in enumerate(top_ids, 1):
                    assert entry[alt].rank == rank
                    assert entry[alt].logprob == pytest.approx(row[alt].item(), abs=1e-4)
                total += entry[tok].logprob
            assert total == pytest.approx(o.cumulative_logprob, abs=1e-3)


def test_logprobs_of_width_one_are_greedy_samplings(models: tuple[Any, Any]) -> None:
    """Beam search of width 1 is greedy decoding, logprobs included."""
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    prompts = _prompts(8)
    greedy = engine.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False
    )
    beams = engine.generate(
        prompts, SamplingParams(beam_width=1, max_tokens=8, logprobs=2), use_tqdm=False
    )
    for g, b in zip(greedy, beams):
        go, bo = g.outputs[0], b.outputs[0]
        assert bo.token_ids == go.token_ids
        assert bo.logprobs is not None and go.logprobs is not None
        for eb, eg in zip(bo.logprobs, go.logprobs):
            assert list(eb) == list(eg)
            for tok in eg:
                assert eb[tok].rank == eg[tok].rank
                assert eb[tok].logprob == pytest.approx(eg[tok].logprob, abs=1e-5)


def test_an_aborted_search_returns_its_live_beams_logprobs(models: tuple[Any, Any]) -> None:
    _, lm = models
    engine = Engine(lm, page_size=4, max_model_len=256)
    params = SamplingParams(beam_width=W, n=W, max_tokens=40, ignore_eos=True, logprobs=1)
    rid = engine.add_request(_prompts(9)[0], params)
    for _ in range(6):
        engine.step()
    final = engine.abort(rid)
    engine.check_invariants()
    assert final.finished and len(final.outputs) == W
    for o in final.outputs:
        assert o.finish_reason == "abort"
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids) > 0
        assert sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)) == pytest.approx(
            o.cumulative_logprob, abs=1e-3
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beam_width=2, n=3), "n=3 exceeds beam_width=2"),
        (dict(beam_width=-1), "beam_width must be an integer >= 0"),
        (dict(beam_width=2, stop=["x"]), "beam search cannot be combined with stop strings"),
        (dict(beam_width=2, repetition_penalty=1.2), "cannot be combined with penalties"),
        (dict(beam_width=2, logit_bias={3: 1.0}), "cannot be combined with logit_bias"),
        (dict(length_penalty=2.0), "apply to beam search only"),
        (dict(early_stopping=True), "apply to beam search only"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping must be"),
        (dict(beam_width=2, length_penalty=math.nan), "length_penalty must be a finite"),
    ],
)
def test_bad_combinations_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


CHOICES = ["cab", "car", "cart", "do", "dog", "{ca}"]
LANGUAGES = [
    pytest.param(GuidedDecodingParams(choice=CHOICES), id="choice"),
    pytest.param(GuidedDecodingParams(regex="(ca|d[ao])+!?"), id="regex"),
    pytest.param(
        GuidedDecodingParams(grammar='start: item+\nitem: "(" item* ")" | "ca"'), id="lark"
    ),
]


@pytest.mark.parametrize("guided", LANGUAGES)
def test_guided_beams_are_hugging_faces_with_the_language_as_allowed_tokens(
    models: tuple[Any, Any], guided: GuidedDecodingParams
) -> None:
    """Each beam walks its own copy of the language (forks copy the walk): the hypotheses and
    scores are Hugging Face's with ``prefix_allowed_tokens_fn`` giving, for each beam, what a
    fresh walk of that beam's tokens allows (no fork involved). A choice's finished outputs are
    among the choices."""
    from radixkv.engine.guided import GuideCompiler

    hf, lm = models
    engine = Engine(lm, max_model_len=256, page_size=4)
    oracle = GuideCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    params = SamplingParams(beam_width=W, n=3, max_tokens=MAX_TOKENS, guided=guided)
    prompts = _prompts(0, 3)
    outs = run_checked(engine, prompts, params)
    for prompt, out in zip(prompts, outs):

        def allowed(batch_id: int, input_ids: torch.Tensor, start: int = len(prompt)) -> list[int]:
            walk = oracle.guide(guided)
            for t in input_ids[start:].tolist():
                walk.advance(t)
            return walk.allowed().nonzero()[0].tolist()

        want, scores = _hf_beams(hf, prompt, params, prefix_allowed_tokens_fn=allowed)
        assert [o.token_ids for o in out.outputs] == want
        for o, score in zip(out.outputs, scores):
            assert o.score == pytest.approx(score, rel=1e-5, abs=SCORE_ATOL)
            if guided.choice is not None and o.finish_reason == "stop":
                assert o.text in CHOICES
    assert any(o.finish_reason == "stop" for out in outs for o in out.outputs)


def test_guided_beams_with_ignore_eos_end_where_the_language_must(
    models: tuple[Any, Any],
) -> None:
    """``ignore_eos`` keeps EOS out where a choice may end or go on ("car" -> "cart", "do" ->
    "dog"); where the language must end, EOS ends the beam (it is all the walk offers), so no
    hypothesis runs on to ``max_tokens`` writing EOS. Hugging Face's, with the walk's
    ``allow_eos=False`` masks as allowed tokens."""
    from radixkv.engine.guided import GuideCompiler

    hf, lm = models
    engine = Engine(lm, max_model_len=256, page_size=4)
    oracle = GuideCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    guided = GuidedDecodingParams(choice=CHOICES)
    params = SamplingParams(
        beam_width=W, n=3, max_tokens=MAX_TOKENS, guided=guided, ignore_eos=True
    )
    prompts = _prompts(1, 3)
    outs = run_checked(engine, prompts, params)
    for prompt, out in zip(prompts, outs):

        def allowed(batch_id: int, input_ids: torch.Tensor, start: int = len(prompt)) -> list[int]:
            walk = oracle.guide(guided, allow_eos=False)
            for t in input_ids[start:].tolist():
                walk.advance(t)
            return walk.allowed().nonzero()[0].tolist()

        want, _ = _hf_beams(hf, prompt, params, prefix_allowed_tokens_fn=allowed)
        assert [o.token_ids for o in out.outputs] == want
        for o in out.outputs:
            assert o.finish_reason == "stop" and o.token_ids[-1] == EOS_ID
            assert o.text in {"cab", "cart", "dog", "{ca}"}


# ---------------------------------------------------------------- the selection on its own
def _search(**kw: Any) -> BeamSearch:
    return BeamSearch(SamplingParams(**{"beam_width": 2, "max_tokens": 10, **kw}), stop_ids=[0])


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.log_softmax(torch.tensor(rows), dim=-1)


def test_the_first_step_branches_one_beam_into_w() -> None:
    s = _search()
    nxt = s.step([0.0], _rows([0.0, 3.0, 2.0, 1.0]), 0, lambda i: [])
    assert [(c.parent, c.token) for c in nxt] == [(0, 1), (0, 2)]
    assert not s.done and not s.finished


def test_a_stop_among_the_first_w_finishes_a_hypothesis_and_a_later_one_does_not() -> None:
    s = _search()
    # beam 0's best is the stop token (0): it finishes; the next two continue
    nxt = s.step([0.0, -10.0], _rows([5.0, 1.0, 0.0], [0.0, 1.0, 0.0]), 3, lambda i: [7, 7, 7])
    assert [h.token_ids for h in s.finished] == [[7, 7, 7, 0]]
    assert s.finished[0].finish_reason == "stop" and s.finished[0].stop_reason == 0
    assert s.finished[0].score == pytest.approx(s.finished[0].cumulative_logprob / 4)
    assert [c.parent for c in nxt] == [0, 0] and 0 not in [c.token for c in nxt]
    s2 = _search()
    s2.step([0.0, -2.0], _rows([0.0, 5.0, 4.0], [9.0, 1.0, 0.0]), 3, lambda i: [7])
    assert not s2.finished  # beam 1's stop ranks third (K = 4, but only the first W finish)


def test_min_tokens_holds_the_stop_back_and_ignore_eos_is_the_callers() -> None:
    s = _search(min_tokens=2)
    nxt = s.step([0.0], _rows([9.0, 1.0, 0.0]), 1, lambda i: [5])
    assert not s.finished and all(c.token != 0 for c in nxt)
    s = BeamSearch(SamplingParams(beam_width=2, max_tokens=10), stop_ids=[])
    nxt = s.step([0.0], _rows([9.0, 1.0, 0.0]), 1, lambda i: [5])
    assert nxt[0].token == 0 and not s.finished


def test_max_tokens_finishes_the_first_w_and_ends() -> None:
    s = _search(max_tokens=3)
    assert s.step([0.0, -0.5], _rows([0.0, 2.0, 1.0], [0.0, 1.0, 2.0]), 2, lambda i: [i]) == []
    assert s.done and len(s.finished) == 2
    assert all(h.finish_reason == "length" for h in s.finished)
    assert s.results([], None) == s.finished[:1]  # n = 1


def test_early_stopping_true_ends_with_w_finished() -> None:
    s = _search(early_stopping=True)
    s.step([0.0, -0.05], _rows([5.0, 4.9, 0.0], [5.0, 0.0, 4.9]), 3, lambda i: [i])
    assert len(s.finished) == 2 and s.done
