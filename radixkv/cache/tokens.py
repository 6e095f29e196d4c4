"""Normalising and validating token inputs into the cache's compact key encoding.

The cache stores every key as ``bytes`` holding native int64 token ids (8 bytes a token), so
keys are compared with one ``memcmp`` (``bytes.startswith``) and sliced without per-token
Python objects. Token ids must lie in ``[0, 2**32)``: they are hashed as uint32 for KV-event
compatibility (see hashing.py), and no tokenizer has more ids than that.

Accepted inputs: ``array('q')`` (the fast path: one copy, one vectorised range check),
``list``/``tuple`` of ints, any other ``array.array`` of integers, 1-D integer numpy arrays and
1-D integer torch tensors. torch is never imported here: tensors are recognised duck-typed by
their module name. Everything else (floats, bools arrays, 2-D input, strings, bytes) raises
TypeError/ValueError naming the problem.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import numpy as np

TOKEN_BYTES = 8  # bytes per token in a key (native int64)
TOKEN_SHIFT = 3  # log2(TOKEN_BYTES): byte offsets >> TOKEN_SHIFT are token counts
MAX_TOKEN_ID = 2**32 - 1
# A token id is in [0, 2**32) exactly when the high 32-bit half of its int64 is zero (negative
# ids have it all ones). Up to SHORT_CHECK bytes, one strided memoryview of those halves
# compared with zeros (no copy, no allocation of the data) beats a numpy call's fixed cost:
#     key.cast("I")[(start >> 2) + HIGH_HALF :: 2] == ZEROS_BY_LEN[(len(key) - start) >> 3]
# for a key (byte view) checked from byte offset ``start`` (a token boundary). RadixCache's hot
# paths inline that line; check_range is the reference and raises.
SHORT_CHECK = 8192  # bytes (1,024 tokens)
HIGH_HALF = 1 if sys.byteorder == "little" else 0  # index of the high uint32 of a token's two
ZERO_HALVES = memoryview(bytes(SHORT_CHECK // 2)).cast("I")
# ZEROS_BY_LEN[n]: n zero halves, the other side of that compare for an n-token key (a list
# lookup instead of slicing a view on every check)
ZEROS_BY_LEN: list[memoryview] = [ZERO_HALVES[:n] for n in range(SHORT_CHECK // 8 + 1)]


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
    if a.size:
        if kind == "i" and int(a.min()) < 0:
            raise ValueError(f"{what} must be non-negative, got {int(a.min())}")
        if int(a.max()) > MAX_TOKEN_ID:
            raise ValueError(f"{what} must be < 2**32, got {int(a.max())}")
    return a.astype(np.int64, copy=False).tobytes()


def to_token_bytes(tokens: Any, what: str = "tokens") -> bytes:
    """Return ``tokens`` as the compact key encoding (native int64 bytes), validated.

    Raises TypeError for non-integer input and ValueError for negative ids, ids >= 2**32 or
    input that is not one-dimensional. The input is never mutated.
    """
    key = encode_tokens(tokens, what)
    check_range(key, 0, what)
    return bytes(key)


def check_range(key: bytes | memoryview, start: int = 0, what: str = "tokens") -> None:
    """ValueError unless every token of ``key[start:]`` (a byte offset) is in [0, 2**32)."""
    n = len(key) - start
    if n <= 0:
        return
    if n <= SHORT_CHECK:
        ok = memoryview(key).cast("I")[(start >> 2) + HIGH_HALF :: 2] == ZEROS_BY_LEN[n >> 3]
    else:  # one vectorised pass: negative ids wrap to huge uint64 values. argmax, not max: a
        # plain C loop without the ufunc reduction's setup (about 2 us less on a cold cache)
        ids = np.frombuffer(key, np.uint64, offset=start)
        ok = ids.item(ids.argmax()) <= MAX_TOKEN_ID
    if not ok:
        _from_numpy(np.frombuffer(key, np.int64, offset=start), what)  # raises


def encode_tokens(tokens: Any, what: str = "tokens") -> memoryview:
    """The key encoding of ``tokens`` with types and shape checked but, for ``array('q')``,
    lists and tuples, the id *range* not yet checked: callers must ``check_range`` every part
    they store and do not prove valid otherwise (insert skips the part that equals a stored
    key, validated when it was inserted; lookups store nothing and check nothing).

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
            raise ValueError(f"{what} must be < 2**32: {e}") from None
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
