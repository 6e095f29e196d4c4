"""Failure containment (issue 47): an error raised while serving one sequence ends that
sequence alone with "error" (its request's ``error`` says why), releases its pages and locks,
and every other sequence of the batch gets exactly the output it gets without the failure. A
failing model forward (shared state) fails its batch, is logged and counted, and the engine
serves on. Grammars the parser cannot hold are refused at intake. A beam search's step (its
rows, its selection, its forks) and a speculative row's verification are contained the same
way: one request or row fails, the others' outputs are unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

import radixkv.engine.engine as engine_mod
import radixkv.engine.speculative as speculative_mod
from radixkv import Engine
from radixkv.engine.beam_runner import BeamRunner
from radixkv.engine.beam_search import BeamSearch
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.guided import MAX_RULE_ALTERNATIVES, TokenGuide
from radixkv.engine.params import GuidedDecodingParams, SamplingParams

VICTIM = "t0-victim"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("radixkv-tiny", num_pages=512, page_size=4, max_running_requests=64)


def _tenants() -> list[tuple[str, str, SamplingParams]]:
    """Many tenants' requests: greedy and seeded sampling, a guided one, logprobs, stop strings,
    a logit bias; the victim has every feature a stage may fail in."""
    out = []
    for i in range(8):
        p = SamplingParams(
            max_tokens=6,
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            logprobs=2 if i % 3 == 0 else None,
            stop=["zz"] if i % 4 == 0 else None,
            logit_bias={5: 1.0} if i % 5 == 0 else None,
            guided=GuidedDecodingParams(regex="[a-z ]+") if i == 6 else None,
        )
        out.append((f"t{i}-req", f"tenant {i} says hello to", p))
    victim = SamplingParams(
        max_tokens=6,
        temperature=0.7,
        seed=99,
        logprobs=3,
        stop=["qq"],
        logit_bias={7: 0.5},
        guided=GuidedDecodingParams(regex="[a-z ]+"),
    )
    out.insert(5, (VICTIM, "the victim's prompt, shared with nobody", victim))
    return out


def _run(engine: Engine, reqs: list[tuple[str, str, SamplingParams]]) -> dict[str, Any]:
    for rid, prompt, p in reqs:
        engine.add_request(prompt, p, request_id=rid, stream=False)
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    engine.check_invariants()  # idle: every lock count zero, no private page left
    st = engine.stats()
    assert st.locked_pages == 0 and st.private_pages == 0
    return done


def _is_victim(engine: Engine) -> Callable[[Any], bool]:
    group = engine._live.get(VICTIM)
    seqs = set() if group is None else {id(s) for s in group.seqs}
    return lambda seq: id(seq) in seqs


def _victim_params(engine: Engine) -> Any:
    group = engine._live.get(VICTIM)
    return None if group is None else group.params


def _inject(stage: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make one per-sequence stage raise for the victim request only."""

    def boom() -> None:
        raise RuntimeError(f"injected {stage} failure")

    if stage in ("adjust", "sample"):
        name = {"adjust": "adjust_logits", "sample": "sample"}[stage]
        real = getattr(engine_mod, name)

        def wrapped(logits: Any, params: Any, *a: Any, **k: Any) -> Any:
            if any(p is _victim_params(engine) for p in params):
                boom()
            return real(logits, params, *a, **k)

        monkeypatch.setattr(engine_mod, name, wrapped)
    elif stage == "logprobs":
        real_lp = engine_mod.step_logprobs

        def wrapped_lp(logits: Any, tokens: Any, tops: Any, *a: Any, **k: Any) -> Any:
            if 3 in tops:  # only the victim asks for 3
                boom()
            return real_lp(logits, tokens, tops, *a, **k)

        monkeypatch.setattr(engine_mod, "step_logprobs", wrapped_lp)
    elif stage in ("mask", "advance"):
        real_g = getattr(TokenGuide, stage)

        def wrapped_g(self: TokenGuide, *a: Any) -> Any:
            g = engine._live.get(VICTIM)
            if g is not None and any(s.guide is self for s in g.seqs):
                boom()
            return real_g(self, *a)

        monkeypatch.setattr(TokenGuide, stage, wrapped_g)
    elif stage == "stop-string":
        real_add = IncrementalDetokenizer.add

        def wrapped_add(self: Any, tok: int) -> Any:
            g = engine._live.get(VICTIM)
            if g is not None and any(s.detok is self for s in g.seqs):
                boom()
            return real_add(self, tok)

        monkeypatch.setattr(IncrementalDetokenizer, "add", wrapped_add)
    elif stage == "detokenize":
        real_dec = engine_mod.decode_output
        victim_ids: list[Any] = []

        def wrapped_dec(tok: Any, ids: Any, **k: Any) -> Any:
            g = engine._live.get(VICTIM)
            if g is not None and any(s.output_ids == ids for s in g.seqs):
                victim_ids.append(ids)
                boom()
            return real_dec(tok, ids, **k)

        monkeypatch.setattr(engine_mod, "decode_output", wrapped_dec)
    else:
        raise AssertionError(stage)


