"""``SamplingParams.logprob_token_ids`` (the log probability of chosen ids at every output and
prompt position, SGLang's ``token_ids_logprob``) and ``Engine.score`` (SGLang's scoring: the
probability of each label token after ``query + item``), against transformers' logits."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from _model_hf_builders import hf_logits
from engine_helpers import LOGPROB_ATOL, STEP_CONFIGS, make_small_llama, shared_prefix_prompts

from radixkv.engine.engine import Engine
from radixkv.engine.outputs import Logprob
from radixkv.engine.params import SamplingParams

LABELS = (7, 300, 5, 41)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-scoring"))


def check_asked(entry: dict[int, Logprob], ref: torch.Tensor, asked: tuple[int, ...]) -> None:
    """Every asked id is in ``entry`` with transformers' log probability (``ref`` ``[V]``,
    log_softmax at the position) and its rank among all ids."""
    for t in asked:
        v = entry[t]
        assert abs(v.logprob - ref[t].item()) <= LOGPROB_ATOL, (t, v, ref[t])
        better = int((ref > ref[t] + LOGPROB_ATOL).sum())
        at_least = int((ref >= ref[t] - LOGPROB_ATOL).sum())
        assert better + 1 <= v.rank <= at_least, (t, v.rank, better, at_least)
        assert v.decoded_token is not None


@pytest.mark.parametrize("cfg", STEP_CONFIGS)
@pytest.mark.parametrize("top", [0, 3])
def test_asked_ids_join_every_output_entry(
    small: tuple[Any, Any], cfg: dict[str, Any], top: int
) -> None:
    hf, lm = small
    kw: dict[str, Any] = dict(page_size=4, num_pages=600)
    kw.update(cfg)
    eng = Engine(lm, **kw)
    prompts = shared_prefix_prompts(21, 6)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=top, logprob_token_ids=LABELS)
    outs = eng.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        ref = torch.log_softmax(hf_logits(hf, p + c.token_ids)[len(p) - 1 : -1], dim=-1)
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert next(iter(entry)) == tok  # the sampled token first, then top, then asked
            assert len(entry) <= 1 + top + len(LABELS)
            assert set(entry) >= set(LABELS)
            check_asked(entry, ref[j], LABELS)
    eng.check_invariants()


def test_asked_ids_in_prompt_logprobs_and_speculative_drafts(small: tuple[Any, Any]) -> None:
    """Prompt entries carry them too, and so do the entries of accepted drafts (speculative
    decoding writes several positions in one step)."""
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=600, num_speculative_tokens=3)
    rng = random.Random(5)  # prompts that repeat themselves: prompt lookup drafts from them
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 9))] * 5 for _ in range(4)]
    params = SamplingParams(
        temperature=0.0, max_tokens=16, logprobs=1, prompt_logprobs=0, logprob_token_ids=LABELS
    )
    for prompt, out in zip(prompts, eng.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        ref = torch.log_softmax(hf_logits(hf, prompt + c.token_ids), dim=-1)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for q, entry in enumerate(out.prompt_logprobs[1:], start=1):
            assert entry is not None and next(iter(entry)) == prompt[q]
            check_asked(entry, ref[q - 1], LABELS)
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for j, entry in enumerate(c.logprobs):
            check_asked(entry, ref[len(prompt) - 1 + j], LABELS)
    assert eng.stats().speculative_accepted_tokens > 0


def test_asked_ids_in_beam_search(small: tuple[Any, Any]) -> None:
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=600)
    prompt = shared_prefix_prompts(23, 1)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=4, beam_width=3, n=2, logprobs=0, logprob_token_ids=LABELS
    )
    (out,) = eng.generate([prompt], params, use_tqdm=False)
    for c in out.outputs:
        ref = torch.log_softmax(hf_logits(hf, prompt + c.token_ids)[len(prompt) - 1 : -1], dim=-1)
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for j, entry in enumerate(c.logprobs):
            check_asked(entry, ref[j], LABELS)


def hf_scores(hf: Any, prompts: list[list[int]], labels: tuple[int, ...], soft: bool) -> list:
    out = []
    for p in prompts:
        lp = torch.log_softmax(hf_logits(hf, p)[-1], dim=-1)[list(labels)]
        out.append((torch.softmax(lp, -1) if soft else lp.exp()).tolist())
    return out


@pytest.mark.parametrize("apply_softmax", [False, True])
@pytest.mark.parametrize("item_first", [False, True])
def test_score_equals_transformers(
    small: tuple[Any, Any], apply_softmax: bool, item_first: bool
) -> None:
    hf, lm = small
    eng = Engine(lm, page_size=4, num_pages=600)
    query = shared_prefix_prompts(24, 1)[0][:41]
    items = [p[-9:] for p in shared_prefix_prompts(25, 5)] + [[17]]
    got = eng.score(query, items, list(LABELS), apply_softmax=apply_softmax, item_first=item_first)
    prompts = [it + query if item_first else query + it for it in items]
    want = hf_scores(hf, prompts, LABELS, apply_softmax)
    assert len(got) == len(items) and all(len(s) == len(LABELS) for s in got)
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-3, abs=1e-6)
        if apply_softmax:
            assert math.fsum(g) == pytest.approx(1.0, abs=1e-9)
    eng.check_invariants()
    assert eng.stats().locked_pages == 0 and not eng.has_unfinished()


def test_score_computes_the_query_once(small: tuple[Any, Any]) -> None:
    """Query first: every item after the first reuses the query's cached pages."""
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=600)
    query = (shared_prefix_prompts(26, 1)[0] * 3)[:64]
    items = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    eng.score(query, items, [5, 6])
    st = eng.stats()
    assert len(query) == 64 and st.prompt_tokens == 8 * (64 + 3)
    # the query once, then each item's own tokens (and the query's last page, cut by an item)
    assert st.prefill_tokens_computed <= 64 + 8 * (3 + 4)
    assert st.prefix_cache_hit_tokens >= 7 * 60


