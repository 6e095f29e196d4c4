"""Grammar-guided decoding (``GuidedDecodingParams(grammar=...)``, llguidance): every output is a
sentence of its context-free grammar, or a prefix of one when ``max_tokens`` cut it, as an
independent recursive-descent recogniser written here says; EOS is offered exactly where the
grammar may end; Lark and GBNF both; a bad grammar is a ValueError at submission; grammars mix
with regexes and free requests in one batch, through sampling, greedy decoding, preemption,
jump-forward and a byte-level BPE vocabulary, leaving no lock or page behind."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from engine_helpers import make_small_llama, run_checked, scripted_sampler
from grammar_helpers import (
    ARITH,
    ARITH_OPEN,
    DIGITS,
    GBNF,
    NAMES,
    PARENS,
    PARENS_MANY,
    classify,
)

import radixkv.engine.engine as engine_mod
from radixkv.engine.engine import Engine
from radixkv.engine.guided import GuideCompiler, TokenGuide
from radixkv.engine.params import GuidedDecodingParams, SamplingParams
from radixkv.model.tokenizer import HFTokenizer

# ------------------------------------------------------------------ the recognisers


def test_the_recognisers_themselves() -> None:
    """The checker is what the other tests trust: a few hand-made cases of each kind."""
    cases = {
        ARITH: [("1+2=", "complete"), ("(12)*3", "prefix"), ("1234=", "invalid"), ("=", "invalid")],
        ARITH_OPEN: [("1+2", "complete"), ("(1", "prefix"), ("1(", "invalid"), ("", "prefix")],
        PARENS: [("([()])", "complete"), ("([", "prefix"), ("(]", "invalid"), ("()()", "invalid")],
        PARENS_MANY: [("()[]", "complete"), ("()[", "prefix"), ("())", "invalid")],
        GBNF: [("[ab,[c,[]]]", "complete"), ("[ab,", "prefix"), ("[abcde]", "invalid")],
    }
    for grammar, pairs in cases.items():
        for text, want in pairs:
            assert classify(grammar, text) == want, (NAMES[grammar], text)
    # none of the bracket languages is regular: the depth is unbounded (here 1 to 40)
    for depth in (1, 7, 40):
        assert classify(PARENS, "(" * depth + ")" * depth) == "complete"
        assert classify(PARENS, "(" * depth + ")" * (depth - 1)) == "prefix"


# ------------------------------------------------------------------ engine helpers


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return Engine("radixkv-tiny", num_pages=512)


def _assert_clean(eng: Engine) -> None:
    """Drained: invariants, every lock count zero, every page free or cached."""
    assert not eng.has_unfinished()
    eng.check_invariants()
    assert all(n.lock_ref == 0 for n in eng.cache.iter_nodes() if n.parent is not None)
    assert eng.pool.num_free + eng.cache.num_cached_pages == eng.pool.num_pages


def _check_output(grammar: str, c: Any, max_tokens: int, eos: frozenset[int] | set[int]) -> str:
    """An output obeys its grammar: a sentence when it stopped (by the language or by an EOS
    offered where the grammar may end), a prefix of one when cut at ``max_tokens``."""
    kind = classify(grammar, c.text)
    if c.finish_reason == "stop":
        assert kind == "complete", (NAMES[grammar], c.text)
    else:
        assert c.finish_reason == "length", c
        assert len(c.token_ids) == max_tokens
        assert kind in ("complete", "prefix"), (NAMES[grammar], c.text)
    assert all(t not in eos for t in c.token_ids[:-1])  # an EOS only ever ends an output
    return kind


PROMPTS = ["Expr: ", "(", "Here is a list: [", "The quick brown fox", "12+"]


@pytest.mark.parametrize("grammar", [ARITH, PARENS, GBNF], ids=["arith", "parens", "gbnf"])
def test_sampled_and_greedy_outputs_are_sentences(tiny: Engine, grammar: str) -> None:
    g = GuidedDecodingParams(grammar=grammar)
    prompts = [tiny.tokenizer.encode(p) for p in PROMPTS]
    finishes, last_tokens = [], []
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=60, guided=g)
        for o in run_checked(tiny, prompts, params):
            for c in o.outputs:
                _check_output(grammar, c, 60, tiny.eos_token_ids)
                finishes.append(c.finish_reason)
                last_tokens += c.token_ids[-1:] if c.finish_reason == "stop" else []
    greedy = SamplingParams(temperature=0, max_tokens=60, guided=g)
    for o in run_checked(tiny, prompts, greedy):
        _check_output(grammar, o.outputs[0], 60, tiny.eos_token_ids)
        finishes.append(o.outputs[0].finish_reason)
    assert len(finishes) == 3 * 2 * len(PROMPTS) + len(PROMPTS)
    # each stopped where its grammar ended: no step was spent on an EOS token
    assert all(t not in tiny.eos_token_ids for t in last_tokens), last_tokens
    # these grammars end by themselves: many outputs are whole sentences, ended without EOS
    assert finishes.count("stop") >= 5, finishes
    _assert_clean(tiny)


def test_max_tokens_cuts_to_a_prefix(tiny: Engine) -> None:
    """Cut by ``max_tokens``: "length", exactly that many tokens, a prefix of a sentence."""
    for grammar, max_tokens in ((PARENS, 7), (GBNF, 5), (ARITH, 3)):
        g = GuidedDecodingParams(grammar=grammar)
        params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=max_tokens, guided=g)
        outs = [c for o in run_checked(tiny, [[1, 2, 3], [40, 41]], params) for c in o.outputs]
        kinds = [_check_output(grammar, c, max_tokens, tiny.eos_token_ids) for c in outs]
        cut = [c for c in outs if c.finish_reason == "length"]
        assert cut, (NAMES[grammar], [c.text for c in outs])
        # a cut output that is no sentence yet: it is "length", never "stop"
        assert any(k == "prefix" for k in kinds)
        assert all(classify(grammar, c.text) != "invalid" for c in cut)


def test_eos_is_offered_exactly_where_the_grammar_may_end(tiny: Engine) -> None:
    """EOS pushed to +100: it is taken wherever it is allowed. Each output then ends with an
    EOS at the first point where the text is a sentence: never before (not offered), never
    after (offered there). With ignore_eos no EOS is offered: the outputs run to the cut."""
    eos = sorted(tiny.eos_token_ids)
    bias = {t: 100.0 for t in eos}
    for grammar in (ARITH_OPEN, PARENS_MANY):
        g = GuidedDecodingParams(grammar=grammar)
        params = SamplingParams(
            temperature=1.0, seed=3, n=4, max_tokens=40, logit_bias=bias, guided=g
        )
        outs = [c for o in run_checked(tiny, [[5, 6], [7]], params) for c in o.outputs]
        for c in outs:
            assert c.finish_reason == "stop" and c.token_ids[-1] in eos, c
            assert classify(grammar, c.text) == "complete", c.text
            # byte tokens, one a step: at every shorter prefix EOS would have been taken
            assert all(classify(grammar, c.text[:i]) != "complete" for i in range(len(c.text)))
        held = SamplingParams(
            temperature=1.0, seed=3, max_tokens=25, logit_bias=bias, ignore_eos=True, guided=g
        )
        for o in run_checked(tiny, [[5, 6], [7]], held):
            c = o.outputs[0]
            assert not set(c.token_ids) & set(eos)
            assert c.finish_reason == "length" and classify(grammar, c.text) != "invalid"


def _walk(compiler: GuideCompiler, g: GuidedDecodingParams, text: str) -> TokenGuide:
    guide = compiler.guide(g)
    for b in text.encode():
        guide.advance(b)
    return guide


@pytest.mark.parametrize(
    ("grammar", "branch", "depth"),
    [
        (ARITH_OPEN, "1(+*)", 5),
        (ARITH, "9(-/)=", 5),
        (PARENS_MANY, "()[]", 7),
        (GBNF, "[],a", 6),
    ],
    ids=["arith-open", "arith", "parens+", "gbnf"],
)
def test_guide_walks_exactly_the_grammar(
    tiny: Engine, grammar: str, branch: str, depth: int
) -> None:
    """Every prefix of a sentence up to ``depth`` characters (over ``branch``): the guide
    allows exactly the printable characters that keep it one (and nothing else of the
    vocabulary), EOS exactly where it is a sentence, and says "only the end" exactly where it
    is a sentence that nothing extends."""
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    g = GuidedDecodingParams(grammar=grammar)
    eos = min(tiny.eos_token_ids)
    printable = [chr(i) for i in range(32, 127)] + ["\n"]
    frontier, seen = [""], 0
    while frontier:
        text = frontier.pop()
        seen += 1
        guide = _walk(compiler, g, text)
        allowed = guide.allowed()
        ok = {ch for ch in printable if classify(grammar, text + ch) != "invalid"}
        assert {ch for ch in printable if allowed[ord(ch)]} == ok, (text, ok)
        complete = classify(grammar, text) == "complete"
        assert int(allowed.sum()) == len(ok) + (len(tiny.eos_token_ids) if complete else 0)
        assert bool(allowed[eos]) == complete, text
        assert guide.only_end == (complete and not ok), text
        if len(text) < depth:
            frontier += [text + ch for ch in branch if ch in ok]
    assert seen > 50  # the walk went places


def test_jump_forward_appends_what_the_grammar_forces() -> None:
    """Literals a grammar forces are appended without a decode step each; greedy outputs are
    the same either way, and the forced bytes make a sentence."""
    grammar = 'start: "SELECT " COL (", " COL){0,2} " FROM " TABLE ";"\nCOL: /[a-z]{1,6}/\n'
    grammar += 'TABLE: "users" | "orders"\n'
    g = GuidedDecodingParams(grammar=grammar)
    texts, steps = {}, {}
    for jump in (False, True):
        eng = Engine("radixkv-tiny", num_pages=256, guided_jump_forward=jump)
        outs = run_checked(
            eng, [[1, 2, 3], [50, 60]], SamplingParams(temperature=0, max_tokens=80, guided=g)
        )
        texts[jump] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
        steps[jump] = eng.stats().num_steps
        _assert_clean(eng)
    assert texts[True] == texts[False]
    pattern = r"SELECT [a-z]{1,6}(, [a-z]{1,6}){0,2} FROM (users|orders);"
    for text, finish in texts[True]:
        assert finish == "stop" and re.fullmatch(pattern, text), text
    assert steps[True] < steps[False]


def test_mixed_batch_each_output_obeys_its_own_constraint(tiny: Engine) -> None:
    """Grammar-guided (Lark and GBNF), regex-guided, choice-guided and free requests in the
    same steps; each output obeys its own constraint, none leaks into another."""
    regex = r"[A-Z][a-z]{2,6}-[0-9]{2}"
    kinds: list[tuple[str, SamplingParams]] = []
    for seed in range(3):
        base: dict[str, Any] = {"temperature": 1.0, "seed": seed, "max_tokens": 50}
        kinds += [
            ("arith", SamplingParams(**base, guided={"grammar": ARITH})),
            ("parens", SamplingParams(**base, n=2, guided={"grammar": PARENS})),
            ("gbnf", SamplingParams(**base, guided={"grammar": GBNF})),
            ("regex", SamplingParams(**base, guided={"regex": regex})),
            ("choice", SamplingParams(**base, guided={"choice": ["yes", "no"]})),
            ("free", SamplingParams(**base)),
        ]
    ids = [
        tiny.add_request(tiny.tokenizer.encode(f"Prompt {i}: "), p, stream=False)
        for i, (_, p) in enumerate(kinds)
    ]
    done: dict[str, Any] = {}
    most = 0
    while tiny.has_unfinished():
        most = max(most, tiny.stats().num_running)
        done.update((o.request_id, o) for o in tiny.step() if o.finished)
        tiny.check_invariants()
    assert most >= 10  # they ran together, not one after another
    grammars = {"arith": ARITH, "parens": PARENS, "gbnf": GBNF}
    free_texts = []
    for (kind, _), rid in zip(kinds, ids):
        for c in done[rid].outputs:
            if kind in grammars:
                _check_output(grammars[kind], c, 50, tiny.eos_token_ids)
            elif kind == "regex":
                assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text
            elif kind == "choice":
                assert c.text in ("yes", "no") and c.finish_reason == "stop"
            else:
                free_texts.append(c.text)
    # the free requests were not held to anyone's language
    assert any(
        classify(ARITH, t) == "invalid" and classify(GBNF, t) == "invalid" for t in free_texts
    )
    _assert_clean(tiny)


def test_preempted_grammar_sequences_stay_valid() -> None:
    """A grammar walk survives preemption: the sequence's guide keeps its place while its KV
    is dropped and recomputed."""
    eng = Engine("radixkv-tiny", num_pages=14, page_size=16, max_prefill_tokens=64)
    g = GuidedDecodingParams(grammar=PARENS_MANY)
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=80, guided=g)
    outs = run_checked(eng, [eng.tokenizer.encode(p) for p in PROMPTS[:4]], params)
    assert eng.stats().num_preemptions > 0
    for o in outs:
        for c in o.outputs:
            _check_output(PARENS_MANY, c, 80, eng.eos_token_ids)
    _assert_clean(eng)


def test_bad_grammars_are_refused_at_submission(tiny: Engine) -> None:
    bad = [
        ("start: expr\n", 'unknown name: "expr"'),  # Lark: a rule never defined
        ('start: "a" (\n', "Expected"),  # Lark: a syntax error
        ("start: /[a-/\n", "regex"),  # a bad terminal regex
        ('item: "a"\n', "no start rule"),  # Lark without start
        ('root ::= "a" (\n', "GBNF"),  # GBNF: a syntax error
        ('answer ::= "a"\n', "root"),  # GBNF without root
    ]
    queued = tiny.stats().num_requests
    for grammar, words in bad:
        with pytest.raises(ValueError, match="guided decoding cannot use the grammar") as e:
            tiny.add_request([1, 2, 3], SamplingParams(guided={"grammar": grammar}))
        assert words in str(e.value), (grammar, str(e.value))
    assert tiny.stats().num_requests == queued  # none of them was submitted
    for g in (
        {"grammar": ""},
        {"grammar": " \n"},
        {"grammar": 5},
        {"grammar": "start: A", "regex": "a"},
        {"grammar": 'start: "a"', "choice": ["a"]},
    ):
        with pytest.raises(ValueError, match="grammar"):
            SamplingParams(guided=g)
    with pytest.raises(ValueError, match="whitespace_pattern applies to json"):
        GuidedDecodingParams(grammar='start: "a"', whitespace_pattern=" ")
    # what refuses guided decoding refuses grammars alike
    with pytest.raises(ValueError, match="beam search cannot be combined with penalties"):
        SamplingParams(beam_width=2, guided={"grammar": PARENS}, presence_penalty=0.5)
    _assert_clean(tiny)


def test_compiled_grammars_are_memoised_and_walks_independent(tiny: Engine) -> None:
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    g = GuidedDecodingParams(grammar=PARENS)
    matcher = compiler.compile(g)
    assert compiler.compile(GuidedDecodingParams(grammar=PARENS)) is matcher
    assert compiler.compile(GuidedDecodingParams(grammar=PARENS, start_after="x")) is matcher
    assert compiler.compile(GuidedDecodingParams(grammar=PARENS_MANY)) is not matcher
    first = compiler.guide(g)
    for ch in b"([":
        first.advance(ch)
    second = compiler.guide(g)  # a fresh walk: the first's place is its own
    assert {chr(i) for i in second.allowed().nonzero()[0]} == {"(", "["}
    assert first.allowed()[ord("]")] and not second.allowed()[ord("]")]
    assert not compiler.compile(g).is_stopped()  # the memoised matcher was never walked


def test_the_empty_schema_is_walked_as_the_json_grammar(tiny: Engine) -> None:
    """``json={}`` (any JSON value; SGLang's ``$$ANY$$``) goes to llguidance's JSON grammar,
    not outlines-core's regex of it (a minute to compile on this vocabulary); a whitespace
    pattern keeps the regex route, which alone honours it. Outputs that stop are JSON."""
    import json

    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    guide = compiler.guide(GuidedDecodingParams(json={}))
    assert type(compiler.compile(GuidedDecodingParams(json={}))).__name__ == "LLMatcher"
    starts = {chr(i) for i in guide.allowed().nonzero()[0] if i < 128}
    assert set('{["-0123456789tfn') <= starts and not starts & set("}]:,abc")
    params = SamplingParams(guided={"json": {}}, temperature=1.0, seed=2, max_tokens=40, n=6)
    outs = tiny.generate(["JSON:"], params, use_tqdm=False)[0].outputs
    stopped = [o.text for o in outs if o.finish_reason == "stop"]
    assert stopped, [o.text for o in outs]
    for text in stopped:
        json.loads(text)
    _assert_clean(tiny)


def test_the_gbnf_and_lark_spellings_of_a_grammar_agree(tiny: Engine) -> None:
    """The same language written as GBNF and as Lark: the guides allow the same characters
    along every prefix of a few sentences."""
    lark = 'start: "[" (item ("," item)*)? "]"\nitem: /[a-z]/ /[a-z]/? /[a-z]/? /[a-z]/? | start\n'
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    for sentence in ("[ab,[c,[]],d]", "[]", "[[[]]]", "[abcd,xyz]"):
        for i in range(len(sentence) + 1):
            a = _walk(compiler, GuidedDecodingParams(grammar=GBNF), sentence[:i]).allowed()
            b = _walk(compiler, GuidedDecodingParams(grammar=lark), sentence[:i]).allowed()
            assert (a == b).all(), sentence[:i]
            assert classify(GBNF, sentence[:i]) != "invalid"


def test_grammar_with_start_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_after``: free up to and including the text, then the grammar holds."""
    eng = Engine("radixkv-tiny", num_pages=256, guided_jump_forward=False)
    script = eng.tokenizer.encode("think ((] </think>([])x", add_special_tokens=False)
    monkeypatch.setattr(engine_mod, "sample", scripted_sampler(script))
    g = GuidedDecodingParams(grammar=PARENS, start_after="</think>")
    (out,) = run_checked(eng, [[1, 2]], SamplingParams(max_tokens=60, guided=g))
    assert out.outputs[0].text == "think ((] </think>([])"
    assert out.outputs[0].finish_reason == "stop"
    _assert_clean(eng)


def test_speculative_decoding_leaves_grammar_requests_alone() -> None:
    """Speculative decoding refuses guided requests (they decode one token a step): a
    grammar request gives the same output with drafts on as off."""
    g = GuidedDecodingParams(grammar=GBNF)
    prompt = [ord(c) for c in "[ab,cd,[ab,cd,[ab,cd,[ab,cd"]
    results = []
    for k in (0, 4):
        eng = Engine("radixkv-tiny", num_pages=256, num_speculative_tokens=k)
        (o,) = run_checked(eng, [prompt], SamplingParams(temperature=0, max_tokens=40, guided=g))
        results.append((o.outputs[0].token_ids, o.outputs[0].finish_reason))
        assert eng.stats().speculative_draft_tokens == 0
        _check_output(GBNF, o.outputs[0], 40, eng.eos_token_ids)
    assert results[0] == results[1]


def test_byte_level_bpe_vocabulary(tmp_path: Any) -> None:
    """A BPE vocabulary whose tokens spell several bytes: outputs are sentences made partly of
    multi-byte tokens, and the tokens llguidance offers for forced bytes spell those bytes."""
    _, lm = make_small_llama(tmp_path)
    tok = lm.tokenizer
    assert isinstance(tok, HFTokenizer)
    spelled = tok.token_bytes()
    eng = Engine(lm, page_size=4, num_pages=400)
    words = ("the", "share", "requests", "comp", "ing", "he")
    grammar = 'start: WORD (" " WORD)* "."\nWORD: ' + " | ".join(f'"{w}"' for w in words) + "\n"
    pattern = f"({'|'.join(words)})( ({'|'.join(words)}))*\\."
    g = GuidedDecodingParams(grammar=grammar)
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=40, guided=g)
    (o,) = run_checked(eng, [tok.encode("hello world")], params)

    def is_prefix(text: str) -> bool:
        *whole, last = text.split(" ")
        return all(w in words for w in whole) and any(w.startswith(last) for w in words)

    multi = 0
    for c in o.outputs:
        if c.finish_reason == "stop":
            assert re.fullmatch(pattern, c.text), c.text
        else:
            assert c.finish_reason == "length" and is_prefix(c.text), c.text
        multi += sum(len(spelled.get(t, b"")) > 1 for t in c.token_ids)
    assert multi > 0  # the walk took multi-byte tokens, not only single bytes
    assert any(c.finish_reason == "stop" for c in o.outputs)
    # the tokenization llguidance offers forced bytes with spells exactly those bytes
    compiler = GuideCompiler(tok, eng.vocab_size, eng.eos_token_ids)
    compiler._facts()
    for text in ("requests", " share", "xyz", "é", "the."):
        ids = compiler._spell(text.encode())
        assert ids and b"".join(spelled[i] for i in ids) == text.encode()
    _assert_clean(eng)


def test_compiled_once_and_masks_keep_exactly_the_allowed_tokens(tiny: Engine) -> None:
    """A grammar is compiled once per compiler (memoised; each guide walks its own copy) and a
    masked row keeps exactly the allowed tokens."""
    compiler = GuideCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)
    compiled = compiler.compile(GuidedDecodingParams(grammar=ARITH))
    assert compiler.compile(GuidedDecodingParams(grammar=ARITH)) is compiled
    text = "12+(3*45)-"
    rows = torch.zeros(3 * len(text), tiny.vocab_size)
    for k in range(3):
        guide = compiler.guide(GuidedDecodingParams(grammar=ARITH))
        for i, b in enumerate(text.encode()):
            guide.mask(rows[k * len(text) + i])
            guide.advance(b)
    assert torch.equal(rows[: len(text)], rows[len(text) : 2 * len(text)])  # walks independent
    last = guide.allowed()  # after "12+(3*45)-": a number or a bracket, nothing else
    assert {chr(i) for i in last.nonzero()[0]} == set(DIGITS + "(")
    row = torch.randn(tiny.vocab_size)
    guide.mask(row)
    assert (torch.isfinite(row) == torch.from_numpy(last)).all()
