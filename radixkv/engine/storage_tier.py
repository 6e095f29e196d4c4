"""The storage tier from the engine's side: the one room that prefetches KV pages from storage
into the host tier and writes host pages out to storage.

Storage is the third tier, under the device pool and the host tier; it outlives the process
and can be shared by a fleet (docs/cache_design.md, "Storage tier"). The backends and the page
objects are torch-free, in radixkv/cache/storage/; this module is everything the engine does
with them, in two classes:

* :class:`StorageTier`, the engine's door to storage (``Engine.storage``), and besides SeqKV
  (kv_manager.py) the only engine code that calls the cache: it decides which queued requests
  are worth a lookup (``start_prefetch``, peeking their device + host hit), puts what was found
  in the host tier at the start of a step (``land_prefetches``: ``TieredRadixCache.alloc_host`` /
  ``insert_host``), is the cache's host observer (``observe``: which host pages to write, by
  its write policy and threshold), and at ``close`` writes out what only the host tier holds
  (``write_back``).
* :class:`StorageIO`, the I/O, which touches no trie: two daemon threads, so that no step ever
  waits on storage.

  - the reader runs prefetch jobs in order: the pages of a queued request past its device +
    host hit, by hash chain, stopping at the first page not found intact or at the job's
    deadline;
  - the writer drains a bounded queue of host-page snapshots (taken in the engine thread when
    the cache reports a page, so the host pool may reuse the page at once). A full queue drops
    the write and counts it; the step never blocks on it.

  Faults (backend down at start or mid-run, a timeout, disk full, permission denied) raise
  StorageError in a thread; the I/O logs one warning per outage and kind, counts it, stops
  using the backend *in that direction* for a growing back-off (0.5 s doubling to 30 s), then
  tries again and logs the recovery. Reads and writes back off apart: a write that fails
  (disk full, a read-only mount, a server out of memory) drops writes meanwhile and lookups go
  on finding what is stored; a read that fails makes lookups misses meanwhile; a store that
  cannot be reached (or times out) backs off both ways. The device
  and host tiers are never affected.

A sequence's share of storage in its hit (``PrefetchJob.hit_tokens``) is read by SeqKV and the
scheduler from the job its request carries (``RequestGroup.prefetch``).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import deque
from typing import Any

import msgspec
import torch

from radixkv.cache import OutOfPages, TieredRadixCache
from radixkv.cache.storage import KnownKeys, PageStore, StorageBackend, StorageError
from radixkv.cache.tiers import (
    HOST_HIT,
    HOST_LEAVING,
    HOST_STORED,
    WRITE_BACK,
    WRITE_POLICIES,
    WRITE_THROUGH,
    WRITE_THROUGH_SELECTIVE,
    HostRun,
)
from radixkv.kv.host_pool import HostKVPool

__all__ = ["PrefetchJob", "StorageIO", "StorageStats", "StorageTier"]

log = logging.getLogger("radixkv.storage")

_BACKOFF_MIN_S = 0.5
_BACKOFF_MAX_S = 30.0
# PageStore counters that StorageStats reports (summed over the stores of every format)
_COUNTERS = (
    "found_pages",
    "corrupt_objects",
    "mismatched_objects",
    "stored_pages",
    "skipped_known",
)
# kinds of StorageError that mean the store is unreachable both ways (others, such as "full"
# or "permission", concern the way that failed: a full disk still serves reads)
_WHOLE_STORE = frozenset({"unreachable", "timeout"})
_CHUNK = 64  # pages per queued write: bounds one snapshot's memory and one backend call
_IDLE_WAIT_S = 0.05  # longest an idle step waits for a prefetch before returning


class StorageStats(msgspec.Struct, kw_only=True):
    """The storage tier's counters (cumulative) and gauges."""

    prefetch_jobs: int = 0  # lookups started (one per queued request worth prefetching)
    prefetch_found_pages: int = 0  # pages found intact in storage
    prefetch_pages: int = 0  # of those, pages put in the host tier (landed)
    prefetch_seconds: float = 0.0  # reader time spent on jobs (issue to done)
    land_seconds: float = 0.0  # engine time putting found pages in the host tier
    prefetch_timeouts: int = 0  # jobs cut short by their deadline (or not started in time)
    write_pages: int = 0  # pages written to storage
    write_skipped_pages: int = 0  # not written: known to be stored already
    dropped_write_pages: int = 0  # not written: queue full, or storage unavailable
    errors: int = 0  # failed backend calls
    errors_by_kind: dict[str, int] = msgspec.field(default_factory=dict)
    corrupt_objects: int = 0  # failed their checksum on read (deleted)
    mismatched_objects: int = 0  # another format or prefix under a key (a collision)
    write_queue_pages: int = 0  # gauge: snapshots waiting for the writer
    available: bool = True  # gauge: False during a read outage's back-off
    writes_available: bool = True  # gauge: False during a write outage's back-off
    planted_objects: int = 0  # non-files where page files belong (file storage): removed


