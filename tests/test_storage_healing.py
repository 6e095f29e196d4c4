"""Storage that heals and cannot be forged (issue 47, findings 4 to 6), on the directory backend
and on a real valkey-server (storage_helpers.ValkeyProcess):

* after the store lost data (a restart, a flush, eviction), one request that computes the
  prefix writes it back whole, not one page per request;
* a failed write (disk full, a read-only mount, a server out of memory) stops writes only:
  lookups go on finding what is stored;
* a directory or symlink where a page file belongs is a miss, removed and counted, never an
  outage and never followed;
* a page object rewritten by someone without the deployment secret (even with its checksum
  recomputed) is a miss, counted as corrupt and deleted; the secret is generated once, mode
  0600, and never logged.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from storage_helpers import ValkeyProcess, free_port

from radixkv.cache.storage import (
    FileStorage,
    KnownKeys,
    PageStore,
    RedisStorage,
    StorageBackend,
    kv_format_id,
    load_storage_secret,
    page_keys,
    prefix_digests,
)
from radixkv.cache.storage.page_format import HEADER_BYTES, encode_page
from radixkv.cache.storage.redis_backend import KEY_PREFIX
from radixkv.cache.storage.secret import ENV_SECRET
from radixkv.engine.config import EngineConfig
from radixkv.engine.storage_tier import StorageIO
from radixkv.kv.host_pool import HostKVPool

SECRET = bytes(range(100, 132))
HOST = dict(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)
FMT = kv_format_id(b"model-heal", "torch.float32", 4, 2, 2, 8)
PER_PAGE = 2 * 2 * 4 * 2 * 8 * 4  # layers x (K, V) x tokens x heads x dim x float32


def key_bytes(tokens: range | list[int]) -> bytes:
    return np.asarray(list(tokens), dtype=np.int64).tobytes()


TOKS = key_bytes(range(1000, 1032))  # eight pages of four tokens
PAGES = [bytes([i + 1]) * PER_PAGE for i in range(8)]
KEYS = page_keys(FMT, "t", TOKS, 4)


@pytest.fixture(scope="module")
def valkey() -> Any:
    server = ValkeyProcess()
    yield server
    server.stop()


class Store:
    """One backend under test, with what a test does to it from outside the engine."""

    def __init__(self, kind: str, tmp_path: Path, valkey: ValkeyProcess | None) -> None:
        self.kind = kind
        self.valkey = valkey
        self.root = tmp_path / "kv"
        if valkey is not None:
            valkey.client.flushall()
        self.backend: StorageBackend = (
            FileStorage(self.root) if valkey is None else RedisStorage(valkey.url)
        )

    def wipe(self) -> None:
        """Every object gone (a restarted empty server, a deleted folder)."""
        if self.valkey is not None:
            self.valkey.client.flushall()
        else:
            shutil.rmtree(self.root)

    def raw(self, key: str) -> bytes | None:
        if self.valkey is not None:
            return self.valkey.client.get(KEY_PREFIX + key)
        p = self.root / key[:2] / key
        return p.read_bytes() if p.is_file() else None

    def plant(self, key: str, value: bytes) -> None:
        if self.valkey is not None:
            self.valkey.client.set(KEY_PREFIX + key, value)
        else:
            (self.root / key[:2] / key).write_bytes(value)

    def count(self) -> int:
        if self.valkey is not None:
            return int(self.valkey.client.dbsize())
        return sum(1 for p in self.root.rglob("*") if p.is_file())


@pytest.fixture(params=["file", "valkey"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    server = request.getfixturevalue("valkey") if request.param == "valkey" else None
    s = Store(request.param, tmp_path, server)
    yield s
    s.backend.close()
    if server is not None:  # a test may have limited the server's memory
        server.client.config_set("maxmemory", "0")
        server.client.flushall()


def page_store(backend: StorageBackend, known: KnownKeys | None = None) -> PageStore:
    return PageStore(backend, FMT, 4, PER_PAGE, known or KnownKeys(), secret=SECRET)


# ---------------------------------------------------------------------- finding 4: healing
def test_after_data_loss_one_request_writes_the_prefix_back_whole(store: Store) -> None:
    ps = page_store(store.backend)
    assert ps.store("t", TOKS, PAGES) == 8
    store.wipe()  # the server restarted empty
    assert ps.fetch("t", TOKS, 0, 8) == []  # the next request misses at page 0 ...
    assert ps.store("t", TOKS, PAGES) == 8  # ... computes the prefix and writes all of it
    assert [bytes(p) for p in page_store(store.backend).fetch("t", TOKS, 0, 8)] == PAGES
    # eviction of the tail (pages 3..7): a lookup finds 0..2, the next write restores 3..7
    store.backend.delete(KEYS[3:])
    assert len(ps.fetch("t", TOKS, 0, 8)) == 3
    assert ps.store("t", TOKS, PAGES) == 5
    assert store.count() == 8


# ---------------------------------------------------------------------- finding 5: write faults
def _io(backend: StorageBackend) -> tuple[StorageIO, HostKVPool]:
    host = HostKVPool(**HOST)
    assert host.bytes_per_page == PER_PAGE
    io = StorageIO(backend, host, format_id=FMT, page_size=4, timeout=5.0, secret=SECRET)
    return io, host


@pytest.mark.parametrize("fault", ["disk_full", "read_only"])
def test_a_failed_write_stops_writes_only_and_lookups_go_on(
    store: Store, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert page_store(store.backend).store("t", TOKS, PAGES) == 8
    io, _ = _io(store.backend)
    try:
        if store.valkey is not None and fault == "disk_full":  # out of memory: no writes
            store.valkey.client.config_set("maxmemory-policy", "noeviction")
            store.valkey.client.config_set("maxmemory", "1")
        elif store.valkey is not None:  # a read-only replica (of a primary that is not there)
            store.valkey.client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        elif fault == "disk_full":
            real_write = os.write

            def full(fd: int, data: Any) -> int:
                if threading.current_thread().name == "radixkv-storage-write":
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", full)
        else:
            real_open = os.open

            def read_only(path: Any, flags: int, *a: Any, **k: Any) -> int:
                if flags & os.O_CREAT:
                    raise OSError(errno.EROFS, "Read-only file system")
                return real_open(path, flags, *a, **k)

            monkeypatch.setattr(os, "open", read_only)
        other = key_bytes(range(5000, 5008))
        assert io.enqueue_write("t", other, [0, 1]) == 2
        assert io.flush(10.0)
        st = io.stats()
        assert st.errors == 1 and st.dropped_write_pages == 2
        assert not st.writes_available and st.available
        for _ in range(3):  # every lookup still finds the 8 intact pages
            job = io.prefetch("t", TOKS, 0, 8)
            io.wait([job], 5.0)
            assert [bytes(p) for p in job.payloads] == PAGES
        # writes are dropped during their back-off, without touching the store
        assert io.enqueue_write("t", other, [0, 1]) == 0
        assert io.stats().errors == 1 and io.stats().prefetch_found_pages == 24
    finally:
        monkeypatch.undo()
        if store.valkey is not None:
            store.valkey.client.config_set("maxmemory", "0")
            store.valkey.client.execute_command("REPLICAOF", "NO", "ONE")
        io.close()


# ---------------------------------------------------------------------- finding 5: planted entries
def test_planted_directories_and_symlinks_are_removed_never_served(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "kv", quota_bytes=10_000_000)
    ps = page_store(fs)
    assert ps.store("t", TOKS, PAGES) == 8
    path = [fs.root / k[:2] / k for k in KEYS]
    path[2].unlink()
    path[2].mkdir()
    (path[2] / "inside").write_bytes(b"x")
    path[5].unlink()
    path[5].symlink_to(path[0])  # a sound object, of another key
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep me")
    # a lookup meets both (one backend call reads 8 pages): misses, removed and counted, no
    # outage; the symlink is never followed and its target stays
    assert [bytes(p) for p in ps.fetch("t", TOKS, 0, 8)] == PAGES[:2]
    assert fs.planted_objects == 2 and not path[2].exists() and not path[5].is_symlink()
    assert path[0].is_file()
    assert ps.store("t", TOKS, PAGES) == 6  # the lost page and every one after it
    assert [bytes(p) for p in ps.fetch("t", TOKS, 0, 8)] == PAGES
    assert path[5].is_file() and not path[5].is_symlink()
    # a symlink met by a read is never followed: a miss, the link removed, its target kept
    path[6].unlink()
    path[6].symlink_to(outside)
    assert len(ps.fetch("t", TOKS, 0, 8)) == 6
    assert fs.planted_objects == 3 and not path[6].is_symlink() and outside.exists()
    # a write over a planted directory removes it; a quota scan removes the ones it meets
    path[6].mkdir()
    assert ps.store("t", TOKS, PAGES) == 2 and path[6].is_file() and fs.planted_objects == 4
    path[7].unlink()
    path[7].mkdir()
    fs.sweep()
    assert not path[7].exists() and fs.planted_objects == 5
    assert stat.S_ISREG(path[0].lstat().st_mode)


def test_a_planted_value_of_another_type_is_a_miss_on_valkey(valkey: ValkeyProcess) -> None:
    valkey.client.flushall()
    r = RedisStorage(valkey.url)
    ps = page_store(r)
    assert ps.store("t", TOKS, PAGES) == 8
    for k in KEYS[2:4]:  # a list where two page strings belong
        valkey.client.delete(KEY_PREFIX + k)
        valkey.client.rpush(KEY_PREFIX + k, b"planted")
    assert len(ps.fetch("t", TOKS, 0, 8)) == 2
    assert ps.store("t", TOKS, PAGES) == 6  # replaces both, and what follows them
    assert [bytes(p) for p in ps.fetch("t", TOKS, 0, 8)] == PAGES
    r.close()
    valkey.client.flushall()


# ---------------------------------------------------------------------- finding 6: forgery
def _forge_v1(obj: bytes, payload: bytes) -> bytes:
    """What finding 6 did: new KV, the header's version 1 and an unkeyed XXH3-128 checksum."""
    head = bytearray(obj[: HEADER_BYTES - 16])
    struct.pack_into("<H", head, 4, 1)
    h = xxhash.xxh3_128(bytes(head))
    h.update(payload)
    return bytes(head) + h.digest() + payload


