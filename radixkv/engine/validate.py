"""Prompt validation: text or token ids in, a checked list of token ids out."""

from __future__ import annotations

from typing import Any


def normalise_prompt(prompt: Any, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """Returns ``(text or None, token ids)``.

    Raises:
        ValueError: empty prompt, a token id outside ``[0, vocab_size)``, a non-integer id.
        TypeError: a prompt that is neither text nor a sequence of ints.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        return prompt, list(ids)
    if hasattr(prompt, "tolist") and not isinstance(prompt, list | tuple):
        prompt = prompt.tolist()  # numpy array / torch tensor
    if not isinstance(prompt, list | tuple):
        raise TypeError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not prompt:
        raise ValueError("prompt is empty")
    ids = []
    for i, t in enumerate(prompt):
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"prompt token {i} is not an int: {t!r}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} = {t} is outside the vocabulary [0, {vocab_size})")
        ids.append(t)
    return None, ids