def test_score_text_is_concatenated_then_tokenized() -> None:
    eng = Engine("radixkv-tiny", page_size=16, num_pages=200)
    tok = eng.tokenizer
    query = "def is_even(n):\n    return n % 2 == 0\n\n# is_even(4) -> "
    items = ["True", "False", " 7"]
    labels = [tok.encode("T")[-1], tok.encode("F")[-1]]
    text = eng.score(query, items, labels)
    ids = [tok.encode(query + it) for it in items]
    for t, i in zip(text, ids):  # both the same prompts, whichever way given
        (out,) = eng.generate(
            [i],
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, logprob_token_ids=labels),
            use_tqdm=False,
        )
        (entry,) = out.outputs[0].logprobs or [{}]
        assert t == pytest.approx([math.exp(entry[x].logprob) for x in labels], rel=1e-4)
    assert eng.score(query, "True", labels)[0] == pytest.approx(text[0], rel=1e-4)
    flipped = eng.score(query, items, labels, item_first=True)
    assert all(f != pytest.approx(t, rel=1e-3) for f, t in zip(flipped, text))


BAD_SCORE: list[tuple[Any, Any, Any, str]] = [
    ("q", [], [5], "items must be a non-empty list"),
    ("q", [[1, 2]], [5], "items must be texts when the query is text"),
    ([1, 2], ["x"], [5], r"items\[0\] must be a list of token ids"),
    ([1, 2], [[3], [4.0]], [5], r"items\[1\]"),
    (None, [[3]], [5], "query must be a text or a list of token ids"),
    ([1, 2], [[3]], [], "label_token_ids must be a non-empty list"),
    ([1, 2], [[3]], [5, 5], "repeated ids"),
    ([1, 2], [[3]], [-1], "label_token_ids must be non-negative"),
    ([1, 2], [[3]], [10**9], r"outside the vocabulary"),
    ([1, 2], [[3], [10**9]], [5], r"prompt token 2 = 1000000000 is outside the vocabulary"),
]


@pytest.mark.parametrize(("query", "items", "labels", "msg"), BAD_SCORE)
def test_score_errors_name_the_problem_and_run_nothing(
    small: tuple[Any, Any], query: Any, items: Any, labels: Any, msg: str
) -> None:
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=600)
    with pytest.raises(ValueError, match=msg):
        eng.score(query, items, labels)
    st = eng.stats()
    assert st.num_requests == 0 and not eng.has_unfinished()
    with pytest.raises(ValueError, match="item_first must be a bool"):
        eng.score([1, 2], [[3]], [5], item_first="yes")  # type: ignore[arg-type]


def test_logprob_token_ids_validation(small: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError, match="needs logprobs or prompt_logprobs"):
        SamplingParams(logprob_token_ids=(3,))
    with pytest.raises(ValueError, match="must be a list of ints"):
        SamplingParams(logprobs=0, logprob_token_ids="12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative ints"):
        SamplingParams(logprobs=0, logprob_token_ids=(3, True))
    p = SamplingParams(logprobs=0, logprob_token_ids=[9, 3, 9])  # type: ignore[arg-type]
    assert p.logprob_token_ids == (9, 3)
    assert SamplingParams(logprobs=0, logprob_token_ids=None).logprob_token_ids == ()  # type: ignore[arg-type]
    _, lm = small
    eng = Engine(lm, page_size=4, num_pages=600)
    bad = SamplingParams(logprobs=0, logprob_token_ids=(3, lm.config.vocab_size))
    with pytest.raises(ValueError, match=r"logprob_token_ids \[\d+\] are outside the vocabulary"):
        eng.add_request([1, 2, 3], bad)
    assert not eng.has_unfinished()
