"""Incremental detokenization with stop strings.

Decoding the whole output every step is quadratic; instead each step decodes a short window
(``ids[prefix_offset:]`` against ``ids[prefix_offset:read_offset]``) and appends the difference,
holding tokens back while they form an incomplete UTF-8 character (the decoder shows U+FFFD).
A few prompt tokens seed the window so tokenizers that merge a leading space decode correctly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context
# the most pairs a shared pair memo keeps (about 130 bytes each); pairs seen after it is full
# are decoded every time, as without the memo
PAIR_MEMO_SIZE = 1 << 17


_UNKNOWN = object()  # a pair not in the memo (None there: an incomplete character)


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Text of one sequence's output, grown one token at a time.

    ``text`` is everything decoded so far (cut at a stop string once one matched);
    ``take_delta()`` returns the part not yet handed out, holding back the last
    ``max_stop_len - 1`` characters while unfinished (a stop string may still be forming there).
    """

    __slots__ = (
        "_emitted",
        "_hold",
        "_ids",
        "_include_stop",
        "_one",
        "_pairs",
        "_prefix_offset",
        "_prev_text",
        "_read_offset",
        "_skip_special",
        "_stops",
        "_tok",
        "stop_matched",
        "text",
    )

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str],
        skip_special_tokens: bool = False,
        include_stop: bool = False,
        one_token_texts: dict[int, str] | None = None,
        pair_texts: dict[int, str | None] | None = None,
    ) -> None:
        """``one_token_texts``: a memo of ``decode([id])`` under this ``skip_special_tokens``
        that detokenizers of one tokenizer may share (filled here as tokens come).
        ``pair_texts``: likewise, a memo of what the usual step appends, a token ``b`` after
        a one-token window ``a`` (a complete character): ``decode([a, b])`` less
        ``decode([a])``, or None while the two end in an incomplete character; it depends on
        the pair alone. Keyed ``a << 32 | b``, at most ``PAIR_MEMO_SIZE`` pairs. (Longer runs,
        a character split in pieces, are decoded each time: they rarely repeat, and a memo
        that misses costs more than it saves.)"""
        self._tok = tokenizer
        self._one = one_token_texts
        self._pairs = pair_texts
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # decode(ids[prefix_offset:read_offset]), kept while the window is unchanged (None:
        # not decoded yet); usually one token, whose text ``one_token_texts`` memoises
        self._prev_text: str | None = None
        self._stops = tuple(stop)
        self._include_stop = include_stop  # keep the matched stop string at the text's end
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._emitted = 0
        self.text = ""
        self.stop_matched: str | None = None

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string completed (text is cut before it,
        or after it with ``include_stop``)."""
        if self.stop_matched is not None:
            raise RuntimeError("detokenizer: token added after a stop string matched")
        ids = self._ids
        ids.append(token_id)
        lo = self._prefix_offset
        pairs = self._pairs
        key = -1
        new: object = _UNKNOWN  # str, None (incomplete) or _UNKNOWN
        if pairs is not None and self._read_offset == lo + 1 == len(ids) - 1:
            key = ids[lo] << 32 | token_id  # (the window and the new token)
            new = pairs.get(key, _UNKNOWN)
        if new is _UNKNOWN:
            prev = self._prev_text
            if prev is None:
                prev = self._prev_text = self._window_text()
            full = self._tok.decode(ids[lo:], skip_special_tokens=self._skip_special)
            # (an incomplete character: the decoder shows U+FFFD)
            new = None if len(full) <= len(prev) or full.endswith("\ufffd") else full[len(prev) :]
            if key >= 0 and len(pairs) < PAIR_MEMO_SIZE:  # type: ignore[arg-type]
                pairs[key] = new  # type: ignore[index]
        if new is None:
            return False  # incomplete character: wait for more tokens
        old_len = len(self.text)
        self.text += new  # type: ignore[operator]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prev_text = None
        return self._check_stop(old_len) if self._stops else False

    def _window_text(self) -> str:
        """``decode(ids[prefix_offset:read_offset])``, a one-token window from the memo."""
        lo, hi = self._prefix_offset, self._read_offset
        one = self._one
        if one is None or hi - lo != 1:
            return self._decode(self._ids[lo:hi])
        tok = self._ids[lo]
        text = one.get(tok)
        if text is None:
            text = one[tok] = self._decode([tok])
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def flush(self) -> None:
        """At finish: append whatever is still pending (even an incomplete character)."""
        if self.stop_matched is not None or self._read_offset == len(self._ids):
            return
        prev = self._window_text() if self._prev_text is None else self._prev_text
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prev):
            self.text += full[len(prev) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prev_text = None

    def _check_stop(self, old_len: int) -> bool:
        if not self._stops:
            return False
        start = max(0, old_len - self._hold)  # a match may begin inside the previous text
        best = -1
        for s in self._stops:
            p = self.text.find(s, start)
            if p != -1 and (best == -1 or p < best):
                best, self.stop_matched = p, s
        if best == -1:
            return False
        assert self.stop_matched is not None
        self.text = self.text[: best + (len(self.stop_matched) if self._include_stop else 0)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, keeps the stop-string hold-back."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def take(self, finished: bool) -> tuple[str, str]:
        """``take_delta(finished)`` and then ``emitted_text``, in one call (an output's two
        texts; made for every streamed request every step)."""
        text = self.text
        emitted = self._emitted
        end = len(text) if finished else max(emitted, len(text) - self._hold)
        self._emitted = end
        # (a slice to the end is ``text`` itself: no copy when nothing is held back)
        return text[emitted:end], text[:end]


def decode_output(
    tokenizer: _Decoder,
    output_ids: Sequence[int],
    *,
    ends_with_stop_token: bool,
    skip_special_tokens: bool,
) -> str:
    """An output's whole text at once, for outputs not decoded as they were generated: the
    stop token that ended it is left out and special tokens follow ``skip_special_tokens``,
    as in the text :class:`IncrementalDetokenizer` builds token by token."""
    ids = output_ids[:-1] if ends_with_stop_token else output_ids
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
