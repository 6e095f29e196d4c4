"""Normalising and validating token inputs into the cache's compact key encoding.

The cache stores every key as ``bytes`` holding native int64 token ids (8 bytes a token), so
keys are compared with one ``memcmp`` (``bytes.startswith``) and sliced without per-token
Python objects. A token id is any int64, as in SGLang's and vLLM's caches: the trie compares
ids, it never interprets them. (The engine checks prompts against the model's vocabulary where
they enter; page hashes read ids in ``[0, 2**32)`` as Dynamo's uint32 and hash a page holding
any other id from its int64 bytes, see hashing.py, so no id needs refusing here.)

Accepted inputs: ``array('q')`` (the fast path: read in place, no copy, no check),
``list``/``tuple`` of ints, any other ``array.array`` of integers, 1-D integer numpy arrays and
1-D integer torch tensors. torch is never imported here: tensors are recognised duck-typed by
their module name. Everything else (floats, bools arrays, 2-D input, strings, bytes, ids that
do not fit in an int64) raises TypeError/ValueError naming the problem.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

TOKEN_BYTES = 8  # bytes per token in a key (native int64)
TOKEN_SHIFT = 3  # log2(TOKEN_BYTES): byte offsets >> TOKEN_SHIFT are token counts
INT64_MAX = 2**63 - 1


def _is_torch_tensor(obj: object) -> bool:
    module = type(obj).__module__
    return module.startswith("torch") and hasattr(obj, "detach") and hasattr(obj, "dim")


def _from_numpy(a: np.ndarray, what: str) -> bytes:
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got an array of shape {tuple(a.shape)}")
    kind = a.dtype.kind
    if kind == "b":
        raise TypeError(f"{what} must be integer token ids, got a bool array")
    if kind not in "iu":
        raise TypeError(f"{what} must be integer token ids, got dtype {a.dtype}")
    if kind == "u" and a.dtype.itemsize == 8 and a.size and int(a.max()) > INT64_MAX:
        raise ValueError(f"{what} must fit in an int64 (< 2**63), got {int(a.max())}")
    return a.astype(np.int64, copy=False).tobytes()


def to_token_bytes(tokens: Any, what: str = "tokens") -> bytes:
    """Return ``tokens`` as the compact key encoding (native int64 bytes), validated.

    Raises TypeError for non-integer input and ValueError for ids that do not fit in an int64
    or input that is not one-dimensional. The input is never mutated.
    """
    return bytes(encode_tokens(tokens, what))


def encode_tokens(tokens: Any, what: str = "tokens") -> memoryview:
    """The key encoding of ``tokens``, types, shape and the int64 range checked.

    The result is a byte ``memoryview`` (slicing it copies nothing). An ``array('q')`` is not
    copied: the view reads it in place, and the caller must drop (or ``release()``) the view
    before returning, so the array can be resized again.
    """
    return memoryview(_encode(tokens, what))


def _encode(tokens: Any, what: str) -> bytes | memoryview:
    if type(tokens) is array and tokens.typecode == "q":
        return memoryview(tokens).cast("B").toreadonly()
    if isinstance(tokens, list | tuple):
        if not tokens:
            return b""
        try:
            return memoryview(array("q", tokens)).cast("B").toreadonly()
        except TypeError as e:
            raise TypeError(f"{what} must be a flat sequence of ints: {e}") from None
        except OverflowError as e:
            raise ValueError(f"{what} must fit in an int64 (-2**63 <= id < 2**63): {e}") from None
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise TypeError(f"{what} must be a sequence of token ids, got {type(tokens).__name__}")
    if isinstance(tokens, np.ndarray):
        return _from_numpy(tokens, what)
    if _is_torch_tensor(tokens):
        if tokens.dim() != 1:
            raise ValueError(f"{what} must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"{what} must be an integer tensor, got {tokens.dtype}")
        return _from_numpy(tokens.detach().cpu().numpy(), what)
    if isinstance(tokens, array):
        if tokens.typecode in "fduw":
            raise TypeError(f"{what} must be integer token ids, got array('{tokens.typecode}')")
        return _from_numpy(np.asarray(tokens), what)
    try:
        n = len(tokens)
    except TypeError:
        raise TypeError(
            f"{what} must be a sequence of token ids, got {type(tokens).__name__}"
        ) from None
    if n == 0:
        return b""
    a = np.asarray(tokens)
    if a.dtype == object:
        raise TypeError(f"{what} must be a flat sequence of ints")
    return _from_numpy(a, what)


def key_to_list(key: bytes) -> list[int]:
    """Decode a key (native int64 bytes) into a list of token ids."""
    return memoryview(key).cast("q").tolist()
