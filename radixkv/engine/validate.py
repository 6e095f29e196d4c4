"""Prompt validation: text or token ids in, a checked list of token ids out."""

from __future__ import annotations

from collections.abc import Iterable
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


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (text or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, list | tuple):
        prompts = prompts.tolist()
    if not isinstance(prompts, Iterable):
        raise TypeError(
            "prompts must be a string, a list of strings or of token-id lists, "
            f"got {type(prompts).__name__}"
        )
    plist = list(prompts)
    if not plist:
        raise ValueError("prompts is empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in plist):
        return [plist]  # one tokenised prompt
    return plist
