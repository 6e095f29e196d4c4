"""Presence, frequency and repetition penalties: the maths (against Hugging Face's processor and
a plain recount), the parameters' checks, and what the engine's greedy decoding does with them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.engine.penalties import apply_penalties

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
        got = apply_penalties(logits, params, ids, [5, 5, 5])
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
    got = apply_penalties(logits, params, ids, prompt)
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
    apply_penalties(logits, [SamplingParams(frequency_penalty=1.0)] * 2, [[1, 1], [2]], [0, 0])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="2 logit rows but 1 params"):
        apply_penalties(logits, [SamplingParams()], [[1], [2]], [0, 0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
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
    for name, r in texts.items():
        assert r.status_code == 200, name
        assert r.json()["choices"][0]["text"] != plain, name
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_penalty"
