"""Speculative decoding of guided requests: drafts are judged by the language after the drafts
before them (``TokenGuide.judge_drafts``), so greedy guided outputs equal the ones without drafts,
token for token, for every kind of language (regex, JSON schema, Lark and GBNF grammars,
``start_after``), with logprobs too; sampled ones stay in their language; the walks end where
they began after every judgement."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import numpy as np
import pytest
import torch
from grammar_helpers import GBNF, PARENS_MANY, classify

from radixkv.engine.engine import Engine
from radixkv.engine.guided import GuideCompiler, TokenGuide
from radixkv.engine.params import GuidedDecodingParams, SamplingParams

REGEX = "[a-z .\n]{1,80}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "tags"],
}
GUIDES: list[dict[str, Any]] = [
    {"regex": REGEX},
    {"json": SCHEMA},
    {"grammar": PARENS_MANY},
    {"grammar": GBNF},
    {"regex": "(ab|cd)+", "start_after": "x"},
]
PROMPTS = [
    "import os\n" * 3 + "def f(x):\n    return x\n" * 4,
    "the cat sat on the mat. " * 6,
    '{"name": "a", "tags": ["b", "c"]} ' * 4,
    "(()) [[]] " * 8,
]


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine("radixkv-tiny", num_pages=64)


def _random_walk(guide: TokenGuide, rng: random.Random, n: int, eos: list[int]) -> list[int]:
    """Up to ``n`` tokens the guide allows one after another (advancing it), EOS never."""
    out: list[int] = []
    for _ in range(n):
        ok = [int(t) for t in np.flatnonzero(guide.allowed()) if t not in eos]
        if not ok:
            break
        t = rng.choice(ok)
        guide.advance(t)
        out.append(t)
    return out


@pytest.mark.parametrize("g", GUIDES, ids=["regex", "json", "lark", "gbnf", "start_after"])
def test_judge_drafts_masks_each_position_as_stepping_would(
    tiny: Engine, g: dict[str, Any]
) -> None:
    """Random allowed runs, then (sometimes) a refused token and more: the count is the
    allowed run's length; each masked row up to the refused position equals masking one step
    at a time; rows past it are untouched; the guide is left exactly where it was (same mask
    after, and it walks on)."""
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    params = GuidedDecodingParams(**g)
    eos = list(tiny.eos_token_ids)
    rng = random.Random(7)
    V = tiny.vocab_size
    for trial in range(12):
        guide = compiler.guide(params)
        prefix = _random_walk(guide, rng, rng.randrange(0, 4), eos)  # somewhere inside
        before = guide.allowed().copy()
        probe = compiler.guide(params)  # the same position, walked for the run's masks
        for t in prefix:
            probe.advance(t)
        run = _random_walk(probe, rng, 64 if trial == 0 else rng.randrange(0, 10), eos)
        drafts = list(run)
        if trial % 2:  # a refused token ends the run (when there is one here)
            refused = np.flatnonzero(~probe.allowed())
            refused = [int(t) for t in refused if t not in eos]
            if refused:
                drafts += [rng.choice(refused)] + [rng.randrange(V) for _ in range(3)]
        rows = torch.randn(len(drafts) + 1, V)
        raw = rows.clone()
        n = guide.judge_drafts(drafts, rows)
        assert n == len(run), (g, prefix, drafts)
        assert np.array_equal(guide.allowed(), before)  # where it was
        assert guide.judge_drafts(drafts) == n  # the count alone, the same
        stepper = compiler.guide(params)
        for t in prefix:
            stepper.advance(t)
        for j in range(n + 1):  # the refused position's row is masked too
            want = raw[j].clone()
            stepper.mask(want)
            assert torch.equal(rows[j], want), (g, j)
            if j < n:
                stepper.advance(drafts[j])
        assert torch.equal(rows[n + 1 :], raw[n + 1 :])
        for t in run:  # the judged walk goes on as if never judged
            assert guide.allowed()[t]
            guide.advance(t)


def _generate(k: int, params: list[SamplingParams]) -> tuple[list[Any], Any]:
    eng = Engine("radixkv-tiny", num_pages=512, num_speculative_tokens=k)
    ids = [eng.add_request(p, sp, stream=False) for p, sp in zip(PROMPTS * 8, params)]
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_invariants()
    assert eng.seq_kv.num_private_pages == 0
    assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)
    return [done[r].outputs[0] for r in ids], eng.stats()


def test_greedy_guided_outputs_equal_the_ones_without_drafts() -> None:
    """Every kind of language, with and without logprobs, in one batch: same tokens, same
    finish reasons, same logprob entries' ids; drafts were kept, in fewer steps."""
    params = [
        SamplingParams(temperature=0, max_tokens=60, guided=g, logprobs=2 if i % 2 else None)
        for g in GUIDES
        for i in range(len(PROMPTS))
    ]
    (base, s0), (spec, s8) = _generate(0, params), _generate(8, params)
    assert s8.speculative_accepted_tokens > 0
    assert s8.num_steps < s0.num_steps
    for a, b, sp in zip(base, spec, params):
        assert b.token_ids == a.token_ids, sp.guided
        assert b.finish_reason == a.finish_reason
        if sp.logprobs is not None:
            assert [list(e) for e in b.logprobs] == [list(e) for e in a.logprobs]


def test_sampled_guided_outputs_stay_in_their_language() -> None:
    params = [
        SamplingParams(temperature=0.8, max_tokens=60, guided=g, seed=i)
        for g in GUIDES[:4]
        for i in range(len(PROMPTS))
    ]
    outs, stats = _generate(8, params)
    assert stats.speculative_accepted_tokens > 0
    for o, sp in zip(outs, params):
        g = sp.guided
        assert g is not None
        text = o.text
        if g.regex is not None:
            assert re.fullmatch(g.regex, text) or (o.finish_reason == "length"), text
            assert re.fullmatch("[a-z .\n]*", text)
        elif g.json is not None:
            if o.finish_reason == "stop":
                value = json.loads(text)
                assert isinstance(value["name"], str) and isinstance(value["tags"], list)
        else:
            want = {"complete"} if o.finish_reason == "stop" else {"complete", "prefix"}
            assert classify(g.grammar, text) in want, text


def test_forced_positions_take_the_token_jump_forward_would() -> None:
    """Where the language forces bytes that two tokens spell (byte fallback <0x61> and the
    piece "a"), jump-forward appends the piece without sampling: with ``force`` a draft of
    the other spelling is refused and the row keeps the piece alone, as jump-forward would;
    without it (logprobs wanted, jump-forward off) both spellings are the model's to choose."""

    class Spelled:
        def token_bytes(self) -> dict[int, bytes]:
            return {**{i: bytes([i]) for i in range(256)}, 300: b"a", 301: b"b"}

    compiler = GuideCompiler(Spelled(), 310, [257])
    params = GuidedDecodingParams(regex="x(a|b)a")
    x, a, b = ord("x"), ord("a"), ord("b")
    for force in (True, False):
        guide = compiler.guide(params)
        rows = torch.zeros(4, 310)
        drafts = [x, a, a]
        n = guide.judge_drafts(drafts, rows, force=force)
        finite = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in rows]
        assert finite[0] == {x}  # forced, spelled by one token: the same both ways
        assert finite[1] == {a, 300, b, 301}  # a choice: never forced
        if force:
            assert n == 2 and finite[2] == {300}  # the piece, as jump-forward appends it
        else:
            assert n == 3 and finite[2] == {a, 300} and finite[3] == {257}  # then the end
