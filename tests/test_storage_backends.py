"""The storage tier's torch-free part: page objects and keys, URL parsing, the directory backend
(atomic writes, checksums, LRU quota, two processes, faults), PageStore's chain lookups, and the
Redis backend against a real Valkey server (storage_helpers.ValkeyProcess)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from storage_helpers import ValkeyProcess

from radixkv.cache.hashing import page_hashes
from radixkv.cache.storage import (
    FileStorage,
    KnownKeys,
    PageStore,
    RedisStorage,
    StorageError,
    kv_format_id,
    open_storage,
    page_keys,
    prefix_digests,
)
from radixkv.cache.storage.page_format import (
    HEADER_BYTES,
    FormatMismatch,
    ObjectCorrupt,
    decode_page,
    encode_page,
)

FMT = kv_format_id(b"model-a", "torch.float32", 4, 2, 2, 8)
SECRET = bytes(range(32))
K = "ab" * 16  # a storage key
ROOT = Path(__file__).resolve().parents[1]


def key_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


@pytest.fixture(scope="module")
def valkey() -> Any:
    server = ValkeyProcess()
    yield server
    server.stop()


# ---------------------------------------------------------------------- objects and keys
def test_page_object_round_trip_and_every_damage_is_detected() -> None:
    digest = prefix_digests(FMT, None, key_bytes([1, 2, 3, 4]), 4)[0]
    payload = os.urandom(256)
    obj = encode_page(FMT, digest, payload, key=K, secret=SECRET)
    assert len(obj) == HEADER_BYTES + len(payload)
    assert bytes(decode_page(obj, FMT, digest, 256, key=K, secret=SECRET)) == payload
    flipped = bytearray(obj)
    flipped[HEADER_BYTES + 100] ^= 1  # one bit of KV
    for bad in (bytes(flipped), obj[:-1], obj + b"x", obj[:10], b"NOPE" + obj[4:]):
        with pytest.raises(ObjectCorrupt):
            decode_page(bad, FMT, digest, 256, key=K, secret=SECRET)
    other_fmt = kv_format_id(b"model-b", "torch.float32", 4, 2, 2, 8)
    other_digest = prefix_digests(FMT, None, key_bytes([1, 2, 3, 5]), 4)[0]
    for fmt, dig, size in ((other_fmt, digest, 256), (FMT, other_digest, 256), (FMT, digest, 128)):
        with pytest.raises(FormatMismatch):
            decode_page(obj, fmt, dig, size, key=K, secret=SECRET)


def test_keys_name_format_namespace_and_whole_prefix_without_revealing_tokens() -> None:
    toks = key_bytes(list(range(12)))
    base = page_keys(FMT, None, toks, 4)
    assert len(base) == 3 and all(len(k) == 32 and int(k, 16) >= 0 for k in base)
    assert len(set(base)) == 3
    assert page_keys(FMT, None, toks, 4, start=1) == base[1:]
    # tenant, format and every earlier token change a key; the same inputs give the same key
    assert set(page_keys(FMT, "tenant-b", toks, 4)).isdisjoint(base)
    assert set(
        page_keys(kv_format_id(b"m", "torch.bfloat16", 4, 2, 2, 8), None, toks, 4)
    ).isdisjoint(base)
    changed = key_bytes([99, *range(1, 12)])
    assert set(page_keys(FMT, None, changed, 4)).isdisjoint(base)
    assert page_keys(FMT, None, toks, 4) == base
    # a key is a keyed digest, not the (public, Dynamo-compatible) chained page hash itself
    chain = page_hashes(list(range(12)), 4)
    for k, h in zip(base, chain):
        assert k != f"{h:032x}" and f"{h:x}" not in k
    # digests chain over every token (a collision of the 64-bit chain cannot match them)
    d = prefix_digests(FMT, None, toks, 4)
    assert d[1:] == prefix_digests(FMT, None, toks, 4, start=1) and len(set(d)) == 3
    assert prefix_digests(FMT, "t", toks, 4)[0] != d[0]


def test_open_storage_urls(tmp_path: Path) -> None:
    fs = open_storage(f"file://{tmp_path}/kv?quota=2MiB")
    assert isinstance(fs, FileStorage) and fs.quota_bytes == 2 << 20
    assert fs.root == tmp_path / "kv"
    plain = open_storage(str(tmp_path / "plain"))
    assert isinstance(plain, FileStorage) and plain.quota_bytes is None
    r = open_storage("redis://user:secret@127.0.0.1:1/0?ttl=60")
    assert isinstance(r, RedisStorage) and r.ttl == 60 and "secret" not in r.url
    assert isinstance(open_storage("valkey://127.0.0.1:1/2"), RedisStorage)
    for bad, words in [
        ("", "non-empty"),
        ("s3://bucket/x", "unknown scheme"),
        (f"file://{tmp_path}?quota=lots", "quota"),
        (f"file://{tmp_path}?size=1", "unknown option"),
        ("file://otherhost/x", "local path"),
        ("redis://127.0.0.1:1/0?ttl=soon", "ttl"),
        ("redis://127.0.0.1:1/0?ttl=0", "ttl"),
    ]:
        with pytest.raises(ValueError, match=words):
            open_storage(bad)


# ---------------------------------------------------------------------- directory backend
def test_file_storage_round_trip_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "kv")
    assert fs.get_many(["ab" * 16]) == [None]  # nothing yet, not even the folder
    fs.put_many([("ab" * 16, b"one"), ("cd" * 16, b"two")])
    fs.put_many([("ab" * 16, b"three")])  # replaces
    assert fs.get_many(["ab" * 16, "cd" * 16, "ef" * 16]) == [b"three", b"two", None]
    files = sorted(p.name for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert files == sorted(["ab" * 16, "cd" * 16])  # no temp file left behind
    fs.delete(["ab" * 16, "00" * 16])
    assert fs.get_many(["ab" * 16]) == [None]
    with pytest.raises(ValueError, match="hex"):
        fs.put_many([("../escape", b"x")])


def test_file_storage_quota_deletes_least_recently_used(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, quota_bytes=10_000)
    keys = [f"{i:02x}" * 16 for i in range(8)]
    for i, k in enumerate(keys):  # 8 x 1,000 bytes: under the quota
        fs.put_many([(k, bytes(1000))])
        os.utime(fs._path(k), (1000 + i, 1000 + i))  # oldest first, without sleeping
    fs.get_many([keys[0]])  # a read makes keys[0] the most recently used
    assert os.stat(fs._path(keys[0])).st_mtime > 2000
    fs.put_many([(f"{i:02x}" * 16, bytes(1000)) for i in range(8, 11)])  # 11,000 > quota
    left = {k for k in keys + [f"{i:02x}" * 16 for i in range(8, 11)] if fs.get_many([k])[0]}
    assert fs.usage_bytes() <= 9_000  # down to 90% of the quota
    assert keys[0] in left and keys[1] not in left and keys[2] not in left
    assert fs.evicted_objects == 2 and fs.evicted_bytes == 2000


_WRITER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    from radixkv.cache.storage import FileStorage
    from radixkv.cache.storage.page_format import encode_page
    fs = FileStorage({path!r}, quota_bytes=60_000)
    tag = int(sys.argv[1])
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        for k in range(20):
            key = f"{{k:02x}}" * 16
            obj = encode_page(bytes(16), bytes(16), bytes([tag]) * 4000, key=key, secret=bytes(16))
            fs.put_many([(key, obj)])
    """
)


