"""LayerLoads: the host-tier loads into a KVPool that are still landing, layer by layer.

A layer-wise load (radixkv.kv.copier.KVCopier with ``layerwise=True``; SGLang HiCache's
layer-wise load) copies a host hit back into device pages one layer at a time, layer 0 first,
and registers itself here, with the pool it writes (``KVPool.loads``). The model's attention
sublayer (radixkv/model/attention.py) calls ``wait(i)`` before layer ``i`` reads or writes the
pool, so the forward of layer ``i`` waits only for layer ``i``'s pages: a long host hit costs
about its slowest layer's copy more than a device hit, not the whole copy.

Contract: after ``wait(i)`` returns, every page of every registered load holds its data in
layer ``i`` (or that load failed, which its handle's ``wait()`` reports: the reader then
discards what it computed from those pages). A load leaves the list when its handle's
``wait()`` (or a ``done()`` that says True) has been called, in the thread that runs the
forward; the copier's own threads never touch the list.
"""

from __future__ import annotations

import time

from radixkv.cache.tiers import LayeredCopyHandle

__all__ = ["LayerLoads"]


class LayerLoads:
    """The layer-wise loads still landing in one KV pool (``pending``, issue order), and the
    seconds forwards waited for them here (``waited_seconds``, cumulative: the engine adds it
    to ``load_back_seconds``; on CUDA the wait is the stream's, so this stays about 0)."""

    __slots__ = ("pending", "waited_seconds")

    def __init__(self) -> None:
        self.pending: list[LayeredCopyHandle] = []
        self.waited_seconds = 0.0

    def add(self, load: LayeredCopyHandle) -> None:
        """Register a load just issued (by the copier)."""
        self.pending.append(load)

    def discard(self, load: LayeredCopyHandle) -> None:
        """Forget a load that has landed or failed (its handle calls this)."""
        if load in self.pending:  # done() may say so more than once
            self.pending.remove(load)

    def wait(self, layer: int) -> None:
        """Return once layer ``layer`` of every pending load has landed (or its load failed)."""
        t = time.perf_counter()
        for load in tuple(self.pending):  # a wait may retire (discard) the load
            load.wait_layer(layer)
        self.waited_seconds += time.perf_counter() - t

    def __len__(self) -> int:
        return len(self.pending)

    def __repr__(self) -> str:
        return f"LayerLoads({len(self.pending)} pending)"