class _Health:
    """One direction's (reads' or writes') outage state: StorageIO's, under its lock."""

    __slots__ = ("backoff", "down", "retry_at")

    def __init__(self) -> None:
        self.down = False
        self.retry_at = 0.0
        self.backoff = 0.0


class PrefetchJob:
    """One lookup: pages ``start..stop`` of ``key_bytes`` under ``namespace``.

    The reader fills ``payloads`` (the pages found, in order) and sets ``done``; the engine
    thread lands them in the host tier (then ``landed``). A job not done by ``deadline`` (a
    ``time.monotonic()``) no longer holds its request back: the request proceeds as a miss.
    """

    __slots__ = (
        "_done",
        "deadline",
        "issued",
        "key_bytes",
        "landed",
        "landed_tokens",
        "namespace",
        "payloads",
        "start",
        "stop",
    )

    def __init__(
        self, namespace: Any, key_bytes: bytes, start: int, stop: int, deadline: float
    ) -> None:
        self.namespace = namespace
        self.key_bytes = key_bytes
        self.start = start
        self.stop = stop
        self.deadline = deadline
        self.issued = time.monotonic()
        self.payloads: list[memoryview] = []
        self._done = threading.Event()
        self.landed = False
        self.landed_tokens = (0, 0)  # [first, end) token span put in the host tier

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def holds_back(self, now: float) -> bool:
        """Whether its request should wait for it: not landed, and before its deadline."""
        return not self.landed and now < self.deadline

    def hit_tokens(self, hit: int, loaded: int) -> int:
        """Of a sequence's ``hit`` tokens, ``loaded`` of them from the host tier, those this
        job put there (pages since promoted by another request count as device hits)."""
        if not self.landed or not loaded:
            return 0
        a, b = self.landed_tokens
        return max(0, min(min(hit, b) - a, loaded))

    def __repr__(self) -> str:
        return (
            f"PrefetchJob(pages {self.start}..{self.stop}, done={self.done}, "
            f"found={len(self.payloads)}, landed={self.landed})"
        )