def test_two_processes_share_a_directory_without_partial_reads(tmp_path: Path) -> None:
    """Two writer processes replace the same 20 objects (and sweep a quota smaller than them
    all) for a second while this process reads: every read is absent or a whole, valid object."""
    code = _WRITER.format(root=str(ROOT), path=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(t)]) for t in (1, 2)]
    fs = FileStorage(tmp_path)
    seen: set[int] = set()
    reads = 0
    while any(p.poll() is None for p in procs):
        keys = [f"{k:02x}" * 16 for k in range(20)]
        for key, data in zip(keys, fs.get_many(keys), strict=True):
            if data is not None:
                payload = decode_page(data, bytes(16), bytes(16), 4000, key=key, secret=bytes(16))
                assert len(set(payload)) == 1  # one writer's bytes, never a mix or a torn file
                seen.add(payload[0])
                reads += 1
        time.sleep(0.001)
    assert [p.wait() for p in procs] == [0, 0]
    assert seen == {1, 2} and reads > 0
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]  # no temp files left
    assert fs.usage_bytes() <= 60_000


def test_file_storage_faults_are_storage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = FileStorage(tmp_path)
    real_write = os.write
    monkeypatch.setattr(
        os,
        "write",
        lambda fd, b: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")),
    )
    with pytest.raises(StorageError) as e:
        fs.put_many([("aa" * 16, b"x" * 100)])
    assert e.value.kind == "full"
    monkeypatch.setattr(os, "write", real_write)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # the temp file went
    real_open = os.open
    monkeypatch.setattr(
        os,
        "open",
        lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")),
    )
    with pytest.raises(StorageError) as e:
        fs.put_many([("aa" * 16, b"x")])
    assert e.value.kind == "permission"
    monkeypatch.setattr(os, "open", real_open)
    fs.put_many([("aa" * 16, b"x")])
    monkeypatch.setattr(
        os,
        "open",
        lambda *a, **k: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied")),
    )
    with pytest.raises(StorageError) as e:
        fs.get_many(["aa" * 16])
    assert e.value.kind == "permission"
    blocked = FileStorage(tmp_path / "aa" / ("aa" * 16))  # a file where the folder should be
    monkeypatch.undo()
    with pytest.raises(StorageError) as e:
        blocked.put_many([("bb" * 16, b"x")])
    assert e.value.kind == "io"


