"""What the storage tier stores: one object per KV page, its key, and its self-checking layout.

Keys. A page's key names the KV format, the namespace and the prefix the page ends::

    key = hex(BLAKE2b-128(format id || namespace_hash || chained page hash))

where the chained page hash is the XXH3-64 chain of radixkv/cache/hashing.py (the hash KV
events publish for the page) and the format id (``kv_format_id``) digests the model and the
page layout: model fingerprint, dtype, page size, layer count, KV head count, head dim. So a
different model, dtype, page size or tenant never even looks at another's objects, and a key
is a one-way digest: it does not reveal token ids (see docs/security.md for what it does not
hide).

Objects. A 64-byte header, then the page's K/V bytes (every layer, K then V, as the host tier
holds a page)::

    magic "RKVP" | version u16 | reserved u16 | format id (16) | prefix digest (16)
    | payload length u64 | MAC (16) | payload

The MAC (HMAC-SHA256, truncated to 128 bits, keyed with the deployment's storage secret,
secret.py) covers the storage key, the header fields before it (the format id and the prefix
digest, which digests the namespace and every token) and the payload. It catches a corrupt or
truncated object, and a forged one: whoever can write the storage but does not hold the
secret cannot make an object that passes, so they cannot put KV into anyone's answers (a
plain checksum could be recomputed by them). A mismatch is a miss and the caller deletes the
object. Version 1 objects (an unkeyed XXH3-128 checksum) fail as corrupt and are replaced.

The prefix digest is a BLAKE2b-128
chain over the namespace and *every token* of the prefix (``prefix_digests``); a reader checks
it against its own tokens, so a page found under a colliding key (XXH3 is fast, not
collision-resistant: collisions can be engineered) is a miss, never KV computed from other
tokens. This keeps the cache's contract that tokens decide, not hashes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

from radixkv.cache.hashing import (
    chain_hashes,
    chain_start,
    local_hashes_of_key,
    namespace_bytes,
    namespace_hash,
)
from radixkv.cache.tokens import TOKEN_BYTES

__all__ = [
    "HEADER_BYTES",
    "FormatMismatch",
    "ObjectCorrupt",
    "decode_page",
    "encode_page",
    "kv_format_id",
    "page_keys",
    "prefix_digests",
]

MAGIC = b"RKVP"
VERSION = 2  # 1: an unkeyed XXH3-128 checksum instead of the MAC
_HEAD = struct.Struct("<4sHH16s16sQ")  # magic, version, reserved, format id, digest, length
HEADER_BYTES = _HEAD.size + 16  # + MAC: 64
DIGEST_BYTES = 16


class ObjectCorrupt(ValueError):
    """A stored object failed its checks (bad magic, truncated, checksum): delete it."""


class FormatMismatch(ValueError):
    """A well-formed object of another KV format or prefix (a key collision): a plain miss."""


def kv_format_id(
    model_fingerprint: bytes | str,
    dtype: str,
    page_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
) -> bytes:
    """16 bytes naming a KV page format: two engines share stored pages only when equal.

    ``model_fingerprint`` should change whenever the weights change (the engine hashes the
    model config and samples of every weight tensor, radixkv.model.loader.model_fingerprint);
    ``dtype`` is the KV dtype's name ("torch.bfloat16").
    """
    fp = model_fingerprint.encode() if isinstance(model_fingerprint, str) else model_fingerprint
    text = f"{dtype}|{page_size}|{num_layers}|{num_kv_heads}|{head_dim}|".encode()
    return hashlib.blake2b(text + fp, digest_size=16, person=b"radixkv-format").digest()


def page_keys(
    format_id: bytes, namespace: Any, key_bytes: bytes, page_size: int, start: int = 0
) -> list[str]:
    """Storage keys of the whole pages ``start..`` of ``key_bytes`` (tokens in the cache's key
    encoding, from the first token of the sequence) under ``namespace``."""
    chain = chain_hashes(chain_start(namespace), local_hashes_of_key(key_bytes, page_size))
    ns = namespace_hash(namespace).to_bytes(8, "little")
    base = hashlib.blake2b(format_id + ns, digest_size=16, person=b"radixkv-kvpage")
    out = []
    for h in chain[start:]:
        b = base.copy()
        b.update(h.to_bytes(8, "little"))
        out.append(b.hexdigest())
    return out


def prefix_digests(
    format_id: bytes, namespace: Any, key_bytes: bytes, page_size: int, start: int = 0
) -> list[bytes]:
    """The BLAKE2b-128 chain over the namespace and every token: entry ``i`` digests the prefix
    ending with page ``i`` (whole pages only; the first ``start`` entries are not returned)."""
    pb = page_size * TOKEN_BYTES
    d = hashlib.blake2b(
        format_id + namespace_bytes(namespace), digest_size=DIGEST_BYTES, person=b"radixkv-prefix"
    ).digest()
    out = []
    for i in range(len(key_bytes) // pb):
        d = hashlib.blake2b(
            d + key_bytes[i * pb : (i + 1) * pb], digest_size=DIGEST_BYTES, person=b"radixkv-prefix"
        ).digest()
        if i >= start:
            out.append(d)
    return out


def _mac(secret: bytes, key: str, head: bytes, payload: bytes | memoryview) -> bytes:
    h = hmac.new(secret, key.encode("ascii") + head, hashlib.sha256)
    h.update(payload)
    return h.digest()[:16]


def encode_page(
    format_id: bytes, digest: bytes, payload: bytes | memoryview, *, key: str, secret: bytes
) -> bytes:
    """The object stored under ``key``: header + ``payload`` (a page's K/V bytes), MAC'd with
    ``secret`` (the deployment's storage secret)."""
    head = _HEAD.pack(MAGIC, VERSION, 0, format_id, digest, len(payload))
    return b"".join((head, _mac(secret, key, head, payload), payload))


def decode_page(
    data: bytes,
    format_id: bytes,
    digest: bytes,
    payload_bytes: int,
    *,
    key: str,
    secret: bytes,
) -> memoryview:
    """The payload of the object read under ``key``, checked: ObjectCorrupt when it is damaged
    or forged (wrong magic or version, truncated or padded, MAC not ``secret``'s over this key,
    header and payload), FormatMismatch when it is sound but of another format or prefix, or
    not ``payload_bytes`` long (a key collision: another page's object)."""
    if len(data) < HEADER_BYTES:
        raise ObjectCorrupt(f"object of {len(data)} bytes is shorter than its header")
    head = bytes(data[: _HEAD.size])
    magic, version, _, fmt, dig, length = _HEAD.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ObjectCorrupt(f"not a radixkv page object (magic {magic!r}, version {version})")
    if len(data) != HEADER_BYTES + length:
        raise ObjectCorrupt(f"object is {len(data)} bytes, its header says {HEADER_BYTES + length}")
    payload = memoryview(data)[HEADER_BYTES:]
    if not hmac.compare_digest(
        _mac(secret, key, head, payload), bytes(data[_HEAD.size : HEADER_BYTES])
    ):
        raise ObjectCorrupt("MAC mismatch (damaged, forged, or written with another secret)")
    if fmt != format_id or dig != digest or length != payload_bytes:
        raise FormatMismatch("object of another KV format or prefix under this key")
    return payload