class StorageTier:
    """The engine's storage tier: which requests' prefixes to look up in storage and where what
    was found goes (the host tier), which host pages to write and when.

    Besides SeqKV, the only engine code that calls the cache. Built over a cache with a host
    tier, it is that cache's host observer from construction to :meth:`close`. Call it from the
    engine thread only, like the cache; the I/O runs in ``io``'s threads. It needs the prefix
    cache on (nothing is matched or inserted otherwise).

    Args:
        cache: the engine's radix cache (with a host tier: found pages land there, written
            pages are read from there).
        io: the storage I/O over the host tier's K/V (``io.page_size == cache.page_size``).
        write_policy: when a host-tier page is written: "write_through" (once it is in the host
            tier), "write_through_selective" (once matches went through it ``write_threshold``
            times: when it enters or leaves the host tier hit that often, or when the cache
            reports that its hits reached the cache's ``write_through_threshold``) or
            "write_back" (when it leaves the host tier, and at :meth:`close`).
        write_threshold: see ``write_policy``. The cache reports a host page's hits at one
            count, its own ``write_through_threshold``, so under "write_through_selective"
            this must equal it, or be lower when the cache's own policy is
            "write_through_selective" too (a page then reaches the host tier only after that
            many hits, so the lower count acts as the cache's); ValueError otherwise.
        prefetch_threshold: fewest tokens a lookup must be able to find to be started.
    """

    def __init__(
        self,
        cache: TieredRadixCache,
        io: StorageIO,
        *,
        write_policy: str = WRITE_THROUGH,
        write_threshold: int = 1,
        prefetch_threshold: int = 0,
    ) -> None:
        if cache.host_pool is None:
            raise ValueError("a storage tier needs a cache with a host tier (host_pool)")
        if io.page_size != cache.page_size:
            raise ValueError(
                f"storage I/O page_size {io.page_size} != the cache's {cache.page_size}"
            )
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown storage write policy {write_policy!r}")
        if type(write_threshold) is not int or write_threshold < 1:
            raise ValueError(
                f"storage write threshold must be an int >= 1, got {write_threshold!r}"
            )
        host_thr = cache.write_through_threshold
        if write_policy == WRITE_THROUGH_SELECTIVE and not (
            write_threshold == host_thr
            or (write_threshold < host_thr and cache.write_policy == WRITE_THROUGH_SELECTIVE)
        ):
            raise ValueError(
                f"storage write threshold {write_threshold} cannot be honoured: the cache reports "
                f"host pages' hits at its write_through_threshold ({host_thr}, write policy "
                f"{cache.write_policy!r})"
            )
        self.cache = cache
        self.io = io
        self.page_size = cache.page_size
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        self.prefetch_threshold = prefetch_threshold
        self._jobs: list[PrefetchJob] = []  # started and not landed yet, oldest first
        self._closed = False
        cache.set_host_observer(self.observe)

    # ------------------------------------------------------------------ prefetch
    def start_prefetch(self, namespace: Any, token_ids: array[int]) -> PrefetchJob | None:
        """Look a queued request's prompt (``token_ids``, cached under ``namespace``) up in
        storage past its device + host hit, in the background, when at least
        ``prefetch_threshold`` tokens could be found there; returns the job (the request's
        ``prefetch``: the scheduler holds it back while the job runs, up to the storage
        timeout, ``PrefetchJob.holds_back``), or None when no lookup is worth it. Changes
        nothing in the cache."""
        ps = self.page_size
        total = (len(token_ids) - 1) // ps  # whole pages of what SeqKV.acquire may match
        if total <= 0:
            return None
        hit = self.cache.peek_prefix(
            token_ids[: len(token_ids) - 1], namespace=namespace, host=True
        )
        start = hit // ps
        if (total - start) * ps < max(1, self.prefetch_threshold):
            return None
        job = self.io.prefetch(namespace, token_ids[: total * ps].tobytes(), start, total)
        self._jobs.append(job)
        return job

    @property
    def prefetches(self) -> list[PrefetchJob]:
        """The prefetch jobs started and not landed yet, oldest first."""
        return list(self._jobs)

    def land_prefetches(self) -> int:
        """Put the pages of finished prefetches in the host tier (call at the start of a step,
        before admission); returns how many pages landed. Data that cannot land is a miss,
        logged, never an error."""
        if not self._jobs:
            return 0
        landed = 0
        keep: list[PrefetchJob] = []
        for job in self._jobs:
            if not job.done:
                keep.append(job)
                continue
            try:
                landed += self._land(job)
            except Exception:  # storage data that cannot land is a miss, never an engine error
                log.exception("landing prefetched KV pages failed")
            job.landed = True
            job.payloads = []  # the host tier has them now
        self._jobs = keep
        return landed

    def wait_prefetch(self) -> bool:
        """For a step that could schedule nothing: wait (briefly) for the prefetches that hold
        requests back. False if none does (the step is really stuck)."""
        now = time.monotonic()
        jobs = [j for j in self._jobs if j.holds_back(now)]
        if not jobs:
            return False
        left = min(j.deadline for j in jobs) - now
        self.io.wait(jobs, min(_IDLE_WAIT_S, max(0.0, left)))
        return True

    def _land(self, job: PrefetchJob) -> int:
        n = len(job.payloads)
        if not n:
            return 0
        t = time.perf_counter()
        cache, ps = self.cache, self.page_size
        host = cache.host_pool
        assert host is not None  # checked at construction
        tokens = array("q")
        tokens.frombytes(job.key_bytes[: (job.start + n) * ps * 8])
        pin = None
        if job.start:  # the prefix the pages continue must not make room for them
            m = cache.match_prefix(tokens[: job.start * ps], namespace=job.namespace)
            if m.num_tokens + m.num_host_tokens < job.start * ps:
                return 0  # evicted since the lookup: nothing to attach the pages to
            pin = m.host_node
            cache.lock(pin)
        try:
            n = min(n, host.num_free + cache.num_host_evictable_pages)
            if not n:
                return 0
            try:
                pages = cache.alloc_host(n)
            except OutOfPages:
                return 0
            try:
                self.io.land(job, pages)
            except Exception:
                host.free(pages)
                raise
            added = cache.insert_host(tokens[: (job.start + n) * ps], pages, job.namespace)
        finally:
            if pin is not None:
                cache.unlock(pin)
        end = (job.start + n) * ps
        job.landed_tokens = (end - added * ps, end)
        self.io.record_landed(added, time.perf_counter() - t)
        return added

    # ------------------------------------------------------------------ writes
    def observe(self, run: HostRun) -> None:
        """The cache's host observer: queue a snapshot of the run's pages when the write policy
        says so (dropped, counted, when the queue is full or storage is unavailable)."""
        policy = self.write_policy
        if policy == WRITE_THROUGH:
            want = run.event == HOST_STORED
        elif policy == WRITE_BACK:
            want = run.event == HOST_LEAVING
        else:  # once hit enough: when it reaches that count, or enters/leaves the host tier
            want = run.event == HOST_HIT or run.hit_count >= self.write_threshold
        if want:
            self.io.enqueue_write(run.namespace, run.prefix, run.host_pages)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Retire the host tier's copies in flight (a finished backup reports its pages to
        :meth:`observe`), then wait until every queued write is done (True), or ``timeout``
        seconds passed (False)."""
        self.cache.wait_all()
        return self.io.flush(timeout)

    # ------------------------------------------------------------------ lifecycle, stats
    def rekey(self, format_id: bytes) -> None:
        """Serve the KV format ``format_id`` from now on (the weights changed) and forget every
        prefetch not landed yet: the pages they bring are of a format no longer served (the
        caller drops its requests' jobs too). What storage holds stays (other engines may
        still serve the old format)."""
        self._jobs = []
        self.io.rekey(format_id)

    def close(self, timeout: float | None = 30.0) -> None:
        """Retire the host tier's copies in flight; under ``write_back`` queue every page held
        only in the host tier (it would be lost), waiting for room in the queue; finish the
        queued writes (up to ``timeout`` seconds), stop the threads and stop observing the
        cache. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cache.wait_all()
        if self.write_policy == WRITE_BACK:
            self.io.write_all(self.cache.host_runs())
        self.io.close(timeout)
        self.cache.set_host_observer(None)

    def stats(self) -> StorageStats:
        """A snapshot of the storage counters and gauges."""
        return self.io.stats()

    def __repr__(self) -> str:
        return f"StorageTier({self.io.url!r}, {self.write_policy}, {len(self._jobs)} prefetching)"


