"""Guided decoding: each step, a guided sequence may only sample tokens that keep its output a
prefix of some string in its language: a regular one (a JSON schema's, any JSON object's, a
regex's or a list of choices') or a context-free grammar's.

outlines-core does the automata work for the regular languages: ``Index`` compiles the
language's regex against the vocabulary (token id -> the bytes it spells, from the tokenizer's
``token_bytes``) into a DFA whose transitions are token ids; a ``Guide`` walks one sequence
through it and writes the set of allowed tokens as a bitmask. llguidance does it for grammars
(``GuidedDecodingParams.grammar``: Lark, or GBNF converted to Lark): an ``LLTokenizer`` built
from the same vocabulary facts (token bytes, EOS ids), an ``LLMatcher`` per grammar (its lexer
and Earley parser, compiled once) and a copy of it per sequence, which writes the same kind of
bitmask (bit t of word t // 32: token t). Here:

* :class:`GuideCompiler` (one per engine) turns ``GuidedDecodingParams`` into a compiled index
  (or matcher), memoising the last ``CACHE_SIZE``: compiling is the costly part (milliseconds
  on a byte vocabulary, up to seconds for a large schema on a 150k one), a walk is
  microseconds.
* :class:`TokenGuide` (one per guided sequence) masks that sequence's logits and advances on the
  token it sampled, whichever library walks it (:class:`_RegexWalk`, :class:`_GrammarWalk`).

The vocabulary's end-of-sequence token stands for all of the model's EOS ids: they are allowed
where the language may end (and only there), so a guided output can only finish in the language
(or at ``max_tokens``). Once nothing but the end may follow, the engine finishes the sequence
with "stop" without spending a step on an EOS token.

A grammar's output is checked as llguidance parses it: terminals (Lark's upper-case rules,
strings and regexes) are lexed greedily, longest match first, so ``A: /a+/`` followed by
``"a"`` accepts nothing; write grammars whose tokens do not run into each other (as for any
lexer). Where a grammar forces some bytes, llguidance offers the tokens that spell them as the
tokenizer would (:meth:`GuideCompiler._spell`), which jump-forward then appends.

The empty schema (any JSON value) is walked as llguidance's JSON grammar (``ANY_JSON_GRAMMAR``).
Any other JSON schema becomes a regex (outlines-core's ``build_regex_from_schema``), so what a regular
language cannot express is not checked: numeric ranges (``UNENFORCED``: accepted, with a
warning). Types, required and optional properties in order, enums and consts, string lengths
and patterns, array lengths, ``anyOf``/``oneOf`` and local ``$ref`` are. Integers are held to
``MAX_INTEGER_DIGITS`` digits unless the schema's ``maxDigits`` says otherwise.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.engine.params import GuidedDecodingParams

if TYPE_CHECKING:
    from radixkv.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_SIZE = 64  # compiled indexes kept (per engine), least recently used dropped first
_META = set("\\.+*?()|[]{}^$#&-~")  # what a literal must escape in outlines-core's regex syntax
# JSON-schema keywords a regular language cannot check (numeric ranges): accepted, not enforced
UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# digits an integer may have unless its schema sets maxDigits: JSON readers lose integers past
# 2**53 (16 digits) anyway
MAX_INTEGER_DIGITS = 16
# The empty JSON schema (any JSON value) as llguidance's grammar: outlines-core's regex of it
# is huge (radixkv-tiny's vocabulary took 57 s to compile it, llguidance 25 ms)
ANY_JSON_GRAMMAR = "start: %json {}\n"
# tokens a walk can be rolled back (drafts judged and refused, speculative.py): the most
# drafts a step can carry (EngineConfig.num_speculative_tokens)
MAX_ROLLBACK = 64
# llguidance's parser limits (LLParserLimits' defaults, kept): a grammar that needs more fails
# at intake (GuideCompiler.compile), not mid-generation
MAX_ITEMS_IN_ROW = 2000  # Earley items in one row: about one per alternative of a rule
MAX_GRAMMAR_SIZE = 500_000
# alternatives one rule may have: a rule of n alternatives puts n + 1 items in one row
MAX_RULE_ALTERNATIVES = MAX_ITEMS_IN_ROW - 1
# a GBNF/EBNF grammar (llama.cpp's, xgrammar's) defines its rules with "::="; Lark with ":"
_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)


def _literal(text: str) -> str:
    return "".join("\\" + c if c in _META else c for c in text)


def guide_regex(g: GuidedDecodingParams) -> str:
    """The regular expression the output must match (ValueError for an unsupported schema)."""
    from outlines_core.json_schema import build_regex_from_schema

    if g.grammar is not None:
        raise ValueError("guided grammar: a context-free grammar has no regex")
    if g.regex is not None:
        return g.regex
    if g.choice is not None:
        return "(" + "|".join(_literal(c) for c in g.choice) + ")"
    schema = '{"type":"object"}' if g.json_object else g.json
    assert schema is not None
    value = json.loads(schema)
    ignored = sorted(_keywords(value) & set(UNENFORCED))
    if ignored:
        log.warning("guided json: %s are not enforced (numeric ranges)", ", ".join(ignored))
    try:
        return build_regex_from_schema(json.dumps(_bound_integers(value)), g.whitespace_pattern)
    except Exception as e:  # outlines-core raises its own error types for schemas it lacks
        raise ValueError(f"guided json: unsupported JSON schema: {e}") from None


def _bound_integers(node: Any) -> Any:
    """``node`` with every integer schema that does not say otherwise held to
    ``MAX_INTEGER_DIGITS`` digits (outlines-core's ``maxDigits``), as llama.cpp's JSON grammars
    do: a model that keeps choosing digits would otherwise run to ``max_tokens`` inside one
    number and leave no valid JSON."""
    if isinstance(node, list):
        return [_bound_integers(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bound_integers(v) for k, v in node.items()}
    if out.get("type") == "integer" and "maxDigits" not in out:
        out["maxDigits"] = MAX_INTEGER_DIGITS
    return out


def guide_grammar(g: GuidedDecodingParams) -> str | None:
    """The grammar llguidance walks for ``g``, or None when outlines-core's index does: the
    params' own grammar, or ANY_JSON_GRAMMAR for the empty schema (without a whitespace
    pattern, which only the regex route honours)."""
    if g.grammar is not None:
        return g.grammar
    if g.json is not None and g.whitespace_pattern is None and json.loads(g.json) == {}:
        return ANY_JSON_GRAMMAR
    return None


def grammar_lark(grammar: str) -> str:
    """``grammar`` in llguidance's Lark: as it is, or converted from GBNF/EBNF (a rule defined
    with ``::=``, ``root`` the start). ValueError naming the problem when it cannot be read."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # its own error type, with the line and the place
        raise ValueError(f"guided decoding cannot use the grammar (GBNF): {e}") from None