@pytest.fixture(scope="module")
def baseline(engine: Engine) -> dict[str, Any]:
    return _run(engine, [r for r in _tenants() if r[0] != VICTIM])


STAGES = ["adjust", "mask", "sample", "logprobs", "advance", "stop-string", "detokenize"]


@pytest.mark.parametrize("stage", STAGES)
def test_one_sequence_fails_alone(
    engine: Engine, baseline: dict[str, Any], stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reqs = _tenants()
    if stage == "detokenize":  # the final decode runs for requests not detokenized live
        reqs = [
            (rid, pr, dataclasses.replace(p, stop=None) if rid == VICTIM else p)
            for rid, pr, p in reqs
        ]
    before = engine.stats()
    _inject(stage, engine, monkeypatch)
    done = _run(engine, reqs)
    monkeypatch.undo()
    victim = done[VICTIM]
    assert victim.finish_reason == "error"
    assert victim.error is not None and f"injected {stage} failure" in victim.error
    for rid, out in baseline.items():
        assert done[rid].error is None
        assert done[rid].token_ids == out.token_ids, rid
        assert done[rid].text == out.text, rid
        assert done[rid].finish_reason == out.finish_reason, rid
    after = engine.stats()
    assert after.num_sequence_errors == before.num_sequence_errors + 1
    assert after.num_batch_failures == before.num_batch_failures
    # the engine serves on: the victim's request again, unharmed
    again = _run(engine, [r for r in reqs if r[0] == VICTIM])
    assert again[VICTIM].finish_reason in ("stop", "length")


def test_forward_failure_fails_the_batch_and_recovers(
    engine: Engine, baseline: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    reqs = [r for r in _tenants() if r[0] != VICTIM]
    for rid, prompt, p in reqs:
        engine.add_request(prompt, p, request_id=rid, stream=False)
    engine.step()
    real = engine.runner.forward

    def broken(*a: Any, **k: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "forward", broken)
    before = engine.stats().num_batch_failures
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    outs = {o.request_id: o for o in engine.drain()}
    assert outs and all(o.finish_reason == "error" for o in outs.values())
    assert all("device lost" in (o.error or "") for o in outs.values())
    assert engine.stats().num_batch_failures == before + 1
    assert "the engine serves on" in caplog.text
    monkeypatch.setattr(engine.runner, "forward", real)
    while engine.has_unfinished():  # whatever the failed step did not schedule
        engine.step()
    engine.check_invariants()
    done = _run(engine, reqs)
    for rid, out in baseline.items():
        assert done[rid].token_ids == out.token_ids, rid


def test_oversized_grammar_refused_at_intake(engine: Engine) -> None:
    n = MAX_RULE_ALTERNATIVES + 2
    alts = " | ".join(f'"w{i}"' for i in range(n))
    for grammar in ("start: x\nx: " + alts + "\n", 'start: "a" x\nx: (' + alts + ")\n"):
        p = SamplingParams(max_tokens=4, guided=GuidedDecodingParams(grammar=grammar))
        with pytest.raises(ValueError, match=f"the limit is {MAX_RULE_ALTERNATIVES} per rule"):
            engine.add_request("hi", p)
    assert not engine.has_unfinished()
    # at the limit it compiles and serves
    ok = " | ".join(f'"w{i}"' for i in range(MAX_RULE_ALTERNATIVES))
    p = SamplingParams(max_tokens=8, guided=GuidedDecodingParams(grammar="start: x\nx: " + ok))
    (out,) = engine.generate(["hi"], p, use_tqdm=False)
    assert out.finish_reason == "stop" and out.text.startswith("w")


# ------------------------------------------------------------------ beam search and speculation
BEAM_VICTIM = "beam-victim"


def _beam_tenants() -> list[tuple[str, str, SamplingParams]]:
    """The sampled tenants, another beam search, and a guided beam search victim with logprobs
    (every stage of a beam step: its rows, its selection, its forks and its language)."""
    out = [r for r in _tenants() if r[0] != VICTIM]
    out.append(
        (
            "beam-ok",
            "a beam searched by another tenant",
            SamplingParams(beam_width=3, n=2, max_tokens=6),
        )
    )
    victim = SamplingParams(
        beam_width=3, n=2, max_tokens=6, logprobs=1, guided=GuidedDecodingParams(regex="[a-z ]+")
    )
    out.insert(3, (BEAM_VICTIM, "the beam victim's own prompt", victim))
    return out


def _inject_beam(stage: str, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def victim() -> Any:
        return engine._live.get(BEAM_VICTIM)

    def boom() -> None:
        raise RuntimeError(f"injected {stage} failure")

    if stage == "beam-observe":
        real_keep = BeamRunner.keep

        def keep(self: BeamRunner, seq: Any, row: Any) -> None:
            if seq.group is victim():
                boom()
            real_keep(self, seq, row)

        monkeypatch.setattr(BeamRunner, "keep", keep)
    elif stage == "beam-select":
        real_step = BeamSearch.step

        def step(self: BeamSearch, *a: Any, **k: Any) -> Any:
            g = victim()
            if g is not None and g.beam is self and g.seqs[0].num_output_tokens >= 2:
                boom()
            return real_step(self, *a, **k)

        monkeypatch.setattr(BeamSearch, "step", step)
    elif stage == "beam-branch":  # after the forks, as the continuing beams advance
        real_adv = TokenGuide.advance

        def advance(self: TokenGuide, tok: int) -> Any:
            g = victim()
            started = g is not None and g.seqs[0].num_output_tokens >= 1
            if started and any(s.guide is self for s in g.seqs):
                boom()
            return real_adv(self, tok)

        monkeypatch.setattr(TokenGuide, "advance", advance)
    else:
        raise AssertionError(stage)


@pytest.fixture(scope="module")
def beam_baseline(engine: Engine) -> dict[str, Any]:
    return _run(engine, [r for r in _beam_tenants() if r[0] != BEAM_VICTIM])


@pytest.mark.parametrize("stage", ["beam-observe", "beam-select", "beam-branch"])
def test_one_beam_search_fails_alone(
    engine: Engine, beam_baseline: dict[str, Any], stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = engine.stats()
    _inject_beam(stage, engine, monkeypatch)
    done = _run(engine, _beam_tenants())
    monkeypatch.undo()
    victim = done[BEAM_VICTIM]
    assert victim.finish_reason == "error", victim
    assert victim.error is not None and f"injected {stage} failure" in victim.error
    for rid, out in beam_baseline.items():
        assert done[rid].error is None
        assert [o.token_ids for o in done[rid].outputs] == [o.token_ids for o in out.outputs], rid
        assert done[rid].finish_reason == out.finish_reason, rid
    after = engine.stats()
    assert after.num_sequence_errors == before.num_sequence_errors + 1
    assert after.num_batch_failures == before.num_batch_failures
    again = _run(engine, [r for r in _beam_tenants() if r[0] == BEAM_VICTIM])
    assert again[BEAM_VICTIM].error is None


SPEC_VICTIM = "spec-victim"
LOOP = "one two three four one two three four one two three four one two three"


@pytest.fixture(scope="module")
def spec_engine() -> Engine:
    return Engine(
        "radixkv-tiny",
        num_pages=512,
        page_size=4,
        max_running_requests=64,
        num_speculative_tokens=3,
    )


def _spec_tenants() -> list[tuple[str, str, SamplingParams]]:
    """Repetitive prompts, so prompt lookup drafts; greedy (sampled rows verify by speculative
    sampling, whose draws depend on the batch's float rounding), one with a bias (its drafts
    are judged through its adjusted logits), and a victim alike."""
    out = []
    for i in range(6):
        p = SamplingParams(
            max_tokens=12,
            temperature=0.0,
            ignore_eos=True,
            logit_bias={11: 0.5} if i == 3 else None,
        )
        out.append((f"s{i}", f"{i} {LOOP}", p))
    victim = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={9: 0.25})
    out.insert(2, (SPEC_VICTIM, f"victim {LOOP}", victim))
    return out


def test_one_speculative_verification_fails_alone(
    spec_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = _run(spec_engine, [r for r in _spec_tenants() if r[0] != SPEC_VICTIM])
    drafted_before = spec_engine.stats().speculative_draft_tokens
    real = speculative_mod.adjust_logits

    def adjust(logits: Any, params: Any, *a: Any, **k: Any) -> Any:
        g = spec_engine._live.get(SPEC_VICTIM)
        if g is not None and any(p is g.params for p in params):
            raise RuntimeError("injected verification failure")
        return real(logits, params, *a, **k)

    monkeypatch.setattr(speculative_mod, "adjust_logits", adjust)
    before = spec_engine.stats()
    done = _run(spec_engine, _spec_tenants())
    monkeypatch.undo()
    assert spec_engine.stats().speculative_draft_tokens > drafted_before  # drafts ran
    victim = done[SPEC_VICTIM]
    assert victim.finish_reason == "error"
    assert victim.error is not None
    assert "speculative verification failed: injected verification failure" in victim.error
    for rid, out in baseline.items():
        assert done[rid].error is None
        assert done[rid].token_ids == out.token_ids, rid
    after = spec_engine.stats()
    assert after.num_sequence_errors == before.num_sequence_errors + 1
    assert after.num_batch_failures == before.num_batch_failures
