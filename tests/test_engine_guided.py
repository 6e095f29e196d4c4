"""Guided decoding (``SamplingParams.guided``): sampled outputs match their JSON schema, JSON
object, regex or choice list, on radixkv-tiny's byte vocabulary and a byte-level BPE one, through
sampling, n > 1, preemption and a warm cache; an output ends as soon as its language does;
``max_tokens`` leaves a valid prefix; what cannot be compiled is a ValueError at submission."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from engine_helpers import make_small_llama, run_checked, scripted_sampler

import radixkv.engine.engine as engine_mod
from radixkv.engine.engine import Engine
from radixkv.engine.guided import GuideCompiler
from radixkv.engine.params import GuidedDecodingParams, SamplingParams
from radixkv.model.tokenizer import HFTokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine("radixkv-tiny", num_pages=512)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return make_small_llama(tmp_path_factory.mktemp("small-llama-guided"))


def _sampled(eng: Engine, guided: GuidedDecodingParams, prompts: list[str], **kw: Any) -> list[Any]:
    params = SamplingParams(
        **{"temperature": 1.0, "seed": 7, "max_tokens": 200, **kw}, guided=guided
    )
    outs = run_checked(eng, [eng.tokenizer.encode(p) for p in prompts], params)
    return [c for o in outs for c in o.outputs]


PROMPTS = ["Person: ", "{", "Here is JSON:\n", "def f(x):\n", "The quick brown fox"]


def test_json_schema_outputs_validate(tiny: Engine) -> None:
    outs = _sampled(tiny, GuidedDecodingParams(json=SCHEMA), PROMPTS, n=3)
    assert len(outs) == 15
    for c in outs:
        assert c.finish_reason == "stop", c
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value)[:2] == ["name", "age"]  # the schema's order
        assert c.token_ids[-1] not in tiny.eos_token_ids  # ended with the language, no EOS step


def test_json_object_regex_and_choice(tiny: Engine) -> None:
    objects = _sampled(tiny, GuidedDecodingParams(json_object=True), PROMPTS, max_tokens=400)
    done = [c for c in objects if c.finish_reason == "stop"]
    assert len(done) >= 3  # an object may ramble on at temperature 1; most close
    assert all(isinstance(json.loads(c.text), dict) for c in done)
    pattern = r"(\+|-)?[0-9]{1,4}\.[0-9]{2} (EUR|USD)"
    for c in _sampled(tiny, GuidedDecodingParams(regex=pattern), PROMPTS):
        assert re.fullmatch(pattern, c.text), c.text
    choices = ["positive", "negative", "neutral", "néant ✓"]
    seen = set()
    for c in _sampled(tiny, GuidedDecodingParams(choice=choices), PROMPTS * 4):
        assert c.text in choices and c.finish_reason == "stop"
        seen.add(c.text)
    assert len(seen) > 1  # sampled, not stuck on one


def test_greedy_choice_follows_the_model_and_the_bias(tiny: Engine) -> None:
    """Among the allowed tokens greedy takes the most likely; a bias that favours another
    choice's first byte switches the answer: the mask applies after the adjustments."""
    g = GuidedDecodingParams(choice=["apple", "banana", "cherry"])
    prompt = tiny.tokenizer.encode("Fruit: ")
    (plain,) = run_checked(tiny, [prompt], SamplingParams(temperature=0, guided=g))
    other = next(c for c in g.choice or () if c != plain.text)
    biased = SamplingParams(temperature=0, guided=g, logit_bias={ord(other[0]): 100.0})
    (pushed,) = run_checked(tiny, [prompt], biased)
    assert plain.text in (g.choice or ()) and pushed.text == other


def test_max_tokens_leaves_a_prefix_of_the_language(tiny: Engine) -> None:
    g = GuidedDecodingParams(choice=["abcdefghij", "abcdxyz"])
    outs = _sampled(tiny, g, PROMPTS, max_tokens=5)
    for c in outs:
        assert c.finish_reason == "length" and len(c.token_ids) == 5
        assert any(ch.startswith(c.text) for ch in g.choice or ())


def test_preempted_guided_sequences_stay_valid() -> None:
    eng = Engine("radixkv-tiny", num_pages=14, page_size=16, max_prefill_tokens=64)
    pattern = r"[a-z]{40,60}\."
    outs = _sampled(eng, GuidedDecodingParams(regex=pattern), PROMPTS[:4], n=2, max_tokens=80)
    assert eng.stats().num_preemptions > 0
    for c in outs:
        assert re.fullmatch(pattern, c.text), c.text


