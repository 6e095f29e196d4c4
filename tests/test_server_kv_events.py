"""KV event wire format and the ZMQ publisher, against a real SUB socket on loopback."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from radixkv.server.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockSet,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    to_wire,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wire_shape_is_vllm_like() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored([11, 12], None, [1, 2, 3, 4], 2, None, "GPU"),
            BlockStored([13], 12, [5, 6], 2, 3, "GPU", "sql"),
            BlockRemoved([11], "GPU"),
            AllBlocksCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(encode_batch(batch))
    # tagged array-like structs inside an array-like batch with a timestamp; lora_name is
    # written even when None, as vLLM writes it (its decoder requires the field)
    assert raw == [
        1.5,
        [
            ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU", None],
            ["BlockStored", [13], 12, [5, 6], 2, 3, "GPU", "sql"],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ],
    ]
    assert decode_batch(encode_batch(batch)) == batch
    # the older 7-field BlockStored (no lora_name) still decodes
    old = msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [7, 8], 2, None, None]]])
    assert decode_batch(old).events == [BlockStored([1], None, [7, 8], 2, None, None)]


def test_to_wire_converts_cache_events_by_name() -> None:
    class BlockStored_:  # stands in for radixkv.cache.events.BlockStored
        def __init__(self) -> None:
            self.block_hashes = [2**64 - 1]
            self.parent_block_hash = 7
            self.token_ids = [5, 6]
            self.page_size = 2
            self.namespace = ("t",)

    BlockStored_.__name__ = "BlockStored"
    wire = to_wire(BlockStored_(), "CPU")
    assert wire == BlockStored([2**64 - 1], 7, [5, 6], 2, None, "CPU")
    # uint64 hashes survive msgpack
    assert decode_batch(encode_batch(KVEventBatch(0.0, [wire]))).events[0] == wire
    assert to_wire(object()) is None
    # an adapter's namespace gets its id and name from the lookup; others get None
    seen = []

    def lora(namespace: object) -> tuple[int, str] | None:
        seen.append(namespace)
        return (4, "sql") if namespace == ("t",) else None

    assert to_wire(BlockStored_(), "CPU", lora) == BlockStored(
        [2**64 - 1], 7, [5, 6], 2, 4, "CPU", "sql"
    )
    other = BlockStored_()
    other.namespace = None
    assert to_wire(other, "CPU", lora) == BlockStored([2**64 - 1], 7, [5, 6], 2, None, "CPU")
    assert seen == [("t",), None]


def _recv_all(sub: zmq.Socket, want: int, timeout: float = 5.0) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        if sub.poll(50):
            got.append(sub.recv_multipart())
    return got


def test_publisher_sequence_and_replay() -> None:
    port, rport = _free_port(), _free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    replay = ctx.socket(zmq.DEALER)
    try:
        with KVEventPublisher(
            f"tcp://127.0.0.1:{port}",
            replay_endpoint=f"tcp://127.0.0.1:{rport}",
            max_batch_events=3,
        ) as pub:
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            sub.connect(f"tcp://127.0.0.1:{port}")
            replay.connect(f"tcp://127.0.0.1:{rport}")
            # Slow joiner: publish probes until the subscription is live, then replay from 0.
            for _ in range(100):
                pub.publish(AllBlocksCleared())
                if sub.poll(50):
                    break
            else:
                pytest.fail("subscriber never connected")
            for i in range(10):
                pub.publish(BlockStored([100 + i], 99 + i if i else None, [i, i], 2, None, None))
            pub.publish(BlockRemoved([100, 101], None))
            # drain live messages until the stream goes quiet
            live = _recv_all(sub, want=10_000, timeout=1.0)
            seqs = [int.from_bytes(f[1], "big") for f in live]
            assert all(f[0] == b"kv-events" and len(f[1]) == 8 for f in live)
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            state = BlockSet()
            expected_seq = 0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                assert replay.poll(2000), "replay timed out"
                empty, seq_b, payload = replay.recv_multipart()
                assert empty == b""
                if seq_b == END_SEQ:
                    break
                seq = int.from_bytes(seq_b, "big")
                assert seq == expected_seq  # gap-free from 0
                expected_seq += 1
                batch = decode_batch(payload)
                assert len(batch.events) <= 3 and batch.ts > 0
                state.apply(batch)
            assert expected_seq == pub.next_seq
            assert state.blocks == {100 + i for i in range(2, 10)}
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        ctx.term()


def test_publisher_rejects_bad_config_and_close_is_idempotent() -> None:
    with pytest.raises(ValueError):
        KVEventPublisher("tcp://127.0.0.1:1", max_batch_events=0)
    pub = KVEventPublisher(f"tcp://127.0.0.1:{_free_port()}")
    pub.close()
    pub.close()
    pub.publish(AllBlocksCleared())  # after close: dropped, no error


def test_to_wire_keeps_the_host_tier_medium() -> None:
    """Host-tier events (medium "CPU") reach the wire with their medium; device events (medium
    None) get the publisher's."""
    from radixkv.cache.events import BlockRemoved as CacheRemoved
    from radixkv.cache.events import BlockStored as CacheStored
    from radixkv.cache.tiers import HOST_MEDIUM

    host = CacheStored(
        block_hashes=[1], parent_block_hash=None, token_ids=[5, 6], page_size=2, medium=HOST_MEDIUM
    )
    dev = CacheStored(block_hashes=[2], parent_block_hash=1, token_ids=[7, 8], page_size=2)
    assert to_wire(host, "GPU").medium == "CPU"
    assert to_wire(dev, "GPU").medium == "GPU"
    assert to_wire(dev).medium is None
    assert to_wire(CacheRemoved(block_hashes=[1], medium=HOST_MEDIUM), "GPU").medium == "CPU"
    assert to_wire(CacheRemoved(block_hashes=[2]), "GPU").medium == "GPU"
