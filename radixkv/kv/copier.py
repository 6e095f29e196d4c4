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

Layer-wise loads (``layerwise=True``; off by default, EngineConfig.host_layerwise_load says
when it pays; SGLang HiCache's layer-wise load): a load
(``to_device``) copies layer 0 of every page, then layer 1, and so on, and its handle is a
radixkv.cache.tiers.LayeredCopyHandle registered in the device pool's ``loads``
(radixkv/kv/layer_loads.py), so that a forward may start at once and wait, layer by layer,
only for the layer it is about to read: on the CPU, the background thread counts the layers
landed (a condition variable the forward waits on); on CUDA, one event per layer is recorded on
the side stream and the forward's stream waits for it (no host wait). Backups (``to_host``)
move whole pages as before: nothing waits for them layer by layer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixkv.cache.tiers import CompletedCopy
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool, movable
from radixkv.kv.layer_loads import LayerLoads

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


class _LayeredCopy:
    """Handle of a layer-wise load on the background thread (a LayeredCopyHandle).

    The thread calls ``landed()`` after each layer, in order, then ``finish(error)`` once
    (also after a failure, so that no ``wait_layer`` waits for a layer that will never land).
    ``wait()`` and a ``done()`` that says True take the load off the pool's ``loads``.
    """

    __slots__ = ("_cond", "_error", "_finished", "_landed", "_loads")

    def __init__(self, loads: LayerLoads) -> None:
        self._cond = threading.Condition()
        self._landed = 0  # layers whose pages all hold their data
        self._finished = False
        self._error: BaseException | None = None
        self._loads = loads

    # ---- the copier's thread
    def landed(self) -> None:
        with self._cond:
            self._landed += 1
            self._cond.notify_all()

    def finish(self, error: BaseException | None) -> None:
        with self._cond:
            self._error = error
            self._finished = True
            self._cond.notify_all()

    # ---- the caller's thread
    def wait_layer(self, layer: int) -> None:
        if self._landed > layer or self._finished:  # plain reads: only ever grow
            return
        with self._cond:
            while self._landed <= layer and not self._finished:
                self._cond.wait()

    def done(self) -> bool:
        if self._finished:
            self._loads.discard(self)
            return True
        return False

    def wait(self) -> None:
        with self._cond:
            while not self._finished:
                self._cond.wait()
        self._loads.discard(self)
        if self._error is not None:
            raise self._error


class _CudaLayeredCopy:
    """Handle of a layer-wise load on the side stream: one event per layer, recorded when
    issued; ``wait_layer`` makes the caller's current stream wait for one (a LayeredCopyHandle)."""

    __slots__ = ("_device", "_events", "_loads")

    def __init__(self, events: list[Any], device: Any, loads: LayerLoads) -> None:
        self._events = events
        self._device = device
        self._loads = loads

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def done(self) -> bool:
        if self._events[-1].query():  # one stream: the last layer's event passes last
            self._loads.discard(self)
            return True
        return False

    def wait(self) -> None:
        self._events[-1].synchronize()
        self._loads.discard(self)


class KVCopier:
    """Copies pages between ``kv`` (device) and ``host`` for a RadixCache's host tier.

    Args:
        kv: the device pool (the pages of ``RadixCache.pool``).
        host: the host pool (the pages of ``RadixCache.host_pool``); same page shape and dtype.
        background: CPU pools only: run copies on a background thread (default). False runs
            each copy in the calling thread before returning (a completed handle), which is
            simpler to debug and what a caller that would wait at once anyway wants.
        layerwise: loads land layer by layer (see the module docstring) and register in
            ``kv.loads``; False (default): a load is one copy of every layer, waited for as a
            whole. Without a background thread on a CPU pool loads are done when issued, so
            this changes nothing there.
    """

    def __init__(
        self,
        kv: KVPool,
        host: HostKVPool,
        *,
        background: bool = True,
        layerwise: bool = False,
    ) -> None:
        if not isinstance(kv, KVPool):
            raise TypeError(f"kv must be a KVPool, got {type(kv).__name__}")
        if not isinstance(host, HostKVPool):
            raise TypeError(f"host must be a HostKVPool, got {type(host).__name__}")
        if not host.matches(kv):
            raise ValueError(f"host pages are not shaped like the device pool's: {host} vs {kv}")
        if not isinstance(layerwise, bool):
            raise TypeError(f"layerwise must be a bool, got {layerwise!r}")
        self.kv = kv
        self.host = host
        self.layerwise = layerwise
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
            if self.layerwise and src:
                return self._cuda_to_device_layers(src, dst)
            return self._cuda_to_device(src, dst)
        if self.layerwise and src and self._executor is not None:
            handle = _LayeredCopy(self.kv.loads)
            self._executor.submit(self._cpu_to_device_layers, handle, src, dst)
            self.kv.loads.add(handle)  # after submit: a refused submit issues nothing
            return handle
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

    # Layer by layer, each layer's pages are contiguous blocks on the device side: 2-3x faster
    # than one copy of every layer through a transposed [L, n, ...] view (2 cores, fp32).
    def _cpu_to_host(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        for layer in range(self.kv.num_layers):  # into the page-major host layout
            self._hk.select(1, layer).index_copy_(0, d, self._dk[layer].index_select(0, s))
            self._hv.select(1, layer).index_copy_(0, d, self._dv[layer].index_select(0, s))

    def _cpu_to_device(self, src: list[int], dst: list[int]) -> None:
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dst, dtype=torch.long)
        for layer in range(self.kv.num_layers):
            self._copy_layer(layer, s, d)

    def _cpu_to_device_layers(self, handle: _LayeredCopy, src: list[int], dst: list[int]) -> None:
        """The background thread's half of a layer-wise load: layer 0 first; tells ``handle``
        of each layer landed, then that the copy is over (with its error, if it failed)."""
        error: BaseException | None = None
        try:
            s = torch.tensor(src, dtype=torch.long)
            d = torch.tensor(dst, dtype=torch.long)
            for layer in range(self.kv.num_layers):
                self._copy_layer(layer, s, d)
                handle.landed()
        except BaseException as e:  # reported by handle.wait(); wait_layer stops waiting
            error = e
        handle.finish(error)

    def _copy_layer(self, layer: int, s: torch.Tensor, d: torch.Tensor) -> None:
        """Copy layer ``layer`` (K and V) of host pages ``s`` to device pages ``d`` (CPU)."""
        self._dk[layer].index_copy_(0, d, self._hk.select(1, layer).index_select(0, s))
        self._dv[layer].index_copy_(0, d, self._hv.select(1, layer).index_select(0, s))

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

    def _cuda_to_device_layers(self, src: list[int], dst: list[int]) -> _CudaLayeredCopy:
        """A layer-wise load on the side stream: per layer, each page's K and V of that layer
        (one contiguous pinned block each) straight into its device page, then an event."""
        stream = self._stream
        device = self.kv.device
        stream.wait_stream(torch.cuda.current_stream(device))  # pages' last readers
        events = []
        with torch.cuda.stream(stream):
            for layer in range(self.kv.num_layers):
                dk, dv = self._dk[layer], self._dv[layer]
                hk, hv = self._hk.select(1, layer), self._hv.select(1, layer)
                for h, d in zip(src, dst):
                    dk[d].copy_(hk[h], non_blocking=True)
                    dv[d].copy_(hv[h], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        handle = _CudaLayeredCopy(events, device, self.kv.loads)
        self.kv.loads.add(handle)
        return handle

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
        if self.layerwise and (self._cuda or self._executor):
            mode += ", layer-wise loads"
        return f"KVCopier({self.kv.num_pages} device pages, {self.host.num_pages} host, {mode})"