def test_byte_level_bpe_vocabulary(small: tuple[Any, Any]) -> None:
    """A BPE tokenizer whose tokens spell several bytes each: its token bytes agree with its own
    decoding, and guided outputs made of multi-byte tokens validate."""
    _, lm = small
    tok = lm.tokenizer
    assert isinstance(tok, HFTokenizer)
    spelled = tok.token_bytes()
    assert any(len(b) > 1 for b in spelled.values())
    for i, b in spelled.items():
        assert tok.decode([i]).encode() == b or "\ufffd" in tok.decode([i]), i
    assert not set(spelled) & set(tok.eos_token_ids)  # specials have no bytes
    eng = Engine(lm, page_size=4, num_pages=400)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    params = SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=60, guided=GuidedDecodingParams(json=schema)
    )
    (o,) = run_checked(eng, [tok.encode("hello world")], params)
    multi = 0
    for c in o.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
        multi += sum(len(spelled.get(t, b"")) > 1 for t in c.token_ids)
    assert multi > 0  # the walk took multi-byte tokens, not only single bytes


def test_sentencepiece_style_token_bytes(tmp_path: Any) -> None:
    """U+2581 spells a space and ``<0xNN>`` a byte (byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<0x0A>": 3,
        "\u2581hello": 4,
        "world": 5,
        "\u2581": 6,
    }
    t = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    t.add_special_tokens(["<s>", "</s>"])
    spelled = HFTokenizer(t, eos_token_ids=[2]).token_bytes()
    assert spelled[3] == b"\n" and spelled[4] == b" hello" and spelled[5] == b"world"
    assert spelled[6] == b" " and 1 not in spelled and 2 not in spelled


def test_numeric_ranges_are_named_as_not_enforced(
    tiny: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5}}}
    with caplog.at_level("WARNING", logger="radixkv.engine.guided"):
        run_checked(tiny, [[1, 2]], SamplingParams(max_tokens=30, guided={"json": schema}))
    assert "minimum are not enforced" in caplog.text


def test_bad_guides_are_refused_at_submission(tiny: Engine) -> None:
    bad = [
        (dict(regex="(unclosed"), "guided decoding cannot use regex"),
        (dict(json={"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}), "guided"),
    ]
    for g, msg in bad:
        with pytest.raises(ValueError, match=msg):
            tiny.add_request([1, 2, 3], SamplingParams(guided=g))
    for g in (dict(), dict(regex="a", choice=["b"]), dict(json="{not json"), dict(choice=[""])):
        with pytest.raises(ValueError):
            SamplingParams(guided=g)
    with pytest.raises(ValueError, match="whitespace_pattern applies to json and json_object"):
        SamplingParams(guided=dict(regex="a", whitespace_pattern=" "))
    assert not tiny.has_unfinished()
    tiny.check_invariants()


def test_async_engine_compiles_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow compile (seconds on a large vocabulary) runs in a worker thread: the event loop
    keeps ticking meanwhile, and the submission then finds the language compiled."""
    import asyncio
    import threading
    import time

    from radixkv.engine.async_engine import AsyncEngine
    from radixkv.engine.guided import GuideCompiler

    threads: list[str] = []
    original = GuideCompiler.compile

    def slow(self: GuideCompiler, g: GuidedDecodingParams) -> Any:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            time.sleep(0.3)
        return original(self, g)

    monkeypatch.setattr(GuideCompiler, "compile", slow)

    async def go() -> tuple[int, str]:
        eng = AsyncEngine("radixkv-tiny", num_pages=128)
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        params = SamplingParams(temperature=0, guided={"regex": "[a-c]{5}"})
        text = ""
        async for out in eng.generate([1, 2, 3], params):
            text = out.text
        ticker.cancel()
        await eng.shutdown()
        return ticks, text

    ticks, text = asyncio.run(go())
    assert re.fullmatch("[a-c]{5}", text)
    assert ticks >= 10  # the loop ran during the 0.3 s compile
    assert threads[0] != threading.main_thread().name  # compiled in a worker thread


def test_ignore_eos_never_offers_an_end_before_the_language_must_end(tiny: Engine) -> None:
    """With ignore_eos an EOS would be appended and the output go on past it: the guide does
    not offer one where the language may go on, so outputs stay in the language; where it must
    end, it ends."""
    pattern = r"[0-9]{1,3}(-[0-9]{1,3}){0,6}"
    for ignore in (False, True):
        outs = _sampled(tiny, GuidedDecodingParams(regex=pattern), PROMPTS, n=4, ignore_eos=ignore)
        for c in outs:
            assert not set(c.token_ids) & tiny.eos_token_ids
            assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop", c
        if ignore:  # never stopped early at an EOS: every output ran to the language's end
            assert all(c.text.count("-") == 6 for c in outs)


