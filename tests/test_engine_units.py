"""Unit tests of the engine's torch-light parts: SamplingParams, sampler, detokenizer, page
arithmetic."""

from __future__ import annotations

import pytest
import torch

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.params import SamplingParams
from radixkv.engine.sampler import make_generator, sample
from radixkv.pages import pages_for


# ---------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": b"x"}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"seed": 1.0}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": "x"}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
    ],
)
def test_sampling_params_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_normalises() -> None:
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("END",)
    assert p.stop_token_ids == (3, 4)
    assert p.greedy and p.max_stop_len == 3
    assert SamplingParams(stop=None).stop == ()
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


# ---------------------------------------------------------------- sampler
def test_sampler_greedy_rows_take_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_sampler_seeded_reproducible_and_batch_independent() -> None:
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    a = sample(logits, [p] * 3, [make_generator(7), make_generator(8), make_generator(9)])
    b = sample(logits[1:2], [p], [make_generator(8)])
    assert a[1] == b[0]
    c = sample(logits, [p] * 3, [make_generator(7), make_generator(8), make_generator(9)])
    assert a == c


def test_sampler_top_k_one_is_greedy_and_top_p_restricts() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 64, generator=g)
    gens = [make_generator(i) for i in range(2)]
    out = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 2, gens)
    assert out == logits.argmax(-1).tolist()
    # a very peaked row with tiny top_p: only the top token survives
    peaked = torch.zeros(1, 10)
    peaked[0, 3] = 5.0
    for s in range(20):
        assert sample(
            peaked, [SamplingParams(temperature=1.0, top_p=0.5)], [make_generator(s)]
        ) == [3]


def test_sampler_min_p_keeps_tokens_near_the_top() -> None:
    # probabilities 0.4, 0.3, 0.2, 0.1 (x4 rows): min_p=0.5 keeps p >= 0.2, i.e. tokens 0-2
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None, :].repeat(4, 1)
    keep = SamplingParams(temperature=1.0, min_p=0.5)
    seen = set()
    for s in range(200):
        seen.update(sample(logits, [keep] * 4, [make_generator(s * 4 + i) for i in range(4)]))
    assert seen == {0, 1, 2}
    # min_p applies after temperature: at 0.25 the probabilities are p^4 / sum, so only token 0
    # (1.0) and token 1 (0.316) stay above 0.3 * max
    hot = SamplingParams(temperature=0.25, min_p=0.3)
    assert {sample(logits[:1], [hot], [make_generator(s)])[0] for s in range(200)} == {0, 1}
    # min_p=1 keeps only the most likely token; min_p=0 changes nothing
    assert (
        sample(logits, [SamplingParams(min_p=1.0)] * 4, [make_generator(i) for i in range(4)])
        == [0] * 4
    )
    gens = lambda: [make_generator(i) for i in range(4)]  # noqa: E731
    plain = sample(logits, [SamplingParams(top_p=0.9)] * 4, gens())
    assert sample(logits, [SamplingParams(top_p=0.9, min_p=0.0)] * 4, gens()) == plain


def test_sampler_distribution_roughly_matches_softmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    probs = torch.softmax(logits, -1)[0]
    counts = torch.zeros(3)
    gen = make_generator(123)
    p = SamplingParams(temperature=1.0)
    for _ in range(3000):
        counts[sample(logits, [p], [gen])[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_sampler_mixed_batch_and_errors() -> None:
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    out = sample(
        logits, [SamplingParams(temperature=0), SamplingParams()], [None, make_generator(0)]
    )
    assert out[0] == int(logits[0].argmax())
    with pytest.raises(ValueError, match="generator"):
        sample(logits, [SamplingParams(), SamplingParams()], [None, None])
    with pytest.raises(ValueError):
        sample(logits, [SamplingParams()], [None])


# ---------------------------------------------------------------- detokenizer
class _ByteTok:
    """A byte-level decoder: ids are bytes (multi-byte characters span tokens)."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # type: ignore[no-untyped-def]
        return bytes(ids).decode("utf-8", errors="replace")


def _feed(text: str, stop: tuple[str, ...] = ()) -> tuple[IncrementalDetokenizer, list[str], bool]:
    d = IncrementalDetokenizer(_ByteTok(), list(b"prompt "), stop)
    deltas, hit = [], False
    for b in text.encode():
        hit = d.add(b)
        deltas.append(d.take_delta(hit))
        if hit:
            break
    if not hit:
        d.flush()
        deltas.append(d.take_delta(True))
    return d, deltas, hit


def test_detokenizer_multibyte_and_deltas() -> None:
    text = "héllo wörld ✓ done"
    d, deltas, hit = _feed(text)
    assert not hit and d.text == text and "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_detokenizer_stop_string_cut_and_holdback() -> None:
    d, deltas, hit = _feed("abc STOP def", stop=("STOP", "zz"))
    assert hit and d.stop_matched == "STOP"
    assert d.text == "abc " and "".join(deltas) == "abc "
    # earliest of several stop strings wins
    d, _, hit = _feed("xx yy zz", stop=("zz", "yy"))
    assert hit and d.text == "xx "
    # stop string spanning a multi-byte character
    d, _, hit = _feed("a✓b", stop=("✓",))
    assert hit and d.text == "a"


class _CountingTok(_ByteTok):
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().decode(ids, skip_special_tokens)


def test_detokenizer_one_token_memo_changes_nothing_and_saves_decodes() -> None:
    """A memo of one-token texts shared by detokenizers: the same text and deltas (multi-byte
    characters, stop strings) with far fewer decodes; it holds exactly ``decode([id])``."""
    memo: dict[int, str] = {}
    tok, slow = _CountingTok(), _CountingTok()
    for text, stop in (("héllo wörld ✓ done " * 4, ()), ("abc STOP def", ("STOP",)), ("aa bb", ())):
        plain = IncrementalDetokenizer(slow, list(b"prompt "), stop)
        fast = IncrementalDetokenizer(tok, list(b"prompt "), stop, one_token_texts=memo)
        for b in text.encode():
            hits = (plain.add(b), fast.add(b))
            assert hits[0] == hits[1] and plain.take_delta(hits[0]) == fast.take_delta(hits[1])
            if hits[0]:
                break
        plain.flush()
        fast.flush()
        assert fast.text == plain.text and fast.stop_matched == plain.stop_matched
    assert memo and all(t == _ByteTok().decode([i]) for i, t in memo.items())
    assert tok.calls < 0.8 * slow.calls  # without the memo: two decodes per token


# ---------------------------------------------------------------- pages_for
@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_pages_for_is_the_ceiling_of_tokens_over_page_size(page_size: int) -> None:
    for tokens in range(0, 5 * page_size + 2):
        n = pages_for(tokens, page_size)
        assert n * page_size >= tokens > (n - 1) * page_size or (tokens == n == 0)
    assert pages_for(0, page_size) == 0
    assert pages_for(page_size, page_size) == 1 and pages_for(page_size + 1, page_size) == 2
    big = 10**30 + 1  # integer maths: no float rounding
    assert pages_for(big * page_size, page_size) == big
