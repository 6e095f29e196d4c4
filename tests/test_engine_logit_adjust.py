"""Logit bias, min_tokens and the presence, frequency and repetition penalties: the maths
(against Hugging Face's processor and a plain recount), the parameters' checks, and what the
engine's greedy decoding and the server do with them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from radixkv.engine.engine import Engine
from radixkv.engine.logit_adjust import adjust_logits
from radixkv.engine.params import SamplingParams

V = 50


def _rows(seed: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length,), generator=g).tolist() for _ in range(n)]


def test_repetition_penalty_is_hugging_faces() -> None:
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 4
    ids = _rows(1, 3, 12)
    for penalty in (0.7, 1.3, 2.0):
        params = [SamplingParams(repetition_penalty=penalty)] * 3
        got = adjust_logits(logits, params, ids, [5, 5, 5])
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(ids), logits.clone())
        assert torch.equal(got, want)  # prompt and output tokens alike, bit for bit


def test_frequency_and_presence_count_the_output_only() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2))
    ids = _rows(3, 4, 20)
    prompt = [7, 20, 0, 19]
    params = [
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.25),
        SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=1.5),
        SamplingParams(),  # no penalty: the row is left as it is
    ]
    got = adjust_logits(logits, params, ids, prompt)
    for i, p in enumerate(params):
        want = logits[i].clone()
        for t in set(ids[i]) if p.repetition_penalty != 1.0 else ():
            want[t] = (
                want[t] / p.repetition_penalty if want[t] > 0 else want[t] * p.repetition_penalty
            )
        for t, c in Counter(ids[i][prompt[i] :]).items():
            want[t] -= p.frequency_penalty * c + p.presence_penalty
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])


def test_apply_penalties_leaves_its_input_alone_and_checks_lengths() -> None:
    logits = torch.randn(2, V)
    before = logits.clone()
    adjust_logits(logits, [SamplingParams(frequency_penalty=1.0)] * 2, [[1, 1], [2]], [0, 0])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="2 logit rows but 1 params"):
        adjust_logits(logits, [SamplingParams()], [[1], [2]], [0, 0])


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    ids = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]  # 2 prompt tokens, 2 output tokens each
    params = [
        SamplingParams(logit_bias={7: 5.0, 9: -100, 10**6: 1.0}),  # an id past V: ignored
        SamplingParams(min_tokens=3, stop_token_ids=[11]),  # 2 < 3: EOS and 11 held back
        SamplingParams(min_tokens=2, stop_token_ids=[11]),  # reached: nothing held back
    ]
    got = adjust_logits(logits, params, ids, [2, 2, 2], eos_token_ids={0, 12})
    want = logits.clone()
    want[0, 7] += 5.0
    want[0, 9] -= 100.0
    want[1, [0, 11, 12]] = float("-inf")
    assert torch.equal(got, want)
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[11])
    got = adjust_logits(logits[:1], [ignoring], ids[:1], [2], eos_token_ids={0, 12})
    assert torch.isinf(got[0, 11]) and not torch.isinf(got[0, [0, 12]]).any()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {3: 101}}, "logit_bias values must be in \\[-100, 100\\]"),
        ({"logit_bias": {"3": 1}}, "logit_bias token ids must be non-negative ints"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias values must be finite"),
        ({"min_tokens": 17}, "min_tokens must be an integer in \\[0, max_tokens=16\\]"),
        ({"min_tokens": -1}, "min_tokens must be"),
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in \\[-2, 2\\]"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a number"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": True}, "repetition_penalty must be a finite number"),
    ],
)
def test_bad_penalties_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_has_penalties() -> None:
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(logit_bias={1: 2}).adjusts_logits
    assert SamplingParams(min_tokens=1).adjusts_logits
    assert SamplingParams(logit_bias={3: 1, 1: 2}).logit_bias == ((1, 2.0), (3, 1.0))
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties


# ---------------------------------------------------------------- in the engine
PROMPT = "def add(a, b):\n"  # radixkv-tiny greedily answers with a long run of spaces


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("radixkv-tiny", num_pages=512, seed=0)


def _greedy(engine: Engine, **penalties: float) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalties)
    return engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]


def test_neutral_penalties_change_nothing(engine: Engine) -> None:
    plain = _greedy(engine).token_ids
    assert _greedy(engine, presence_penalty=0.0, repetition_penalty=1.0).token_ids == plain
    assert max(Counter(plain).values()) > 8  # the repetition the penalties are for


def test_greedy_picks_the_best_penalised_token_every_step(engine: Engine) -> None:
    """Frequency and presence penalties shift logits, so the engine's choice at every step
    must be the argmax of the step's raw log probabilities minus the penalties computed from
    the output before it (the raw distribution comes back whole through logprobs)."""
    f, p = 0.8, 0.5
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        frequency_penalty=f,
        presence_penalty=p,
        logprobs=engine.vocab_size,
    )
    out = engine.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None
    for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        counts = Counter(out.token_ids[:step])
        scores = {t: lp.logprob - f * counts[t] - p * (counts[t] > 0) for t, lp in entry.items()}
        assert tok == max(scores, key=lambda t: scores[t]), f"step {step}"
    assert max(Counter(out.token_ids).values()) < max(Counter(_greedy(engine).token_ids).values())
    engine.check_invariants()


def test_repetition_penalty_breaks_the_run(engine: Engine) -> None:
    plain = _greedy(engine).token_ids
    penalised = _greedy(engine, repetition_penalty=1.8).token_ids
    assert penalised != plain
    assert max(Counter(penalised).values()) < max(Counter(plain).values())


def test_the_server_passes_them_on() -> None:
    import httpx
    from server_helpers import MODEL, live_server

    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    with live_server() as (srv, _), httpx.Client(base_url=srv.url, timeout=30) as http:
        plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        texts = {
            name: http.post("/v1/completions", json={**body, name: value})
            for name, value in (
                ("presence_penalty", 1.5),
                ("frequency_penalty", 1.0),
                ("repetition_penalty", 1.8),
            )
        }
        bad = http.post("/v1/completions", json={**body, "repetition_penalty": 0})
        biased = http.post("/v1/completions", json={**body, "logit_bias": {"65": 100}})
        outside = http.post("/v1/completions", json={**body, "logit_bias": {"999999": 1}})
        too_many = http.post("/v1/completions", json={**body, "min_tokens": 30})
    for name, r in texts.items():
        assert r.status_code == 200, name
        assert r.json()["choices"][0]["text"] != plain, name
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"
    assert biased.status_code == 200 and set(biased.json()["choices"][0]["text"]) == {"A"}
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "logit_bias"
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "min_tokens"


def test_engine_logit_bias_bans_and_forces(engine: Engine) -> None:
    plain = _greedy(engine).token_ids
    banned = _greedy(engine, logit_bias={plain[0]: -100}).token_ids
    assert plain[0] not in banned
    forced = _greedy(engine, logit_bias={65: 100}).token_ids  # "A"
    assert set(forced) == {65}


def test_engine_min_tokens_holds_eos_back(engine: Engine) -> None:
    eos = sorted(engine.eos_token_ids)[0]
    # EOS pushed to the top: the first token ends the output, unless min_tokens holds it back
    push = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100})
    short = engine.generate([PROMPT], push, use_tqdm=False)[0].outputs[0]
    assert len(short.token_ids) == 1 and short.finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={eos: 100}, min_tokens=5)
    out = engine.generate([PROMPT], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos  # 5 held back, then EOS
    assert eos not in out.token_ids[:5]
    engine.check_invariants()