PATTERNS = [
    r"a(bc)?",
    r"[0-9]+(\.[0-9]+)?",
    r"x(\.[0-9]+)?",
    r"a(bc)*d?",
    r"(ab|a)(c|bc)?",
    r"[ab]{1,3}(-[ab]{1,2}){0,2}",
    r"(a|ab)(c|bcd)?",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_guide_walks_exactly_the_regex(tiny: Engine, pattern: str) -> None:
    """Every string of up to 5 characters over a small alphabet: the guide walks it to a point
    where it may end exactly when Python's re fullmatches it (optional groups after a
    possible end included: the automaton must not stop at the first match)."""
    import itertools

    from radixkv.engine.guided import GuideCompiler

    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    g = GuidedDecodingParams(regex=pattern)
    eos = min(tiny.eos_token_ids)
    for n in range(1, 6):
        for chars in itertools.product("abcd.-x1", repeat=n):
            s = "".join(chars)
            guide = compiler.guide(g)
            walked = True
            for b in s.encode():
                if not guide.allowed()[b]:
                    walked = False
                    break
                guide.advance(b)
            may_end = walked and bool(guide.allowed()[eos])
            assert may_end == (re.fullmatch(pattern, s) is not None), (pattern, s)


def test_json_numbers_may_have_fractions_and_exponents(tiny: Engine) -> None:
    from radixkv.engine.guided import GuideCompiler

    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    g = GuidedDecodingParams(json={"type": "object", "properties": {"x": {"type": "number"}}})
    for text in ('{"x": 1.5}', '{"x": -0.25e+3}', '{"x": 12}', "{}"):
        guide = compiler.guide(g)
        for b in text.encode():
            assert guide.allowed()[b], (text, chr(b))
            guide.advance(b)
        assert guide.only_end or guide.allowed()[min(tiny.eos_token_ids)]


def _steps(eng: Engine) -> int:
    return eng.stats().num_steps


def test_jump_forward_same_greedy_output_in_fewer_steps() -> None:
    """Tokens the language forces (a schema's keys, punctuation) are appended without a decode
    step each; greedy outputs are the same as sampling every token."""
    schema = {
        "type": "object",
        "properties": {
            "identifier": {"type": "string", "maxLength": 8},
            "quantity": {"type": "integer"},
            "label": {"enum": ["alpha", "beta"]},
        },
        "required": ["identifier", "quantity", "label"],
    }
    guides = [
        GuidedDecodingParams(json=schema, whitespace_pattern=" "),
        GuidedDecodingParams(regex=r"(id|key)-[0-9]{2}-(north|south)"),
    ]
    prompts = [[1, 2, 3], [40, 41], [99]]
    texts, steps = {}, {}
    for jump in (False, True):
        eng = Engine("radixkv-tiny", num_pages=256, guided_jump_forward=jump)
        texts[jump] = []
        for g in guides:
            outs = run_checked(
                eng, prompts, SamplingParams(temperature=0, max_tokens=120, guided=g)
            )
            texts[jump] += [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]
        steps[jump] = _steps(eng)
    assert texts[True] == texts[False]
    assert steps[True] * 2 < steps[False]


def test_jump_forward_honours_max_tokens_stop_strings_and_logprobs(tiny: Engine) -> None:
    g = GuidedDecodingParams(regex="abcdefghij")  # every token forced after the first
    (cut,) = run_checked(tiny, [[5, 6]], SamplingParams(temperature=0, max_tokens=4, guided=g))
    assert cut.text == "abcd" and cut.outputs[0].finish_reason == "length"
    stop = SamplingParams(temperature=0, max_tokens=20, stop=["de"], guided=g)
    (stopped,) = run_checked(tiny, [[5, 6]], stop)
    assert stopped.text == "abc" and stopped.outputs[0].finish_reason == "stop"
    with_lp = SamplingParams(temperature=0, max_tokens=20, logprobs=0, guided=g)
    (o,) = run_checked(tiny, [[5, 6]], with_lp)
    c = o.outputs[0]
    assert c.text == "abcdefghij" and c.logprobs is not None
    assert len(c.logprobs) == len(c.token_ids) == 10  # no jump: every token has its logprob


def test_integers_are_held_to_16_digits_unless_the_schema_says(tiny: Engine) -> None:
    from radixkv.engine.guided import GuideCompiler

    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    for schema, most in (
        ({"type": "object", "properties": {"n": {"type": "integer"}}}, 16),
        ({"type": "object", "properties": {"n": {"type": "integer", "maxDigits": 20}}}, 20),
    ):
        guide = compiler.guide(GuidedDecodingParams(json=schema))
        for b in b'{"n":-':
            guide.advance(b)
        digits = 0
        while guide.allowed()[ord("7")]:
            guide.advance(ord("7"))
            digits += 1
        assert digits == most
        assert guide.allowed()[ord("}")]


def test_forced_spelling_shared_by_several_tokens() -> None:
    """SentencePiece's byte fallback spells "a" twice (<0x61> and the piece "a"): where the
    language forces those bytes, jump-forward takes the vocabulary's own piece (the higher id);
    where two spellings may follow, nothing is forced. Whatever order ``token_bytes`` lists
    the tokens in (a HF tokenizer's vocabulary is a hash map: its order changes from process to
    process, and jump-forward once did with it)."""
    from radixkv.engine.guided import GuideCompiler

    class Spelled:
        def __init__(self, reverse: bool) -> None:
            self.reverse = reverse

        def token_bytes(self) -> dict[int, bytes]:
            items = [*((i, bytes([i])) for i in range(256)), (300, b"a"), (301, b"b"), (302, b"ab")]
            return dict(reversed(items) if self.reverse else items)

    for reverse in (False, True):
        compiler = GuideCompiler(Spelled(reverse), 310, [257])
        guide = compiler.guide(GuidedDecodingParams(regex="xa"))
        assert guide.forced() == ord("x")
        guide.advance(ord("x"))
        assert guide.forced() == 300, reverse  # "a" or <0x61>: the piece
        guide = compiler.guide(GuidedDecodingParams(regex="ab"))
        assert guide.forced() is None  # "a", <0x61> or "ab": not one spelling
        guide = compiler.guide(GuidedDecodingParams(regex="(c|d)"))
        assert guide.forced() is None


def test_start_after_leaves_the_output_free_up_to_its_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start_after``: the tokens up to and including the text (eight byte tokens here) are
    free, even ones the language forbids; the language holds from the next token on and ends
    the output. Without it, the same script is held to the language from its first token."""
    regex = r'\{"a": [0-9]\}'
    eng = Engine("radixkv-tiny", num_pages=256, guided_jump_forward=False)
    script = eng.tokenizer.encode(
        'Hmm, {x} </thin </think>{"a": 7} and on', add_special_tokens=False
    )
    texts = {}
    for start_after in (None, "</think>"):
        monkeypatch.setattr(engine_mod, "sample", scripted_sampler(script))
        guided = GuidedDecodingParams(regex=regex, start_after=start_after)
        params = SamplingParams(max_tokens=60, guided=guided)
        (out,) = run_checked(eng, [eng.tokenizer.encode("Reason, then answer: ")], params)
        texts[start_after] = (out.outputs[0].text, out.outputs[0].finish_reason)
    assert texts["</think>"] == ('Hmm, {x} </thin </think>{"a": 7}', "stop")
    text, finish = texts[None]
    assert re.fullmatch(regex, text) and finish == "stop"
    # one index for both: start_after is not part of the language
    compiler = GuideCompiler(eng.tokenizer, eng.vocab_size, eng.eos_token_ids)
    index = compiler.compile(GuidedDecodingParams(regex=regex))
    assert compiler.compile(GuidedDecodingParams(regex=regex, start_after="x")) is index


def test_a_waiting_guide_masks_forces_and_walks_nothing(tiny: Engine) -> None:
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    g = compiler.guide(GuidedDecodingParams(choice=("yes",), start_after="]]"))
    assert g.waiting and g.allowed().all() and g.forced() is None and not g.only_end
    row = torch.zeros(tiny.vocab_size)
    g.mask(row)
    assert torch.isfinite(row).all()
    for tok in tiny.tokenizer.encode("a]b]", add_special_tokens=False):  # no "]]" yet
        g.advance(tok)
    assert g.waiting
    g.advance(tiny.tokenizer.encode("]", add_special_tokens=False)[0])
    assert not g.waiting and g.allowed().sum() == 1  # "y" and nothing else
    with pytest.raises(ValueError, match="start_after must be a non-empty string"):
        GuidedDecodingParams(choice=("yes",), start_after="")