# a Lark rule's head: "name:", "?name:", "!name.2:" (a lower-case name: a rule the Earley
# parser walks; an upper-case one is a terminal, compiled into the lexer and not limited so)
_LARK_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
# what may hold a "|" that is not an alternative: strings, regexes, comments
_LARK_OPAQUE = re.compile(
    r'"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[a-z]*|//[^\n]*|#[^\n]*'
)


def check_rule_sizes(lark: str) -> None:
    """ValueError naming the limit when a rule of the Lark grammar has more alternatives
    (counted over all its groups) than the Earley parser can hold in one row: such a grammar
    compiles, then fails at the first token (llguidance: "Current row has N items")."""
    bare = _LARK_OPAQUE.sub('""', lark)
    heads = list(_LARK_HEAD.finditer(bare))
    for head, nxt in zip(heads, [*heads[1:], None]):
        name = head.group(1)
        if name[0].isupper() or name.startswith("%"):
            continue
        body = bare[head.end() : None if nxt is None else nxt.start()]
        alternatives = body.count("|") + 1
        if alternatives > MAX_RULE_ALTERNATIVES:
            raise ValueError(
                f"guided grammar: rule {name!r} has {alternatives} alternatives; the limit is "
                f"{MAX_RULE_ALTERNATIVES} per rule (the grammar parser holds at most "
                f"{MAX_ITEMS_IN_ROW} items in one row); split it into nested rules or make it "
                "a terminal (an upper-case rule)"
            )


