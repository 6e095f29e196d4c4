"""Page hashes: the trie's child-lookup hash, and KV-event hashes compatible with NVIDIA Dynamo.

Two different hashes live here:

* ``default_hash_fn(page_key) -> int``: a child-lookup hash (XXH3-64) one may give the trie as
  ``RadixCache(..., hash_fn=...)``. It sees one page in the cache's key encoding (native int64
  bytes). Any function of those bytes works, even a constant (collision safety is part of
  RadixCache's contract). Without one the trie keys each child by its first page's bytes
  themselves (exact, and cheaper than a Python-level hash call).

* ``page_hashes(tokens, page_size, namespace)``: per-page *chained* hashes published in
  ``BlockStored``/``BlockRemoved`` events. They follow Dynamo's KV-router scheme: the local hash
  of a page is XXH3-64 (seed 1337) of its token ids as little-endian uint32 bytes; the sequence
  hash of page 0 is its local hash and the sequence hash of page i is XXH3-64 (seed 1337) of
  the two little-endian uint64s ``[sequence_hash(i - 1), local_hash(i)]``. A sequence hash thus
  names the whole prefix up to and including that page. Token ids are int64 in the cache: a
  page with an id outside ``[0, 2**32)`` has a local hash of its int64 bytes instead (seed
  WIDE_SEED), never the uint32 one of the wrapped ids. When ``namespace`` is not None the
  chain starts from ``namespace_hash(namespace)`` as if it were a parent page, so two tenants
  never publish the same hash for the same tokens (Dynamo mixes its cache namespace into a
  seed instead; with ``namespace=None`` the hashes are Dynamo's exactly).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from radixkv.cache.tokens import TOKEN_BYTES, to_token_bytes

DYNAMO_SEED = 1337
# The local hash of a page with an id outside [0, 2**32) (see local_hashes_of_key): another
# seed, over other bytes, so that it is not the hash Dynamo gives any page of uint32 ids.
WIDE_SEED = 0x5261_6469_784B_5600  # "RadixKV\0"
HashFn = Callable[[bytes], int]

_xxh3 = xxhash.xxh3_64_intdigest
_pack2 = struct.Struct("<QQ").pack


# A child-lookup hash of one page (key encoding): XXH3-64, seed 0, called straight from C.
# Collisions are safe, only slower. (Not the trie's default: see the module docstring.)
default_hash_fn: HashFn = xxhash.xxh3_64_intdigest


def namespace_bytes(namespace: Any) -> bytes:
    """A namespace as stable bytes (str, bytes, int, or anything with a stable repr); the
    input of ``namespace_hash`` and of the storage tier's prefix digests."""
    if isinstance(namespace, bytes):
        return b"b:" + namespace
    if isinstance(namespace, str):
        return b"s:" + namespace.encode("utf-8")
    return b"r:" + repr(namespace).encode("utf-8")


def namespace_hash(namespace: Any) -> int:
    """Stable 64-bit hash of a namespace (str, bytes, int, or anything with a stable repr)."""
    return _xxh3(namespace_bytes(namespace), DYNAMO_SEED)


def local_hashes_of_key(key: bytes, page_size: int) -> list[int]:
    """Dynamo local block hash of every whole page of ``key`` (key encoding bytes).

    A page holding an id outside ``[0, 2**32)`` (no Dynamo router sends one) is hashed from its
    int64 bytes with WIDE_SEED instead: reading it as uint32 would wrap the id and give the
    hash of another page's tokens.
    """
    ids = np.frombuffer(key, np.int64)
    ids = ids[: len(ids) // page_size * page_size]
    u32 = ids.astype("<u4").tobytes()
    step = 4 * page_size
    out = [_xxh3(u32[i : i + step], DYNAMO_SEED) for i in range(0, len(u32), step)]
    wide = ids >> 32  # 0 exactly for the ids in [0, 2**32)
    if wide.any():
        step = TOKEN_BYTES * page_size
        for i in np.flatnonzero(wide.reshape(-1, page_size).any(axis=1)).tolist():
            out[i] = _xxh3(key[i * step : (i + 1) * step], WIDE_SEED)
    return out


def chain_hashes(parent: int | None, local: list[int]) -> list[int]:
    """Sequence hashes of ``local`` block hashes following a parent sequence hash (or none)."""
    out: list[int] = []
    prev = parent
    for h in local:
        prev = h if prev is None else _xxh3(_pack2(prev, h), DYNAMO_SEED)
        out.append(prev)
    return out


def chain_start(namespace: Any) -> int | None:
    """The parent hash the first page of a namespace chains from (None: no namespace)."""
    return None if namespace is None else namespace_hash(namespace)


def page_hashes(tokens: Any, page_size: int, namespace: Any = None) -> list[int]:
    """Chained hash of every whole page of ``tokens`` (a trailing partial page is ignored).

    ``page_hashes(t, ps)[i]`` names the prefix ``t[: (i + 1) * ps]`` under ``namespace``; it is
    what a cache publishes for that page in ``BlockStored``/``BlockRemoved`` events.
    """
    if type(page_size) is not int or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    key = to_token_bytes(tokens)
    whole = len(key) // (TOKEN_BYTES * page_size) * TOKEN_BYTES * page_size
    return chain_hashes(chain_start(namespace), local_hashes_of_key(key[:whole], page_size))