def _forge_v2(obj: bytes, payload: bytes) -> bytes:
    """The same with the current header: the checksum field recomputed without the secret."""
    head = obj[: HEADER_BYTES - 16]
    h = xxhash.xxh3_128(head)
    h.update(payload)
    return head + h.digest() + payload


@pytest.mark.parametrize("forgery", ["v1_checksum", "v2_checksum", "other_secret"])
def test_a_forged_object_is_a_miss_counted_corrupt_and_deleted(store: Store, forgery: str) -> None:
    io, _ = _io(store.backend)
    try:
        assert page_store(store.backend).store("t", TOKS[: 4 * 32], PAGES[:4]) == 4
        obj = store.raw(KEYS[1])
        assert obj is not None
        evil = b"\xee" * PER_PAGE
        if forgery == "v1_checksum":
            forged = _forge_v1(obj, evil)
        elif forgery == "v2_checksum":
            forged = _forge_v2(obj, evil)
        else:  # a well-formed object MAC'd with another deployment's secret
            digest = prefix_digests(FMT, "t", TOKS, 4)[1]
            forged = encode_page(FMT, digest, evil, key=KEYS[1], secret=b"another" * 5)
        store.plant(KEYS[1], forged)
        job = io.prefetch("t", TOKS[: 4 * 32], 0, 4)
        io.wait([job], 5.0)
        assert [bytes(p) for p in job.payloads] == PAGES[:1]  # never the forged KV
        st = io.stats()
        assert st.corrupt_objects == 1 and st.prefetch_found_pages == 1
        assert store.raw(KEYS[1]) is None  # deleted
    finally:
        io.close()


