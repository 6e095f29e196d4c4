"""KVCopier: the radix cache's copier (radixkv.cache.tiers.Copier) over a KVPool and a HostKVPool.

It moves whole pages, every layer, K and V, between the device pool and the host pool:

* CPU pools: each copy runs on one background thread (one worker, so copies run in the order
  they were issued); the handle is the thread's future. PyTorch's copy kernels release the GIL,
  so a copy overlaps the caller's work.
* a CUDA pool: each copy is enqueued on a side stream, after the work already enqueued on the
  caller's current stream (whose results, e.g. the KV a forward pass just wrote, it may read);
  host pages are pinned, so the transfers are asynchronous. The handle is a CUDA event
  recorded after the copy; ``wait()`` blocks the calling thread until it has passed, so that
  work enqueued afterwards (the forward that reads loaded pages) sees the data.

Pages are checked (ints in range, distinct destinations) when a copy is issued: ValueError
then, before anything runs. An error while copying is raised by the handle's ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixkv.cache.tiers import CompletedCopy
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool, movable

__all__ = ["KVCopier"]


class _FutureCopy:
    """Handle of a copy running on the background thread."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> None:
        self._future.result()  # re-raises the copy's exception, on every call


class _CudaCopy:
    """Handle of a copy on the side stream: an event recorded after it, and the temporaries
    the stream still uses (kept alive until the copy is over)."""

    __slots__ = ("_event", "_keep")

    def __init__(self, event: Any, keep: tuple[Any, ...]) -> None:
        self._event = event
        self._keep: tuple[Any, ...] | None = keep

    def done(self) -> bool:
        if self._event.query():
            self._keep = None
            return True
        return False

    def wait(self) -> None:
        self._event.synchronize()
        self._keep = None


class KVCopier:
    """Copies pages between ``kv`` (device) and ``host`` for a RadixCache's host tier.

    Args:
        kv: the device pool (the pages of ``RadixCache.pool``).
        host: the host pool (the pages of ``RadixCache.host_pool``); same page shape and dtype.
        background: CPU pools only: run copies on a background thread (default). False runs
            each copy in the calling thread before returning (a completed handle), which is
            simpler to debug and what a caller that would wait at once anyway wants.
    """

    def __init__(self, kv: KVPool, host: HostKVPool, *, background: bool = True) -> None:
        if not isinstance(kv, KVPool):
            raise TypeError(f"kv must be a KVPool, got {type(kv).__name__}")
        if not isinstance(host, HostKVPool):
            raise TypeError(f"host must be a HostKVPool, got {type(host).__name__}")
        if not host.matches(kv):
            raise ValueError(f"host pages are not shaped like the device pool's: {host} vs {kv}")
        self.kv = kv
        self.host = host
        # the copies move bytes: fp8 pages through uint8 views (see kv_pool.movable)
        self._dk, self._dv = movable(kv.k), movable(kv.v)
        self._hk, self._hv = movable(host.k), movable(host.v)
        self._cuda = kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=kv.device) if self._cuda else None
        self._executor: ThreadPoolExecutor | None = None
        if background and not self._cuda:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-copy")

    # ------------------------------------------------------------------ the Copier protocol
    def to_host(self, pairs: Sequence[tuple[int, int]]) -> Any:
        """Copy device page ``d`` to host page ``h`` for each ``(d, h)``; returns a handle."""
        src, dst = self._split(pairs, self.kv.num_pages, self.host.num_pages)
        if self._cuda:
            return self._cuda_to_host(src, dst)
        return self._run(self._cpu_to_host, src, dst)

    def to_device(self, pairs: Sequence[tuple[int, int]]) -> Any:
        """Copy host page ``h`` to device page ``d`` for each ``(h, d)``; returns a handle."""
        src, dst = self._split(pairs, self.host.num_pages, self.kv.num_pages)
        if self._cuda:
            return self._cuda_to_device(src, dst)
        return self._run(self._cpu_to_device, src, dst)

    def close(self) -> None:
        """Finish the copies in flight and stop the background thread (idempotent)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> KVCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ CPU
    def _run(self, fn: Any, src: list[int], dst: list[int]) -> Any:
        if self._executor is None:
            try:
                fn(src, dst)
            except Exception as e:
                return CompletedCopy(e)
            return CompletedCopy()
        return _FutureCopy(self._executor.submit(fn, src, dst))

    def _cpu_to_host(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        # [L, n, ...] gathered from the device layout, stored page-major
        self._hk.index_copy_(0, d, self._dk.index_select(1, s).transpose(0, 1))
        self._hv.index_copy_(0, d, self._dv.index_select(1, s).transpose(0, 1))

    def _cpu_to_device(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        self._dk.index_copy_(1, d, self._hk.index_select(0, s).transpose(0, 1))
        self._dv.index_copy_(1, d, self._hv.index_select(0, s).transpose(0, 1))

    # ------------------------------------------------------------------ CUDA (side stream)
    def _cuda_to_host(self, src: list[int], dst: list[int]) -> _CudaCopy:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # after the KV writes
        with torch.cuda.stream(stream):  # everything below is enqueued on the side stream
            s = torch.tensor(src, dtype=torch.long, device=self.kv.device)
            k = self._dk.index_select(1, s).transpose(0, 1).contiguous()  # [n, L, ...]
            v = self._dv.index_select(1, s).transpose(0, 1).contiguous()
            for i, h in enumerate(dst):  # one contiguous pinned page each: async D2H
                self._hk[h].copy_(k[i], non_blocking=True)
                self._hv[h].copy_(v[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaCopy(event, (s, k, v))

    def _cuda_to_device(self, src: list[int], dst: list[int]) -> _CudaCopy:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # pages' last readers
        with torch.cuda.stream(stream):
            n = len(src)
            shape = (n, *self._hk.shape[1:])
            k = torch.empty(shape, dtype=self._dk.dtype, device=self.kv.device)
            v = torch.empty(shape, dtype=self._dk.dtype, device=self.kv.device)
            for i, h in enumerate(src):  # async H2D from pinned pages
                k[i].copy_(self._hk[h], non_blocking=True)
                v[i].copy_(self._hv[h], non_blocking=True)
            d = torch.tensor(dst, dtype=torch.long, device=self.kv.device)
            self._dk.index_copy_(1, d, k.transpose(0, 1))
            self._dv.index_copy_(1, d, v.transpose(0, 1))
            event = torch.cuda.Event()
            event.record(stream)
        return _CudaCopy(event, (d, k, v))

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _split(
        pairs: Sequence[tuple[int, int]], src_pages: int, dst_pages: int
    ) -> tuple[list[int], list[int]]:
        src: list[int] = []
        dst: list[int] = []
        for pair in pairs:
            s, d = pair
            if isinstance(s, bool) or isinstance(d, bool):
                raise ValueError(f"page ids must be ints, got {pair!r}")
            s, d = int(s), int(d)
            if not (0 <= s < src_pages and 0 <= d < dst_pages):
                raise ValueError(
                    f"page pair {pair!r} out of range (source pages {src_pages}, "
                    f"destination pages {dst_pages})"
                )
            src.append(s)
            dst.append(d)
        if len(set(dst)) != len(dst):
            raise ValueError("a destination page is listed twice")
        return src, dst

    def __repr__(self) -> str:
        mode = "cuda side stream" if self._cuda else ("thread" if self._executor else "inline")
        return f"KVCopier({self.kv.num_pages} device pages, {self.host.num_pages} host, {mode})"
