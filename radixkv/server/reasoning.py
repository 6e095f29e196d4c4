"""Reasoning out of a chat reply: a thinking model writes its chain of thought between tags
(``<think>`` ... ``</think>``), the API returns it as ``message.reasoning`` and the rest as
``message.content`` (``radixkv serve --reasoning-parser NAME``, vLLM's flag, names and field).

Whether a reply starts inside a reasoning block is read from the prompt, not guessed from the
reply: templates of thinking-only models (DeepSeek-R1, Qwen3's ``-Thinking-2507``) end the
prompt with the start tag, so the reply holds only the end tag; hybrid ones (Qwen3) leave it to
the model, which opens with the start tag, or close an empty block in the prompt when thinking
is switched off (``chat_template_kwargs={"enable_thinking": false}``). So:

- the prompt ends with the start tag (whitespace aside): the reply starts in reasoning (a
  start tag the model writes again at its head is dropped);
- otherwise a reply that opens with the start tag (whitespace aside) starts reasoning there;
  any other reply is all content, unchanged, exactly as without a parser;
- reasoning runs to the first end tag, or to the end of the reply (``max_tokens`` cut it: no
  content). Whitespace around the reasoning and before the content is dropped (templates put
  newlines there); the tags themselves are in neither.

vLLM's ``qwen3`` parser treats a reply with no end tag as content; here a reply that opened a
block and was cut inside it is reasoning, as the model meant it.

Streaming (:class:`ReasoningStream`) sends each part as soon as it cannot change: a tail that
may be the start of the end tag, or whitespace that may turn out to precede it, is held back
for the next feed. A stream's parts, concatenated, are the whole reply's split, whatever the
chunking (tests/test_server_reasoning.py checks this for random chunkings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# --reasoning-parser name -> (start tag, end tag); both names take <think>, as their models do
_TAGS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}
REASONING_PARSERS = tuple(sorted(_TAGS))


@dataclass(frozen=True)
class Split:
    """A reply (or the part of it that is settled) cut in two. ``reasoned``: the reply entered
    a reasoning block (False: ``content`` is the whole reply, unchanged)."""

    reasoned: bool
    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    """One model family's tags (module docstring for the rules)."""

    name: str
    start: str
    end: str

    @classmethod
    def of(cls, name: str) -> ReasoningParser:
        """The parser ``--reasoning-parser name`` selects (ValueError naming the choices)."""
        if name not in _TAGS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {REASONING_PARSERS}")
        return cls(name, *_TAGS[name])

    def prompt_opens(self, prompt_tail: str) -> bool:
        """Whether a prompt whose text ends with ``prompt_tail`` (decoded with special tokens
        kept) leaves a reasoning block open for the reply."""
        return prompt_tail.rstrip().endswith(self.start)

    def split(self, text: str, opened: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; ``opened``: :meth:`prompt_opens` of its
        prompt. A reply without reasoning is (None, text); otherwise an empty part is None."""
        s = self.settled(text, opened, final=True)
        if not s.reasoned:
            return None, s.content
        return s.reasoning or None, s.content or None

    def settled(self, text: str, opened: bool, *, final: bool) -> Split:
        """What of ``text`` (a reply so far) is settled: with ``final`` the whole reply's
        split; without, the parts that no further text can change (each a prefix of the
        final part)."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start) :]
        elif not final and self.start.startswith(head):
            return Split(opened, "", "")  # the start tag may be coming: nothing is settled
        elif opened:
            body = text
        else:
            return Split(False, "", text)
        body = body.lstrip()
        i = body.find(self.end)
        if i >= 0:
            return Split(True, body[:i].rstrip(), body[i + len(self.end) :].lstrip())
        if final:
            return Split(True, body.rstrip(), "")
        return Split(True, body[: len(body) - self._end_prefix(body)].rstrip(), "")

    def reasoning_tokens(
        self, decode: Callable[[list[int]], str], token_ids: list[int], opened: bool
    ) -> int:
        """How many of a reply's tokens are reasoning: those up to and including the end tag
        (all of them when the block never closes; 0 without a block). ``decode``: the text of
        a token list, as the reply's text was decoded."""
        text = decode(token_ids)
        if not self.settled(text, opened, final=True).reasoned:
            return 0
        if self.end not in text:
            return len(token_ids)
        lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds the end tag
        while lo < hi:
            mid = (lo + hi) // 2
            if self.end in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _end_prefix(self, text: str) -> int:
        """The length of the longest tail of ``text`` that begins the end tag (0: none)."""
        for k in range(min(len(self.end) - 1, len(text)), 0, -1):
            if self.end.startswith(text[-k:]):
                return k
        return 0


class ReasoningStream:
    """One streamed choice's reply through a parser (module docstring): ``feed(new_text)``
    returns the (reasoning, content) that can be sent now, ``finish()`` the rest."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self._text = ""  # the reply so far (each feed re-reads it: a copy or two per token)
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, new_text: str) -> tuple[str, str]:
        self._text += new_text
        return self._take(self.parser.settled(self._text, self.opened, final=False))

    def finish(self) -> tuple[str, str]:
        return self._take(self.parser.settled(self._text, self.opened, final=True))

    def _take(self, s: Split) -> tuple[str, str]:
        r = s.reasoning[self._sent_reasoning :]
        c = s.content[self._sent_content :]
        self._sent_reasoning += len(r)
        self._sent_content += len(c)
        return r, c


@dataclass(frozen=True)
class ReasoningMode:
    """How one chat request's replies are read: the server's parser, whether the request's
    prompt opened a reasoning block (:meth:`ReasoningParser.prompt_opens`), and whether the
    response shows the reasoning (vLLM's ``include_reasoning``)."""

    parser: ReasoningParser
    opened: bool
    include: bool = True

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.opened)