def test_an_object_moved_to_another_key_fails_its_mac(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path)
    ps = page_store(fs)
    a = key_bytes(range(8))
    ps.store("t", a, PAGES[:2])
    k0, k1 = page_keys(FMT, "t", a, 4)
    fs.put_many([(k1, fs.get_many([k0])[0])])  # page 0's object where page 1's belongs
    assert len(page_store(fs).fetch("t", a, 0, 2)) == 1
    assert fs.get_many([k1]) == [None]


# ---------------------------------------------------------------------- the secret
def test_the_secret_is_generated_once_private_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    s = load_storage_secret()
    p = tmp_path / "cfg" / "radixkv" / "storage_secret"
    assert len(s) == 32 and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert load_storage_secret() == s and load_storage_secret(p) == s
    assert [x.name for x in p.parent.iterdir()] == ["storage_secret"]  # no temp file left
    other = load_storage_secret(tmp_path / "other")
    assert other != s
    monkeypatch.setenv(ENV_SECRET, "ab" * 16)
    assert load_storage_secret(p) == bytes.fromhex("ab" * 16)  # the variable comes first
    monkeypatch.setenv(ENV_SECRET, "ab" * 8)
    with pytest.raises(ValueError, match="at least 16"):
        load_storage_secret()
    monkeypatch.delenv(ENV_SECRET)
    bad = tmp_path / "bad"
    bad.write_text("not hex at all\n")
    with pytest.raises(ValueError, match=str(bad)):
        load_storage_secret(bad)
    with pytest.raises(ValueError, match="kv_storage_secret_file"):
        EngineConfig(kv_storage_secret_file=" ")