class StorageIO:
    """The storage I/O behind :class:`StorageTier`: lookups and writes between a backend and the
    host tier's K/V, in two background threads. Touches no trie (what to look up, what to
    write and where found pages go are the StorageTier's decisions).

    Args:
        backend: the store (radixkv.cache.storage.open_storage).
        host_kv: the host tier's K/V pages (what is read for writes and filled by landing).
        format_id: the KV format's identity (page_format.kv_format_id).
        page_size: tokens per page.
        timeout: seconds a request waits for its prefetch before it proceeds as a miss.
        write_queue_pages: pages the write queue holds before it drops writes.
        secret: the deployment's storage secret (radixkv.cache.storage.load_storage_secret),
            which MACs every page object.
    """

    def __init__(
        self,
        backend: StorageBackend,
        host_kv: HostKVPool,
        *,
        format_id: bytes,
        page_size: int,
        timeout: float = 1.0,
        write_queue_pages: int = 4096,
        secret: bytes,
    ) -> None:
        self.backend = backend
        self.url = backend.url
        self.host_kv = host_kv
        self.page_size = page_size
        self.timeout = timeout
        self.write_queue_pages = write_queue_pages
        known = KnownKeys()
        per = host_kv.bytes_per_page
        self._secret = secret
        self._reader = PageStore(backend, format_id, page_size, per, known, secret=secret)
        self._writer = PageStore(backend.clone(), format_id, page_size, per, known, secret=secret)
        # the last format's stores (a queued write or a running job may still use them), and
        # the counters of those before (_COUNTERS)
        self._retired: list[PageStore] = []
        self._past = dict.fromkeys(_COUNTERS, 0)
        self._stats = StorageStats()
        self._lock = threading.Lock()  # guards the stats, the health state and the queues
        self._wake = threading.Condition(self._lock)
        self._jobs: deque[PrefetchJob] = deque()
        # (the store of the pages' format, namespace, prefix, snapshot)
        self._writes: deque[tuple[PageStore, Any, bytes, torch.Tensor]] = deque()
        self._queued_pages = 0  # pages queued or being written
        self._health = {"read": _Health(), "write": _Health()}  # guarded by _lock
        self._warned: set[str] = set()  # kinds logged in this outage
        self._corrupt_warned = False
        self._closed = False
        self._threads = [
            threading.Thread(target=self._read_loop, name="radixkv-storage-read", daemon=True),
            threading.Thread(target=self._write_loop, name="radixkv-storage-write", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ prefetch (engine thread)
    def prefetch(self, namespace: Any, key_bytes: bytes, start: int, stop: int) -> PrefetchJob:
        """Start looking up pages ``start..stop`` of ``key_bytes`` (tokens, key encoding);
        returns the job at once."""
        job = PrefetchJob(namespace, key_bytes, start, stop, time.monotonic() + self.timeout)
        with self._lock:
            self._stats.prefetch_jobs += 1
            if self._closed:
                job._done.set()
                return job
            self._jobs.append(job)
            self._wake.notify_all()
        return job

    def wait(self, jobs: list[PrefetchJob], timeout: float) -> None:
        """Block until one of ``jobs`` is done or ``timeout`` seconds passed (for an engine with
        nothing else to do while its requests' prefetches run)."""
        end = time.monotonic() + timeout
        for job in jobs:
            left = end - time.monotonic()
            if left <= 0 or job.done:
                return
            # jobs run in order: the first not done is the one to wait for
            job._done.wait(left)
            if job.done:
                return

    def land(self, job: PrefetchJob, host_pages: list[int]) -> None:
        """Copy the first ``len(host_pages)`` pages ``job`` found into ``host_pages``."""
        self.host_kv.write_pages(host_pages, job.payloads[: len(host_pages)])

    def record_landed(self, pages: int, seconds: float) -> None:
        with self._lock:
            self._stats.prefetch_pages += pages
            self._stats.land_seconds += seconds

    # ------------------------------------------------------------------ writes (engine thread)
    def enqueue_write(
        self,
        namespace: Any,
        prefix: bytes,
        host_pages: list[int],
        *,
        wait: float = 0.0,
    ) -> int:
        """Queue the last ``len(host_pages)`` pages of ``prefix`` (tokens, key encoding) for
        writing, in chunks of at most 64 pages; their data is copied now. A chunk the
        full queue has no room for is dropped (counted), after waiting up to ``wait`` seconds
        for room (0 from the engine's step: it never waits). Returns the pages queued."""
        pb = self.page_size * 8
        total = len(host_pages)
        queued = 0
        end = time.monotonic() + wait
        step = min(_CHUNK, self.write_queue_pages)
        for a in range(0, total, step):
            b = min(total, a + step)
            chunk = host_pages[a:b]
            if not self._reserve(len(chunk), end):
                continue
            snapshot = self.host_kv.read_pages(chunk)
            with self._lock:
                end_at = len(prefix) - (total - b) * pb
                self._writes.append((self._writer, namespace, prefix[:end_at], snapshot))
                self._wake.notify_all()
            queued += len(chunk)
        return queued

    def _reserve(self, n: int, end: float) -> bool:
        """Room for ``n`` pages in the write queue (reserved before the copy, so the queue's
        bound holds), waiting until ``end`` (a ``time.monotonic()``) at most."""
        cap = self.write_queue_pages
        with self._lock:
            while True:
                if self._closed or not self._available("write"):
                    break
                if self._queued_pages + n <= cap:
                    self._queued_pages += n
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._wake.wait(left)
            self._stats.dropped_write_pages += n
            return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (written, skipped or failed); False if
        ``timeout`` seconds passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queued_pages:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def write_all(self, runs: list[HostRun], timeout: float = 30.0) -> int:
        """Queue every run for writing, waiting for room in the queue (at shutdown, for
        ``write_back``: what is only in host memory would be lost); returns pages queued."""
        end = time.monotonic() + timeout
        queued = 0
        for run in runs:
            left = max(0.0, end - time.monotonic())
            queued += self.enqueue_write(run.namespace, run.prefix, run.host_pages, wait=left)
        return queued

    # ------------------------------------------------------------------ lifecycle, stats
    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to ``timeout`` seconds), stop the threads, close the
        backend. Idempotent; prefetches and writes after it are no-ops."""
        if self._closed:
            return
        self.flush(timeout)
        with self._lock:
            self._closed = True
            for job in self._jobs:
                job._done.set()
            self._jobs.clear()
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
        for b in {id(s.backend): s.backend for s in (self._reader, self._writer)}.values():
            try:
                b.close()
            except Exception:  # closing a dead connection: nothing left to release
                log.debug("closing %s failed", b, exc_info=True)

    def rekey(self, format_id: bytes) -> None:
        """Serve the KV format ``format_id`` from now on (the model's weights changed).
        Prefetches not started yet end at once, finding nothing; one running finishes in the
        old format, and the StorageTier drops its result (``StorageTier.rekey``). Writes already
        queued are stored in their own format: their pages were computed under it."""
        with self._lock:
            r, w = self._reader, self._writer
            for old in self._retired:
                for c in _COUNTERS:
                    self._past[c] += getattr(old, c)
            self._retired = [r, w]
            self._reader = PageStore(
                r.backend, format_id, r.page_size, r.payload_bytes, r.known, secret=self._secret
            )
            self._writer = PageStore(
                w.backend, format_id, w.page_size, w.payload_bytes, w.known, secret=self._secret
            )
            for job in self._jobs:
                job._done.set()
            self._jobs.clear()

    def retry_now(self) -> None:
        """End any back-off now: the next lookup and write try the store again."""
        with self._lock:
            for h in self._health.values():
                h.retry_at = 0.0

    def stats(self) -> StorageStats:
        with self._lock:
            st = self._stats
            stores = [self._reader, self._writer, *self._retired]  # counters are per store
            n = {c: self._past[c] + sum(getattr(s, c) for s in stores) for c in _COUNTERS}
            return msgspec.structs.replace(
                st,
                prefetch_found_pages=n["found_pages"],
                corrupt_objects=n["corrupt_objects"],
                mismatched_objects=n["mismatched_objects"],
                write_pages=n["stored_pages"],
                write_skipped_pages=n["skipped_known"],
                errors_by_kind=dict(st.errors_by_kind),
                write_queue_pages=self._queued_pages,
                available=not self._health["read"].down,
                writes_available=not self._health["write"].down,
                planted_objects=sum(
                    getattr(b, "planted_objects", 0)
                    for b in {id(x.backend): x.backend for x in stores}.values()
                ),
            )

    def __repr__(self) -> str:
        return f"StorageIO({self.url!r})"

    # ------------------------------------------------------------------ health (lock held)
    def _available(self, way: str) -> bool:
        h = self._health[way]
        return not h.down or time.monotonic() >= h.retry_at

    def _failed(self, e: StorageError, way: str) -> None:
        """A ``way`` ("read" or "write") call failed: back off that way, or both ways when the
        store cannot be reached at all (``_WHOLE_STORE``). One warning per outage and kind."""
        with self._lock:
            st = self._stats
            st.errors += 1
            st.errors_by_kind[e.kind] = st.errors_by_kind.get(e.kind, 0) + 1
            ways = tuple(self._health) if e.kind in _WHOLE_STORE else (way,)
            for w in ways:
                h = self._health[w]
                h.backoff = min(_BACKOFF_MAX_S, max(_BACKOFF_MIN_S, 2 * h.backoff))
                h.retry_at = time.monotonic() + h.backoff
                h.down = True
            first = e.kind not in self._warned
            self._warned.add(e.kind)
        if first:
            log.warning(
                "KV storage %s: a %s failed (%s): %s. %s; retried after a back-off "
                "(metric radixkv_storage_errors).",
                self.url,
                way,
                e.kind,
                e,
                "Lookups go on, writes are dropped meanwhile"
                if len(ways) == 1 and way == "write"
                else "Serving from the device and host tiers meanwhile",
            )

    def _succeeded(self, way: str) -> None:
        h = self._health[way]
        if not h.down:  # the common case: no lock
            return
        with self._lock:
            was = h.down
            h.down = False
            h.backoff = 0.0
            if not any(x.down for x in self._health.values()):
                self._warned.clear()
        if was:
            log.warning("KV storage %s: %ss are available again", self.url, way)

    def _check_corrupt(self, reader: PageStore) -> None:
        if reader.corrupt_objects and not self._corrupt_warned:
            self._corrupt_warned = True
            log.warning(
                "KV storage %s: a corrupt page object was found (damaged, forged, written by an "
                "engine with another storage secret, or by a radixkv before the MAC), deleted "
                "and served as a miss (metric radixkv_storage_corrupt_objects)",
                self.url,
            )

    # ------------------------------------------------------------------ the threads
    def _read_loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
                reader = self._reader
                usable = self._available("read")
            t = time.monotonic()
            try:
                if not usable or t >= job.deadline:
                    with self._lock:
                        self._stats.prefetch_timeouts += int(usable)
                else:
                    calls = reader.calls
                    job.payloads = reader.fetch(
                        job.namespace, job.key_bytes, job.start, job.stop, job.deadline
                    )
                    if reader.calls > calls:  # the store answered
                        self._succeeded("read")
                    self._check_corrupt(reader)
                    if (
                        time.monotonic() >= job.deadline
                        and len(job.payloads) < job.stop - job.start
                    ):
                        with self._lock:
                            self._stats.prefetch_timeouts += 1
            except StorageError as e:
                self._failed(e, "read")
            except Exception:  # a bug must not kill the thread: the job is a miss
                log.exception("KV storage prefetch failed")
            finally:
                with self._lock:
                    self._stats.prefetch_seconds += time.monotonic() - t
                job._done.set()

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._writes and not self._closed:
                    self._wake.wait()
                if not self._writes:  # closed and drained
                    return
                store, namespace, prefix, snapshot = self._writes.popleft()
                n = snapshot.shape[0]
                usable = self._available("write")
            try:
                if not usable:
                    with self._lock:
                        self._stats.dropped_write_pages += n
                else:
                    rows = snapshot.numpy()
                    if store.store(namespace, prefix, [memoryview(r) for r in rows]):
                        self._succeeded("write")
            except StorageError as e:
                self._failed(e, "write")
                with self._lock:
                    self._stats.dropped_write_pages += n
            except Exception:
                log.exception("KV storage write failed")
            finally:
                with self._lock:
                    self._queued_pages -= n
                    self._wake.notify_all()