def _keywords(node: object) -> set[str]:
    """Every key used anywhere in a JSON value."""
    if isinstance(node, dict):
        return set(node).union(*(_keywords(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keywords(v) for v in node))
    return set()


class GuideCompiler:
    """Compiles guided-decoding params against one tokenizer's vocabulary (lazily built on the
    first guided request, then shared), with a small LRU of compiled indexes and grammars.

    Thread-safe: an asyncio front end compiles in a worker thread (a large schema on a large
    vocabulary takes seconds) while the engine's own thread submits requests, whose compile is
    then a cache hit. Two threads compiling the same params at once both compile; one result
    is kept."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: the width of a row of logits
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._vocabulary: Any = None  # outlines-core's
        self._ll_tokenizer: Any = None  # llguidance's
        self._by_bytes: dict[bytes, list[int]] | None = None  # the ordinary tokens' spellings
        self._index_size = 0  # ids the index's bitmask covers (its vocabulary's largest + 1)
        self._same: dict[int, list[int]] = {}  # token -> all tokens spelling its bytes (>= 2)
        self._spelling: dict[int, bytes] = {}  # token -> its bytes (start_after's matching)
        self._piece: dict[bytes, int] = {}  # bytes -> the token spelling them (highest id)
        self._ordinary: set[int] = set()  # the tokens that spell bytes
        self._longest = 0  # bytes of the longest token
        self._cache: OrderedDict[GuidedDecodingParams, Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the vocabularies' construction

    def _vocab(self) -> Any:
        with self._lock:
            if self._vocabulary is None:
                from outlines_core import Vocabulary

                by_bytes = self._facts()
                self._vocabulary = Vocabulary(self.eos_token_ids[0], by_bytes)
            return self._vocabulary

    def _ll_vocab(self) -> Any:
        """llguidance's tokenizer over the same vocabulary: token t spells ``tokens[t]``; the
        EOS ids and the tokens that spell nothing (specials, padding) are special tokens, which
        no grammar string matches."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                by_bytes = self._facts()
                n = max(self.vocab_size, self.eos_token_ids[-1] + 1)
                tokens = [b""] * n
                for b, ids in by_bytes.items():
                    for i in ids:
                        tokens[i] = b
                special = [i for i, b in enumerate(tokens) if not b]
                for i in special:  # llguidance's mark of a special token: a leading 0xff
                    tokens[i] = b"\xff<[%d]>" % i
                wrapper = llguidance.TokenizerWrapper(_Spell(self, tokens, special))
                self._ll_tokenizer = llguidance.LLTokenizer(
                    wrapper, n_vocab=n, eos_token=self.eos_token_ids
                )
            return self._ll_tokenizer

    def _facts(self) -> dict[bytes, list[int]]:
        """The vocabulary facts both libraries are built from (under the lock): bytes -> the
        ordinary tokens spelling them (not EOS, not past the model's vocabulary, not empty)."""
        if self._by_bytes is not None:
            return self._by_bytes
        spell = getattr(self._tokenizer, "token_bytes", None)
        if spell is None:
            raise ValueError(
                f"guided decoding needs the tokenizer's token bytes; "
                f"{type(self._tokenizer).__name__} has no token_bytes()"
            )
        if not self.eos_token_ids:
            raise ValueError("guided decoding needs an EOS token: the model has none")
        eos = self.eos_token_ids[0]
        by_bytes: dict[bytes, list[int]] = {}
        self._spelling = dict(spell())
        for i, b in self._spelling.items():
            if i < self.vocab_size and i not in self.eos_token_ids and b:
                by_bytes.setdefault(b, []).append(i)
        for ids in by_bytes.values():  # ascending: token_bytes' order can differ by process
            ids.sort()
        self._index_size = max([eos, *(i for ids in by_bytes.values() for i in ids)]) + 1
        # tokens that spell the same bytes (SentencePiece's byte-fallback <0x61> and "a"): one
        # stands for all of them where the language forces those bytes (jump-forward), the
        # highest id (a vocabulary's byte-fallback tokens come first, its own pieces after)
        self._same = {i: ids for ids in by_bytes.values() if len(ids) > 1 for i in ids}
        self._piece = {b: max(ids) for b, ids in by_bytes.items()}
        self._ordinary = {i for ids in by_bytes.values() for i in ids}
        self._longest = max(map(len, by_bytes), default=0)
        self._by_bytes = by_bytes
        return by_bytes

    def _spell(self, data: bytes) -> list[int]:
        """Tokens spelling exactly ``data``: the tokenizer's own encoding where it does (no BOS,
        no SentencePiece prefix space, no special token read out of the text), else the
        longest tokens first. llguidance tokenizes the bytes a grammar forces with it and
        offers only that tokenization's first token there."""
        try:
            ids = self._tokenizer.encode(data.decode("utf-8"), add_special_tokens=False)
        except (UnicodeDecodeError, ValueError):
            ids = None
        ordinary, spelling, piece = self._ordinary, self._spelling, self._piece
        if (
            ids is not None
            and all(i in ordinary for i in ids)
            and b"".join(spelling[i] for i in ids) == data
        ):
            return list(ids)
        out: list[int] = []
        pos = 0
        while pos < len(data):
            for end in range(min(len(data), pos + self._longest), pos, -1):
                token = piece.get(data[pos:end])
                if token is not None:
                    out.append(token)
                    pos = end
                    break
            else:  # a byte no token spells: the tokens that spell the part before it
                return out
        return out

    def compile(self, g: GuidedDecodingParams) -> Any:
        """The compiled index (a grammar's matcher) for ``g`` (ValueError naming the problem
        when it cannot be)."""
        if g.start_after is not None:  # the language is the same: one index for both
            g = replace(g, start_after=None)

        with self._lock:
            index = self._cache.get(g)
            if index is not None:
                self._cache.move_to_end(g)
                return index
        grammar = guide_grammar(g)
        index = self._compile_grammar(grammar) if grammar is not None else self._index(g)
        with self._lock:
            self._cache[g] = index
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return index

    def _index(self, g: GuidedDecodingParams) -> Any:
        from outlines_core import Index

        # Anchored at the end: without the anchor outlines-core drops a final state's
        # transitions into non-final ones (``a(bc)?`` would never offer "b" after "a", nor a
        # JSON number its fraction); with it the walks are exactly the regex's prefixes
        # (tests/test_engine_guided.py checks them against Python's re)
        regex = f"(?:{guide_regex(g)})$"
        vocab = self._vocab()
        try:
            return Index(regex, vocab)
        except Exception as e:  # a bad regex, or one no token sequence can spell
            raise ValueError(f"guided decoding cannot use {_what(g)}: {e}") from None

    def _compile_grammar(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar`` (never walked: each sequence walks a copy)."""
        import llguidance

        lark = grammar_lark(grammar)
        check_rule_sizes(lark)
        tokenizer = self._ll_vocab()
        matcher = llguidance.LLMatcher(
            tokenizer,
            llguidance.LLMatcher.grammar_from_lark(lark),
            log_level=0,  # errors are read here and raised, not printed
            limits=llguidance.LLParserLimits(  # no parser dumps
                verbose_errors=False,
                max_items_in_row=MAX_ITEMS_IN_ROW,
                max_grammar_size=MAX_GRAMMAR_SIZE,
            ),
        )
        if matcher.is_error():  # a syntax error, an unknown rule, a bad regex, no start
            raise ValueError(f"guided decoding cannot use the grammar: {matcher.get_error()}")
        # The Earley parser's limits (a rule of more than MAX_ITEMS_IN_ROW alternatives) are
        # met when the first mask is computed: meet them here, at intake, on a throwaway copy,
        # never first in the middle of a batch
        probe = matcher.deep_copy()
        words = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if probe.is_error():
            raise ValueError(_limit_message(probe.get_error()))
        for warning in matcher.get_grammar_warnings():
            log.warning("guided grammar: %s", warning)
        return matcher

    def guide(self, g: GuidedDecodingParams, *, allow_eos: bool = True) -> TokenGuide:
        """A fresh walk for one sequence; ``allow_eos=False`` (``ignore_eos``) never offers an
        EOS token, where the language may end or go on (it still ends where it must)."""
        compiled = self.compile(g)
        if guide_grammar(g) is not None:
            walk: _RegexWalk | _GrammarWalk = _GrammarWalk(compiled.deep_copy())
            size = self._ll_vocab().vocab_size
        else:
            walk = _RegexWalk(compiled, self.eos_token_ids[0])
            size = self._index_size
        guide = TokenGuide(walk, self.vocab_size, size, self.eos_token_ids, allow_eos, self._same)
        if g.start_after is not None:
            guide.wait_for(g.start_after.encode(), self._spelling)
        return guide


class _Spell:
    """What llguidance's ``TokenizerWrapper`` reads: the tokens' bytes, the EOS and special
    ids, and a call that tokenizes bytes (the compiler's exact spelling)."""

    def __init__(self, compiler: GuideCompiler, tokens: list[bytes], special: list[int]) -> None:
        self.tokens = tokens
        self.eos_token_id = compiler.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = special
        self._compiler = compiler

    def __call__(self, data: bytes) -> list[int]:
        return self._compiler._spell(data)


def _what(g: GuidedDecodingParams) -> str:
    if g.regex is not None:
        return f"regex {g.regex!r}"
    if g.choice is not None:
        return f"choice {list(g.choice)!r}"
    return "the JSON schema" if g.json is not None else "json_object"


class _RegexWalk:
    """One sequence's walk through an outlines-core index."""

    __slots__ = ("_eos", "_guide", "_index", "_walked")

    def __init__(self, index: Any, eos: int) -> None:
        from outlines_core import Guide

        self._guide = Guide(index, max_rollback=MAX_ROLLBACK)
        self._index = index
        self._eos = eos
        # the tokens walked: a fork replays them (a Guide cannot be set to a state, and
        # copying one serialises its whole index)
        self._walked: list[int] = []

    def fork(self) -> _RegexWalk:
        twin = _RegexWalk(self._index, self._eos)
        for t in self._walked:
            twin.advance(t)
        return twin

    def write_mask(self, words: np.ndarray) -> None:
        self._guide.write_mask_into(words.ctypes.data, words.size, 4)

    def advance(self, token: int) -> None:
        self._guide.advance(token)
        self._walked.append(token)

    def rollback(self, n: int) -> None:
        if n:
            self._guide.rollback_state(n)
            del self._walked[-n:]

    def done(self) -> bool:
        g = self._guide
        return g.is_finished() and g.get_tokens() == [self._eos]


class _GrammarWalk:
    """One sequence's walk through a grammar: its own copy of the compiled llguidance matcher
    (the Earley parser's state; the compiled lexer and grammar are shared)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fork(self) -> _GrammarWalk:
        return _GrammarWalk(self._matcher.deep_copy())

    def write_mask(self, words: np.ndarray) -> None:
        m = self._matcher
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if m.is_error():  # a parser limit met past the start: this sequence ends with "error"
            raise ValueError(_limit_message(m.get_error()))

    def advance(self, token: int) -> None:
        m = self._matcher
        if not m.consume_token(token):
            raise ValueError(f"guided grammar: token {token} is not allowed: {m.get_error()}")

    def rollback(self, n: int) -> None:
        if n:
            self._matcher.rollback(n)

    def done(self) -> bool:
        # nothing but EOS may follow (also after a parser error: the output ends there)
        return self._matcher.is_stopped()


def _limit_message(error: str) -> str:
    """A parser error as the engine reports it, naming the limit it most likely hit."""
    return (
        f"guided grammar exceeds the parser's limits (at most {MAX_ITEMS_IN_ROW} Earley items "
        f"in one row: a rule with about {MAX_ITEMS_IN_ROW} or more alternatives; "
        f"{MAX_GRAMMAR_SIZE} grammar symbols in all): {error.strip().splitlines()[0]}"
    )


class TokenGuide:
    """One sequence's position in a compiled index or grammar (its walk); while it waits for a
    ``start_after`` text (:meth:`wait_for`) it masks nothing, forces nothing and walks
    nothing. The walk's bitmask is written once per position and read by :meth:`allowed`,
    :meth:`mask` and :meth:`forced` until the next :meth:`advance`."""

    __slots__ = (
        "_eos",
        "_eos_ok",
        "_fresh",
        "_index_size",
        "_same",
        "_seen",
        "_spelling",
        "_trigger",
        "_vocab_size",
        "_walk",
        "_words",
    )

    def __init__(
        self,
        walk: _RegexWalk | _GrammarWalk,
        vocab_size: int,
        index_size: int,
        eos: list[int],
        allow_eos: bool,
        same: dict[int, list[int]],
    ) -> None:
        self._walk = walk
        self._eos_ok = allow_eos
        self._same = same  # the compiler's: tokens spelling the same bytes
        self._vocab_size = vocab_size
        self._index_size = index_size
        self._eos = eos
        self._words = np.zeros((index_size + 31) // 32, dtype=np.int32)  # the bitmask
        self._fresh = False  # whether _words holds the current position's mask
        self._trigger: bytes | None = None  # start_after's bytes while still waiting for them
        self._seen = b""  # the output's last bytes while waiting (shorter than the trigger)
        self._spelling: dict[int, bytes] = {}

    def fork(self) -> TokenGuide:
        """An independent guide at this one's position (a beam search fork): the two walk on
        apart."""
        twin = TokenGuide(
            self._walk.fork(),
            self._vocab_size,
            self._index_size,
            self._eos,
            self._eos_ok,
            self._same,
        )
        twin._trigger, twin._seen, twin._spelling = self._trigger, self._seen, self._spelling
        return twin

    def wait_for(self, trigger: bytes, spelling: dict[int, bytes]) -> None:
        """Stay free until the sampled tokens (``spelling``: token -> bytes) have spelled
        ``trigger``; the constraint starts with the token after the one that completes it."""
        self._trigger, self._seen, self._spelling = trigger, b"", spelling

    @property
    def waiting(self) -> bool:
        """Still free: the ``start_after`` text has not been generated yet."""
        return self._trigger is not None

    def _mask_words(self) -> np.ndarray:
        if not self._fresh:
            self._walk.write_mask(self._words)
            self._fresh = True
        return self._words

    def allowed(self) -> np.ndarray:
        """``[vocab_size]`` bool: the tokens that may come next (all EOS ids where it may end;
        every token while waiting for ``start_after``)."""
        if self._trigger is not None:
            return np.ones(self._vocab_size, dtype=bool)
        w = self._mask_words()
        # bit k of little-endian word j is token 32 j + k: the bytes' bits in little order
        bits = np.unpackbits(w.view(np.uint8), bitorder="little").view(bool)  # [32 W]
        out = np.zeros(self._vocab_size, dtype=bool)
        n = min(self._index_size, self._vocab_size)
        out[:n] = bits[:n]
        out[self._eos] = self._eos_ok and bool(bits[self._eos[0]])
        if not out.any():  # nothing can follow (a grammar parser's limit): end, not NaN
            out[self._eos] = True
        return out

    def mask(self, row: torch.Tensor) -> None:
        """Set the disallowed entries of one row of logits ``[vocab_size]`` to -inf, in place."""
        if self._trigger is not None:
            return
        allowed = self.allowed()
        ids = np.flatnonzero(allowed)
        if len(ids) * 8 < len(allowed):  # few allowed (a number, a keyword): keep just those
            _keep_only(row, torch.from_numpy(ids).to(row.device, non_blocking=True))
        else:  # free text inside a JSON string: most of the vocabulary
            banned = torch.from_numpy(~allowed).to(row.device, non_blocking=True)
            row.masked_fill_(banned, float("-inf"))

    def advance(self, token: int) -> None:
        """Move past ``token`` (which must have been allowed; an EOS id is not walked)."""
        trigger = self._trigger
        if trigger is not None:
            seen = self._seen + self._spelling.get(token, b"")
            if trigger in seen:
                self._trigger = None
            else:
                self._seen = seen[-(len(trigger) - 1) :] if len(trigger) > 1 else b""
            return
        if token not in self._eos:
            self._fresh = False
            self._walk.advance(token)

    def forced(self) -> int | None:
        """The token to append when the language allows exactly one next spelling (and it is
        not the end): the one token, or the highest id of tokens that all spell the same bytes;
        else None. Reads the bitmask's few set bits, not the token list, which can hold most
        of a large vocabulary."""
        if self._trigger is not None:
            return None
        w = self._mask_words()
        nz = np.flatnonzero(w)
        if not 0 < len(nz) <= 4:
            return None
        ids: list[int] = []
        for j in nz.tolist():
            word = int(w[j]) & 0xFFFFFFFF
            while word and len(ids) <= 8:
                low = word & -word
                ids.append(j * 32 + low.bit_length() - 1)
                word ^= low
        token = max(ids)
        if len(ids) > 1 and sorted(ids) != self._same.get(token):
            return None  # two spellings (or more than one token's worth) may follow
        return None if token in self._eos or token >= self._vocab_size else token

    def judge_drafts(
        self, drafts: list[int], rows: torch.Tensor | None = None, *, force: bool = False
    ) -> int:
        """How many leading ``drafts`` the language allows from here (speculative decoding:
        drafts it refuses can never be kept). With ``rows`` (``[1 + k, V]`` logits, position
        ``j`` predicting the token after ``drafts[:j]``), masks each row up to and including
        the first refused draft's in place, by the language after the drafts before it: what
        sampling each position one step at a time would see (rows past it are left alone:
        nothing there can be kept). ``force`` (jump-forward): where the language forces a token
        (:meth:`forced`), that token is the only one allowed, as jump-forward would append it
        without sampling. An EOS draft counts as refused. The guide ends where it began (the
        walk is rolled back, a ``start_after`` wait restored)."""
        trigger, seen = self._trigger, self._seen
        walked = 0
        n = 0
        try:
            while True:
                f = self.forced() if force else None
                if rows is not None:
                    if f is None:
                        self.mask(rows[n])
                    else:  # jump-forward's token alone
                        _keep_only(rows[n], torch.tensor([f], device=rows.device))
                if n == len(drafts):
                    break
                d = drafts[n]
                if d in self._eos or d >= self._vocab_size or (f is not None and d != f):
                    break
                free = self._trigger is not None
                if not free:
                    w = self._mask_words()
                    if d >= self._index_size or not (int(w[d >> 5]) >> (d & 31)) & 1:
                        break
                self.advance(d)
                walked += not free
                n += 1
        finally:
            self._walk.rollback(walked)
            self._trigger, self._seen = trigger, seen
            self._fresh = walked == 0 and self._fresh
        return n

    @property
    def only_end(self) -> bool:
        """Nothing but the end may follow (the output is complete)."""
        if self._trigger is not None:
            return False
        return self._walk.done()


def _keep_only(row: torch.Tensor, ids: torch.Tensor) -> None:
    """Set every entry of ``row`` but ``ids`` (on the row's device) to -inf, in place."""
    keep = row[ids]
    row.fill_(float("-inf"))
    row[ids] = keep


def mask_logits(logits: torch.Tensor, guides: list[TokenGuide | None]) -> torch.Tensor:
    """``logits [B, V]`` (the step's picked rows, modified in place and returned) with each
    guided row's disallowed tokens at -inf."""
    for row, g in enumerate(guides):
        if g is not None:
            g.mask(logits[row])
    return logits
