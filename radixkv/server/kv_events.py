"""KV cache events for KV-aware routers, on the wire the way vLLM publishes them.

Wire format (so a vLLM/Dynamo/llm-d subscriber decodes it unchanged):
- payload: msgspec msgpack of ``KVEventBatch`` = array ``[ts, [event, ...]]``; each event is a
  tagged array-like struct ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]`` or
  ``["AllBlocksCleared"]``; ``lora_id`` and ``lora_name`` name the LoRA adapter whose KV the
  blocks hold (None for the base model): its slot, unique per load, and its served name, as
  vLLM sends its ``lora_int_id`` and its name (KV-aware routers key blocks by the name);
- PUB socket, multipart ``[topic, seq (8 bytes, big-endian, from 0, +1 per batch), payload]``;
- optional ROUTER replay socket: a client sends ``[b"", start_seq (8 bytes)]`` (a REQ or DEALER
  socket) and gets ``[b"", seq, payload]`` for every buffered batch with seq >= start_seq,
  then ``[b"", (-1 as 8 signed bytes), b""]``.

Block hashes are the cache's own per-page chained hashes (``radixkv.cache.hashing.page_hashes``:
parent hash, page tokens, namespace), so tenants never share a hash.

Threading: ``publish`` (and ``listener``, what ``cache.add_listener`` gets) may be called from any
thread: it only converts and enqueues. One background thread owns the ZMQ sockets (they are not
thread-safe), batches whatever is queued and sends it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

log = logging.getLogger("radixkv.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the wire events; the tag is the class name."""


class BlockStored(KVCacheEvent, omit_defaults=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # always written (vLLM's decoder requires it); the default decodes the older 7-field form
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


def _medium(event: Any, default: str | None) -> str | None:
    own = getattr(event, "medium", None)
    return own if own is not None else default


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


# what a publisher is told about an event's namespace: (lora_id, lora_name) of the adapter
# whose KV it holds, None for the base model
LoRALookup = Callable[[Any], "tuple[int, str] | None"]


def to_wire(
    event: Any, medium: str | None = None, lora: LoRALookup | None = None
) -> WireEvent | None:
    """Convert a cache event (radixkv.cache.events) to its wire form; None for unknown kinds.

    ``medium`` names the device pool; an event that names its own medium (the host tier's
    "CPU", radixkv.cache.tiers.HOST_MEDIUM) keeps it. ``lora`` maps a stored event's
    namespace to its adapter's ``(lora_id, lora_name)`` (None: none, or no lookup).

    Matched by class name so this module does not import the cache (and stays importable alone).
    """
    kind = type(event).__name__
    if kind == "BlockStored":
        adapter = None if lora is None else lora(getattr(event, "namespace", None))
        return BlockStored(
            block_hashes=[int(h) for h in event.block_hashes],
            parent_block_hash=None
            if event.parent_block_hash is None
            else int(event.parent_block_hash),
            token_ids=[int(t) for t in event.token_ids],
            block_size=int(getattr(event, "page_size", getattr(event, "block_size", 0))),
            lora_id=None if adapter is None else adapter[0],
            medium=_medium(event, medium),
            lora_name=None if adapter is None else adapter[1],
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=[int(h) for h in event.block_hashes], medium=_medium(event, medium)
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


class KVEventPublisher:
    """ZMQ PUB publisher of KV event batches (see module doc for the wire format).

    ``endpoint`` e.g. ``tcp://127.0.0.1:5557`` (bound). ``replay_endpoint`` optional, bound as a
    ROUTER; the last ``buffer_batches`` batches are kept for replay. ``lora``: see ``to_wire``
    (called in the thread that emits the cache event). ``close()`` flushes what is queued, then
    stops the thread and closes the sockets; it is idempotent.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "kv-events",
        replay_endpoint: str | None = None,
        buffer_batches: int = 10_000,
        max_batch_events: int = 256,
        medium: str | None = None,
        lora: LoRALookup | None = None,
    ) -> None:
        try:
            import zmq  # optional dependency (radixkv[events]); imported only when events are on
        except ImportError:
            raise ImportError("KV events need pyzmq: pip install 'radixkv[events]'") from None

        if max_batch_events < 1 or buffer_batches < 1:
            raise ValueError("max_batch_events and buffer_batches must be >= 1")
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.medium = medium
        self.lora = lora
        self._max_batch = max_batch_events
        self._queue: queue.SimpleQueue[WireEvent | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ producer side (any thread)
    def publish(self, event: WireEvent) -> None:
        if not self._closed:
            self._queue.put(event)

    def listener(self, cache_event: Any) -> None:
        """Pass to ``cache.add_listener``: converts and enqueues, never blocks the engine."""
        wire = to_wire(cache_event, self.medium, self.lora)
        if wire is not None:
            self.publish(wire)

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch will carry (= batches sent so far)."""
        return self._seq

    # ------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        import zmq

        stop = False
        while not stop:
            try:
                first = self._queue.get(timeout=0.02)
            except queue.Empty:
                first = ...
            events: list[WireEvent] = []
            if first is None:
                stop = True
            elif first is not ...:
                events.append(first)
            # drain what else is queued (bounded) into the same batch
            while not stop and len(events) < self._max_batch:
                try:
                    ev = self._queue.get_nowait()
                except queue.Empty:
                    break
                if ev is None:
                    stop = True
                else:
                    events.append(ev)
            try:
                if events:
                    self._send(events)
                if self._replay is not None:
                    while self._replay.poll(0, zmq.POLLIN):
                        self._serve_replay()
            except Exception:  # never let one bad send kill the publisher
                log.exception("KV event publisher error")
        # flush leftovers that raced with close
        leftovers: list[WireEvent] = []
        while True:
            try:
                ev = self._queue.get_nowait()
            except queue.Empty:
                break
            if ev is not None:
                leftovers.append(ev)
        for i in range(0, len(leftovers), self._max_batch):
            with contextlib.suppress(Exception):
                self._send(leftovers[i : i + self._max_batch])
        self._close_sockets()

    def _send(self, events: list[WireEvent]) -> None:
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)
        self._ctx.term()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockSet:
    """What a subscriber knows: the set of cached block hashes, rebuilt from event batches."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.next_seq = 0

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.blocks.difference_update(ev.block_hashes)
            else:
                self.blocks.clear()
