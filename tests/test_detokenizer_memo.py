"""The detokenizer's pair memo (``pair_texts``) against decoding every step: the same text,
stop matches, return values and final text, token by token, for random streams (split
characters, special tokens, stop strings) under two tokenizers."""

from __future__ import annotations

import random
from typing import Any

import pytest
from _model_hf_builders import train_byte_level_bpe

from radixkv.engine import detokenizer as detok_mod
from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.model.tiny import tiny_tokenizer
from radixkv.model.tokenizer import HFTokenizer


class _Contextual:
    """A decoder where what a token adds depends on the token before it (a space between two
    whose sum is a multiple of 3), and a lead token (35 and up) makes one character with the
    next (U+FFFD alone): a memo keyed on the new token alone would go wrong here."""

    vocab_size = 40

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        out = []
        i = 0
        while i < len(ids):
            t = ids[i]
            if t >= 35:
                if i + 1 < len(ids):
                    out.append(chr(0x100 + t * 40 + ids[i + 1]))
                    i += 2
                    continue
                out.append("\ufffd")
            elif not (skip_special_tokens and t == 0):
                out.append((" " if i and (ids[i - 1] + t) % 3 == 0 else "") + chr(97 + t % 26))
            i += 1
        return "".join(out)


def _tokenizers() -> dict[str, Any]:
    return {
        "bytes": tiny_tokenizer(),
        "bpe": HFTokenizer(train_byte_level_bpe(), eos_token_ids=[2]),
        "contextual": _Contextual(),
    }


TOKENIZERS = _tokenizers()


def _stream(rng: random.Random, vocab: int) -> list[int]:
    out = []
    for _ in range(rng.randrange(1, 60)):
        r = rng.random()
        if r < 0.6:
            out.append(rng.randrange(32, 127))  # ASCII (bytes) / short merges (BPE)
        elif r < 0.9:
            out.append(rng.randrange(0, vocab))  # anything, pieces of characters included
        else:
            out.append(rng.choice([0xE2, 0x82, 0xAC, 0xC3, 0xA9]))  # split UTF-8 sequences
    return out


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_pair_memo_decodes_as_every_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = TOKENIZERS[name]
    rng = random.Random(1)
    monkeypatch.setattr(detok_mod, "PAIR_MEMO_SIZE", 500)  # the full memo's path too
    for skip in (False, True):
        memo_one: dict[int, str] = {}
        memo_pairs: dict[int, str | None] = {}
        for trial in range(150):
            prompt = [rng.randrange(32, 127) for _ in range(rng.randrange(1, 8))]
            stop = rng.choice([(), ("ab",), ("x", "€"), ("q r",)])
            include = rng.random() < 0.5
            ref = IncrementalDetokenizer(tok, prompt, stop, skip, include)
            fast = IncrementalDetokenizer(tok, prompt, stop, skip, include, memo_one, memo_pairs)
            for t in _stream(rng, tok.vocab_size):
                assert fast.add(t) == ref.add(t), (name, trial)
                assert (fast.text, fast.stop_matched) == (ref.text, ref.stop_matched)
                assert fast.take_delta(False) == ref.take_delta(False)
                if ref.stop_matched is not None:
                    break
            fast.flush()
            ref.flush()
            assert fast.text == ref.text
            assert fast.take(True) == (ref.take_delta(True), ref.emitted_text)
        assert 0 < len(memo_pairs) <= 500
        for key, got in memo_pairs.items():  # each entry is what its key says
            run = [key >> 32, key & 0xFFFF_FFFF]
            assert got == _appends(tok, run, 1, skip), (name, key)


def _appends(tok: Any, run: list[int], w: int, skip: bool) -> str | None:
    """By definition: what ``run`` adds to the text of its first ``w`` tokens."""
    full = tok.decode(run, skip_special_tokens=skip)
    prev = tok.decode(run[:w], skip_special_tokens=skip)
    return None if len(full) <= len(prev) or full.endswith("\ufffd") else full[len(prev) :]
