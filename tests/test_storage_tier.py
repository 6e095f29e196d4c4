"""The engine's storage tier (engine/storage_tier.py) over a real host-tier cache, with its I/O
recorded instead of run: which host pages it writes under each write policy and threshold,
which thresholds it refuses, and what it does at close. The I/O itself, prefetch and landing
run end to end in test_engine_storage.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from cache_helpers import make_tiered, serve

from radixkv.cache.tiers import WRITE_BACK, WRITE_THROUGH, WRITE_THROUGH_SELECTIVE
from radixkv.engine.storage_tier import StorageTier

A = list(range(10, 16))  # three pages of two tokens


class RecordingIO:
    """StorageIO's engine-thread calls, recorded."""

    url = "memory://"

    def __init__(self, page_size: int = 2) -> None:
        self.page_size = page_size
        self.writes: list[tuple[Any, list[int], list[int]]] = []  # (namespace, tokens, pages)
        self.written_at_close: list[list[int]] = []
        self.closed = 0

    def enqueue_write(self, namespace: Any, prefix: bytes, host_pages: list[int]) -> int:
        self.writes.append((namespace, np.frombuffer(prefix, np.int64).tolist(), host_pages))
        return len(host_pages)

    def write_all(self, runs: list[Any], timeout: float = 30.0) -> int:
        self.written_at_close += [np.frombuffer(r.prefix, np.int64).tolist() for r in runs]
        return sum(len(r.host_pages) for r in runs)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        self.closed += 1


def tier(
    policy: str, threshold: int, *, host_policy: str = WRITE_THROUGH, host_threshold: int = 1
) -> tuple[StorageTier, RecordingIO, Any, Any]:
    cache, cp = make_tiered(write_policy=host_policy, write_through_threshold=host_threshold)
    io = RecordingIO()
    st = StorageTier(cache, io, write_policy=policy, write_threshold=threshold)  # type: ignore[arg-type]
    return st, io, cache, cp


def test_selective_writes_once_the_storage_threshold_is_reached() -> None:
    # as the engine builds it: a host tier that does not count hits reports them at storage's
    _, io, cache, cp = tier(WRITE_THROUGH_SELECTIVE, 3, host_threshold=3)
    serve(cache, cp, A)
    cache.wait_all()  # the host copy is valid now (hit 0 times: not written)
    for _ in range(2):
        cache.match_prefix(A)
    assert io.writes == []
    cache.match_prefix(A)  # the third hit
    assert io.writes == [(None, A, [0, 1, 2])]
    cache.match_prefix(A)
    assert len(io.writes) == 1  # once
    cache.check_invariants()


def test_write_through_and_write_back_ignore_hits() -> None:
    st, io, cache, cp = tier(WRITE_THROUGH, 1)
    serve(cache, cp, A)
    cache.wait_all()
    assert io.writes == [(None, A, [0, 1, 2])]  # as soon as it is in the host tier
    st, io, cache, cp = tier(WRITE_BACK, 1)
    serve(cache, cp, A)
    cache.wait_all()
    cache.match_prefix(A)
    assert io.writes == []  # only when it leaves the host tier, or at close
    st.close()
    st.close()  # idempotent
    assert io.written_at_close == [A] and io.closed == 1
    serve(cache, cp, [1, 2, 3, 4])
    cache.wait_all()
    assert io.writes == []  # closed: no longer the cache's observer


@pytest.mark.parametrize(
    ("host_policy", "host_threshold", "threshold", "ok"),
    [
        (WRITE_THROUGH, 2, 2, True),  # the cache reports hits at storage's count
        (WRITE_THROUGH, 1, 2, False),  # ... at another count: a page hit twice is not told
        (WRITE_THROUGH, 3, 2, False),
        (WRITE_THROUGH_SELECTIVE, 3, 2, True),  # a page reaches the host tier at 3 hits
        (WRITE_THROUGH_SELECTIVE, 2, 3, False),  # its third hit is not reported
    ],
)
def test_a_threshold_the_cache_cannot_report_is_refused(
    host_policy: str, host_threshold: int, threshold: int, ok: bool
) -> None:
    if ok:
        tier(
            WRITE_THROUGH_SELECTIVE,
            threshold,
            host_policy=host_policy,
            host_threshold=host_threshold,
        )
        return
    with pytest.raises(ValueError, match=f"storage write threshold {threshold} cannot be"):
        tier(
            WRITE_THROUGH_SELECTIVE,
            threshold,
            host_policy=host_policy,
            host_threshold=host_threshold,
        )


def test_bad_arguments_are_refused() -> None:
    cache, _ = make_tiered()
    with pytest.raises(ValueError, match="write policy"):
        StorageTier(cache, RecordingIO(), write_policy="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold must be an int >= 1"):
        StorageTier(cache, RecordingIO(), write_threshold=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_size"):
        StorageTier(cache, RecordingIO(page_size=4))  # type: ignore[arg-type]
    from radixkv.cache import PagePool, RadixCache

    with pytest.raises(ValueError, match="host tier"):
        StorageTier(RadixCache(PagePool(4), 2), RecordingIO())  # type: ignore[arg-type]