# ---------------------------------------------------------------------- PageStore
def _store(backend: Any, payload_bytes: int = 64) -> PageStore:
    return PageStore(backend, FMT, 4, payload_bytes, KnownKeys(), secret=SECRET)


def test_page_store_follows_the_chain_and_stops_at_the_first_miss(tmp_path: Path) -> None:
    store = _store(FileStorage(tmp_path))
    toks = key_bytes(list(range(100, 124)))  # 6 pages
    pages = [bytes([i]) * 64 for i in range(6)]
    assert store.store("t", toks[: 4 * 32], pages[:4]) == 4
    assert store.store("t", toks[: 4 * 32], pages[2:4]) == 0  # known: skipped
    assert store.skipped_known == 2
    got = store.fetch("t", toks, 0, 6)
    assert [bytes(p) for p in got] == pages[:4]  # pages 4 and 5 were never stored
    assert [bytes(p) for p in store.fetch("t", toks, 2, 6)] == pages[2:4]
    assert store.fetch("u", toks, 0, 6) == []  # another namespace sees nothing
    other = key_bytes([7, *range(101, 124)])  # another first token: another chain
    assert store.fetch("t", other, 0, 6) == []
    # a gap in the chain stops the lookup there, even though later pages exist
    store.backend.delete([page_keys(FMT, "t", toks, 4)[1]])
    assert [bytes(p) for p in store.fetch("t", toks, 0, 6)] == pages[:1]
    assert store.fetch("t", toks, 0, 6, deadline=time.monotonic() - 1) == []


def test_page_store_deletes_corrupt_objects_and_misses_foreign_ones(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    store = _store(fs)
    toks = key_bytes(list(range(8)))
    store.store(None, toks, [b"a" * 64, b"b" * 64])
    k0, k1 = page_keys(FMT, None, toks, 4)
    with open(fs._path(k1), "r+b") as f:  # a torn write: the last bytes missing
        f.truncate(HEADER_BYTES + 10)
    assert [bytes(p) for p in store.fetch(None, toks, 0, 2)] == [b"a" * 64]
    assert store.corrupt_objects == 1 and fs.get_many([k1]) == [None]  # deleted
    # a sound object of another prefix under the key (a forced collision): a miss, kept
    alien = encode_page(FMT, b"\0" * 16, b"z" * 64, key=k0, secret=SECRET)
    fs.put_many([(k0, alien)])
    assert store.fetch(None, toks, 0, 2) == []
    assert store.mismatched_objects == 1 and fs.get_many([k0]) == [alien]


# ---------------------------------------------------------------------- Redis / Valkey
def test_redis_backend_round_trip_ttl_and_batches(valkey: ValkeyProcess) -> None:
    r = open_storage(valkey.url + "?ttl=100")
    keys = [f"{i:032x}" for i in range(40)]  # more than one MGET / pipeline batch
    r.put_many([(k, bytes([i]) * 10) for i, k in enumerate(keys)])
    got = r.get_many([*keys, "f" * 32])
    assert got[:40] == [bytes([i]) * 10 for i in range(40)] and got[40] is None
    assert 0 < valkey.client.ttl("radixkv:kv:" + keys[0]) <= 100
    r.delete(keys[:2])
    assert r.get_many(keys[:3])[:2] == [None, None]
    store = _store(r)
    toks = key_bytes(list(range(8)))
    store.store("x", toks, [b"p" * 64, b"q" * 64])
    assert [bytes(p) for p in _store(r).fetch("x", toks, 0, 2)] == [b"p" * 64, b"q" * 64]
    r.close()


def test_redis_backend_errors_name_their_cause(valkey: ValkeyProcess) -> None:
    down = RedisStorage(
        f"redis://127.0.0.1:{valkey.port + 1 if valkey.port < 65535 else 1}/0", timeout=0.2
    )
    with pytest.raises(StorageError) as e:
        down.get_many(["a" * 32])
    assert e.value.kind in ("unreachable", "timeout")
    valkey.client.config_set("maxmemory", "1mb")
    valkey.client.config_set("maxmemory-policy", "noeviction")
    try:
        r = RedisStorage(valkey.url)
        with pytest.raises(StorageError) as e:
            r.put_many([(f"{i:032x}", bytes(200_000)) for i in range(20)])
        assert e.value.kind == "full"
    finally:
        valkey.client.flushall()
        valkey.client.config_set("maxmemory", "0")
