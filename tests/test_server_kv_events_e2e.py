"""KV events from a live server: a real ZMQ subscriber rebuilds the set of cached blocks from the
stream (filling the slow-joiner gap with the replay socket, as a vLLM subscriber does) and the
result must equal the page hashes of everything in the server's radix cache, through inserts,
evictions (a small pool) and an admin reset.
"""

from __future__ import annotations

import socket
import time

import httpx
import zmq
from server_helpers import MODEL, live_server, wait_drained

from radixkv.cache.hashing import chain_start, page_hashes
from radixkv.server.config import ServerConfig
from radixkv.server.kv_events import END_SEQ, BlockRemoved, BlockSet, BlockStored, decode_batch
from radixkv.server.state import ServerState

ADMIN = "admin-key-0123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cached_block_hashes(st: ServerState) -> set[int]:
    """Page hashes of every cached prefix, computed from the trie itself (engine idle)."""
    cache = st.engine.engine.cache
    out: set[int] = set()
    for node in cache.iter_nodes():
        if not node.pages:
            continue
        parts = []
        n = node
        while n is not None:
            parts.append(list(n.tokens))
            n = n.parent
        tokens = [t for part in reversed(parts) for t in part]
        out.update(page_hashes(tokens, cache.page_size, node.namespace))
    return out


def test_subscriber_rebuilds_cached_blocks() -> None:
    port, rport = _free_port(), _free_port()
    cfg = ServerConfig(
        admin_key=ADMIN,
        kv_events=f"tcp://127.0.0.1:{port}",
        kv_events_replay=f"tcp://127.0.0.1:{rport}",
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    replay = ctx.socket(zmq.DEALER)
    try:
        with (
            live_server(cfg, num_pages=48) as (srv, st),
            httpx.Client(base_url=srv.url, timeout=60) as http,
        ):
            sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            sub.connect(f"tcp://127.0.0.1:{port}")
            replay.connect(f"tcp://127.0.0.1:{rport}")
            page = st.engine.engine.page_size
            live: dict[int, bytes] = {}

            def drain_live() -> None:
                while sub.poll(0):
                    topic, seq_b, payload = sub.recv_multipart()
                    assert topic == b"kv-events" and len(seq_b) == 8
                    live[int.from_bytes(seq_b, "big")] = payload

            def run(prompt: str, salt: str | None = None) -> None:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                if salt:
                    body["cache_salt"] = salt
                assert http.post("/v1/completions", json=body).status_code == 200
                drain_live()

            systems = [f"{g} system prompt for group {g}. " * 10 for g in range(3)]
            for rnd in range(2):
                for g, system in enumerate(systems):
                    for q in range(3):
                        run(system + f"question {rnd}-{q}?", salt="tenant-x" if g == 2 else None)
            stats_before_reset = wait_drained(st)
            assert stats_before_reset.evicted_pages > 0  # the small pool forced evictions
            assert (
                http.post(
                    "/reset_prefix_cache", headers={"Authorization": f"Bearer {ADMIN}"}
                ).status_code
                == 200
            )
            for q in range(3):
                run(systems[0] + f"after reset {q}")
            wait_drained(st)

            # let the publisher flush, then collect what is still in flight
            pub = st.publisher
            assert pub is not None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                drain_live()
                if live and max(live) == pub.next_seq - 1:
                    break
                time.sleep(0.02)
            total = pub.next_seq
            missing = [s for s in range(total) if s not in live]  # the slow-joiner gap, if any
            if missing:
                replay.send_multipart([b"", min(missing).to_bytes(8, "big")])
                while True:
                    assert replay.poll(5000), "replay timed out"
                    _, seq_b, payload = replay.recv_multipart()
                    if seq_b == END_SEQ:
                        break
                    live.setdefault(int.from_bytes(seq_b, "big"), payload)
            assert sorted(live) == list(range(total))

            state = BlockSet()
            starts = {None, chain_start(("", "tenant-x"))}
            stored = removed = 0
            for seq in range(total):
                batch = decode_batch(live[seq])
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        stored += len(ev.block_hashes)
                        assert ev.block_size == page and len(ev.token_ids) == page * len(
                            ev.block_hashes
                        )
                        # chained: a run continues from a block the subscriber already knows, or
                        # starts a sequence (no parent, or its namespace's chain start)
                        assert (
                            ev.parent_block_hash in state.blocks or ev.parent_block_hash in starts
                        )
                    elif isinstance(ev, BlockRemoved):
                        removed += len(ev.block_hashes)
                        assert set(ev.block_hashes) <= state.blocks, (
                            "removal of a block never stored"
                        )
                state.apply(batch)
            assert stored > 0 and removed > 0
            expected = _cached_block_hashes(st)
            assert expected, "the cache should hold something at the end"
            assert state.blocks == expected
            # hashes match the Dynamo-compatible chain over the tokens
            assert len(expected) == st.engine.engine.cache.num_cached_pages
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        ctx.term()