def test_the_engine_uses_the_secret_file_and_never_logs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.loader import load_model

    caplog.set_level(logging.DEBUG)
    monkeypatch.delenv(ENV_SECRET, raising=False)
    secret_file = tmp_path / "secret"
    kw: dict[str, Any] = dict(
        page_size=4, num_pages=64, host_cache_memory=500_000, kv_storage=str(tmp_path / "kv")
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = list(range(20, 60))
    lm = load_model("radixkv-tiny")
    with Engine(lm, kv_storage_secret_file=str(secret_file), **kw) as eng:
        eng.generate([prompt], greedy, use_tqdm=False)
        assert eng.flush_storage()
    secret = secret_file.read_text().strip()
    with Engine(lm, kv_storage_secret_file=str(secret_file), **kw) as eng:
        eng.generate([prompt], greedy, use_tqdm=False)
        assert eng.stats().prefix_cache_storage_hit_tokens > 0
    with Engine(lm, kv_storage_secret_file=str(tmp_path / "another"), **kw) as eng:
        eng.generate([prompt], greedy, use_tqdm=False)  # another secret: every object forged
        st = eng.stats()
        assert st.prefix_cache_storage_hit_tokens == 0 and st.storage_corrupt_objects >= 1
    assert all(secret not in r.getMessage() for r in caplog.records)


def test_an_engine_writes_a_lost_prefix_back_in_one_request(store: Store) -> None:
    """Finding 4 as it was seen: after the store lost everything, one request restores the whole
    prefix (before: one page per request)."""
    from radixkv.engine.engine import Engine
    from radixkv.engine.params import SamplingParams
    from radixkv.model.loader import load_model

    url = str(store.root) if store.valkey is None else store.valkey.url
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = [5 + (i * 7) % 240 for i in range(130)]  # 32 whole pages of 4 tokens
    opts: dict[str, Any] = dict(page_size=4, num_pages=128, host_cache_memory=2_000_000)
    with Engine(load_model("radixkv-tiny"), kv_storage=url, **opts) as eng:
        eng.generate([prompt], greedy, use_tqdm=False)
        assert eng.flush_storage()
        stored = store.count()
        assert stored >= 32
        store.wipe()  # the server restarted empty
        eng.reset_prefix_cache()  # so the prefix is looked up in storage, and computed
        eng.generate([prompt], greedy, use_tqdm=False)
        assert eng.flush_storage()
        assert store.count() == stored
