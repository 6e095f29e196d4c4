"""Grammars for the grammar-guided decoding tests (engine and server) and an independent
recogniser of each: hand-written recursive descent that says whether a text is a sentence of the
grammar, a prefix of one, or neither. Nothing here uses llguidance."""

from __future__ import annotations

from collections.abc import Callable

# arithmetic, ended by "=": the output stops ("stop") as soon as the "=" is written
ARITH = r"""
start: expr "="
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
ARITH_OPEN = ARITH.replace('start: expr "="', "start: expr")  # may end after any whole expr
# balanced brackets of two kinds, nested: no regular expression describes them
PARENS = """
start: item
item: "(" item* ")" | "[" item* "]"
"""
PARENS_MANY = PARENS.replace("start: item", "start: item+")  # may end between items
# llama.cpp's GBNF (xgrammar's EBNF): nested lists of short words
GBNF = """
# a list of words and lists
root ::= "[" ( item ( "," item )* )? "]"
item ::= [a-z]{1,4} | root
"""


class _Incomplete(Exception):
    """The text ended where the grammar needs more: a prefix of a sentence."""


class _Invalid(Exception):
    """A character no sentence has there."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def at(self, chars: str) -> bool:
        """The next character is one of ``chars`` (False at the end)."""
        return self.pos < len(self.text) and self.text[self.pos] in chars

    def take(self, chars: str) -> bool:
        """Consume an optional character of ``chars``."""
        if self.at(chars):
            self.pos += 1
            return True
        return False

    def eat(self, chars: str) -> str:
        """Consume a character that must be one of ``chars``."""
        if self.pos >= len(self.text):
            raise _Incomplete
        c = self.text[self.pos]
        if c not in chars:
            raise _Invalid
        self.pos += 1
        return c


DIGITS = "0123456789"
LOWER = "abcdefghijklmnopqrstuvwxyz"


def _arith(end: bool) -> Callable[[_Reader], None]:
    def number(r: _Reader) -> None:
        r.eat(DIGITS)
        for _ in range(2):
            if not r.take(DIGITS):
                break

    def factor(r: _Reader) -> None:
        if r.take("("):
            expr(r)
            r.eat(")")
        else:
            number(r)

    def term(r: _Reader) -> None:
        factor(r)
        while r.take("*/"):
            factor(r)

    def expr(r: _Reader) -> None:
        term(r)
        while r.take("+-"):
            term(r)

    def start(r: _Reader) -> None:
        expr(r)
        if end:
            r.eat("=")

    return start


def _parens(many: bool) -> Callable[[_Reader], None]:
    def item(r: _Reader) -> None:
        close = {"(": ")", "[": "]"}[r.eat("([")]
        while r.at("(["):
            item(r)
        r.eat(close)

    def start(r: _Reader) -> None:
        item(r)
        while many and r.at("(["):
            item(r)

    return start


def _gbnf_list(r: _Reader) -> None:
    def item(r: _Reader) -> None:
        if r.at("["):
            _gbnf_list(r)
            return
        r.eat(LOWER)
        for _ in range(3):
            if not r.take(LOWER):
                break

    r.eat("[")
    if r.at(LOWER + "["):
        item(r)
        while r.take(","):
            item(r)
    r.eat("]")


RECOGNISERS: dict[str, Callable[[_Reader], None]] = {
    ARITH: _arith(end=True),
    ARITH_OPEN: _arith(end=False),
    PARENS: _parens(many=False),
    PARENS_MANY: _parens(many=True),
    GBNF: _gbnf_list,
}
NAMES = {ARITH: "arith", ARITH_OPEN: "arith-open", PARENS: "parens", PARENS_MANY: "parens+"}
NAMES[GBNF] = "gbnf"


def classify(grammar: str, text: str) -> str:
    """Whether ``text`` is "complete" (a sentence), a "prefix" of one (not one) or "invalid"."""
    r = _Reader(text)
    try:
        RECOGNISERS[grammar](r)
    except _Incomplete:
        return "prefix"
    except _Invalid:
        return "invalid"
    return "complete" if r.pos == len(text) else "invalid"
