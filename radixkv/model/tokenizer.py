"""Tokenizers: a protocol, a wrapper around ``tokenizers.Tokenizer``, and the byte-level one of
radixkv-tiny. Both render chat templates with :mod:`radixkv.model.chat_template`.

:func:`encode_chat` is the one way a conversation becomes token ids: ``Engine.chat``, the HTTP
server's chat completions, the Ray ingress's routing hints and ``radixkv generate --chat`` all
call it, so the same conversation gives the same ids (and shares cache entries) on every path.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from typing import Any, Protocol, runtime_checkable

from radixkv.model.chat_template import ChatTemplateError, render_chat_template


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: list[int]
    vocab_size: int
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str: ...


class _ChatMixin:
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render the chat template (``tools``: JSON schemas the template lists for the model;
        ``chat_template_kwargs``: the template's own switches, e.g. ``enable_thinking``).
        Encode the result with ``add_special_tokens=False`` (:func:`encode_chat` does): the
        template already writes any BOS it wants."""
        if not self.chat_template:
            raise ChatTemplateError("this tokenizer has no chat template")
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The token ids of a conversation: the chat template rendered, then encoded without
    adding special tokens, because the template writes the BOS the model expects (encoding with
    special tokens would put a second one in front; transformers' ``apply_chat_template(...,
    tokenize=True)`` encodes the same way). Raises
    ChatTemplateError (a ValueError) when the template rejects the messages or they render to
    no tokens."""
    text = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ChatTemplateError("the messages render to no tokens")
    return ids


class ByteTokenizer(_ChatMixin):
    """UTF-8 bytes are ids 0..255; special tokens follow. Special-token strings in the text are
    encoded as their ids. Decoding replaces invalid UTF-8 and ignores ids past the vocabulary."""

    def __init__(
        self,
        special_tokens: Sequence[str],
        *,
        eos_tokens: Sequence[str],
        bos_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.special_tokens = list(special_tokens)
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.special_tokens)}
        for tok in eos_tokens:
            if tok not in self._special_ids:
                raise ValueError(f"ByteTokenizer: eos token {tok!r} is not a special token")
        self.eos_token_ids = [self._special_ids[t] for t in eos_tokens]
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token = bos_token
        self.bos_token_id = self._special_ids[bos_token] if bos_token else None
        self.chat_template = chat_template
        self.vocab_size = 256 + len(self.special_tokens)
        alternatives = sorted(self.special_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Bytes of ``text``; ``add_special_tokens`` prepends BOS when the tokenizer has one."""
        ids: list[int] = [self.bos_token_id] if add_special_tokens and self.bos_token_id else []
        for part in self._split.split(text):
            if part in self._special_ids:
                ids.append(self._special_ids[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if type(ids) is list:  # (not a buffer, whose raw memory bytes() would copy)
            try:  # all ordinary tokens, the usual case: one C call
                return bytes(ids).decode("utf-8", errors="replace")
            except (ValueError, TypeError):  # a special token (>= 256) among them
                pass
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if not skip_special_tokens and 256 <= i < self.vocab_size:
                out.append(self.special_tokens[i - 256])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary token's bytes (the special tokens have none): for guided decoding."""
        return {i: bytes([i]) for i in range(256)}


class HFTokenizer(_ChatMixin):
    """A ``tokenizers.Tokenizer`` (from tokenizer.json) plus the chat template and EOS ids."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self) -> dict[int, bytes]:
        """Each ordinary token's bytes, what it adds to decoded text (special tokens left out):
        for guided decoding, which matches the output's bytes against a regular language.

        Byte-level BPE (GPT-2, Llama 3, Qwen) spells bytes as printable characters, mapped
        back here; SentencePiece-style vocabularies (Llama 2, Mistral) spell a space as U+2581
        and an unmapped byte as ``<0xNN>`` (byte fallback)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        byte_level = '"ByteLevel"' in json.dumps(decoder)
        specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        to_byte = _byte_level_decoding()
        out: dict[int, bytes] = {}
        for text, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in specials:
                continue
            if byte_level:
                try:
                    out[i] = bytes(to_byte[c] for c in text)
                except KeyError:  # an added token is stored as plain text
                    out[i] = text.encode()
            elif m := _BYTE_FALLBACK.fullmatch(text):
                out[i] = bytes([int(m[1], 16)])
            else:
                out[i] = text.replace("\u2581", " ").encode()
        return out


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_decoding() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes (controls, space, ...) for the code points from 256 on, in
    byte order (GPT-2's convention, which every byte-level vocabulary uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in printable}
    others = sorted(set(range(256)) - set(printable))
    out.update({chr(256 + k): b for k, b in enumerate(others)})
    return out
