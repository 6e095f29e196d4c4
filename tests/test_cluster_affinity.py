"""Prefix-affinity scoring without Ray: hashes, ranking, load guards, the trie summary, hints,
and the fleet-wide cache reset's fan-out and router bookkeeping (with a stand-in handle)."""

from __future__ import annotations

import asyncio
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.hashing import page_hashes
from radixkv.cache.page_pool import PagePool
from radixkv.cache.radix_cache import RadixCache
from radixkv.cluster.affinity import (
    AffinityConfig,
    AffinityState,
    ReplicaSummary,
    longest_chain,
)
from radixkv.cluster.fanout import (
    call_every_replica,
    reset_report,
    reset_versions,
    update_report,
)
from radixkv.cluster.hinting import PromptHasher, load_tokenizer
from radixkv.cluster.live import forget_prefixes, track
from radixkv.cluster.summary import CacheSummary
from radixkv.server.auth import load_api_keys

PS = 4


def dynamo_hashes(tokens: list[int], page_size: int) -> list[int]:
    """Dynamo's KV-router block hashes, written out independently of radixkv.cache.hashing."""
    out: list[int] = []
    for i in range(len(tokens) // page_size):
        page = np.asarray(tokens[i * page_size : (i + 1) * page_size], dtype="<u4").tobytes()
        local = xxhash.xxh3_64_intdigest(page, seed=1337)
        seq = (
            local if not out else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), 1337)
        )
        out.append(seq)
    return out


def test_page_hashes_are_dynamo_compatible() -> None:
    rng = random.Random(0)
    for n in (0, 3, 16, 17, 64, 100):
        toks = [rng.randrange(0, 200_000) for _ in range(n)]
        assert page_hashes(toks, 16) == dynamo_hashes(toks, 16)
    toks = list(range(40))
    assert page_hashes(toks, 16, namespace="t") != page_hashes(toks, 16)


def test_longest_chain_takes_the_deepest_held_hash() -> None:
    h = [11, 12, 13, 14]
    assert longest_chain(h, set()) == 0
    assert longest_chain(h, {11}) == 1
    assert longest_chain(h, {13}) == 3  # a chained hash names its whole prefix
    assert longest_chain(h, {11, 12, 13, 14, 99}) == 4
    assert longest_chain([], {1}) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"imbalance_abs": -1},
        {"imbalance_rel": 0.5},
        {"min_match_pages": 0},
        {"min_match_ratio": 1.5},
        {"recent_per_replica": -1},
        {"provisional_ttl_s": 0},
    ],
)
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AffinityConfig(**kwargs)
    with pytest.raises(TypeError):
        AffinityConfig(imbalance_abs=1.5)  # type: ignore[arg-type]


def summary(hashes: list[int], *, cached: int | None = None, queue: int = 0) -> dict:
    return ReplicaSummary(
        block_hashes=hashes,
        cached_tokens=len(hashes) * PS if cached is None else cached,
        queue_len=queue,
        page_size=PS,
    ).to_stats()


def test_stats_affinity_picks_the_longest_match_and_ranks_everyone() -> None:
    s = AffinityState()
    h = page_hashes(list(range(32)), PS)  # 8 pages
    s.update_stats("a", summary(h[:2]))
    s.update_stats("b", summary(h[:6]))
    s.update_stats("c", summary([]))
    d = s.rank(["a", "b", "c"], h)
    assert d.order[0] == "b" and d.reason == "affinity"
    assert sorted(d.order) == ["a", "b", "c"]
    assert d.order.index("a") < d.order.index("c")
    assert d.match_pages == {"a": 2, "b": 6, "c": 0}


def test_router_record_gives_affinity_before_stats_arrive() -> None:
    s = AffinityState()
    h = page_hashes(list(range(40)), PS)
    first = s.rank(["a", "b", "c"], h)
    assert first.reason == "weak"  # nobody holds it yet
    s.picked("r1", first.order[0], h)
    again = s.rank(["a", "b", "c"], h)
    assert again.order[0] == first.order[0] and again.reason == "affinity"
    # Ray confirmed another replica: both now count as holders, the actual one is not loaded more
    s.routed("r1", "c")
    assert s.load("c") == 1 and s.load(first.order[0]) == (1 if first.order[0] == "c" else 0)
    s.completed("r1", "c")
    assert s.load("c") == 0


def test_weak_match_goes_to_least_cached() -> None:
    s = AffinityState(AffinityConfig(min_match_pages=2, min_match_ratio=0.5))
    h = page_hashes(list(range(40)), PS)  # 10 pages
    s.update_stats("a", summary(h[:1], cached=800))  # 1 page: weak
    s.update_stats("b", summary([], cached=400))
    s.update_stats("c", summary([], cached=100))
    assert s.rank(["a", "b", "c"], h).order == ["c", "b", "a"]
    # a 5-page match is strong
    s.update_stats("a", summary(h[:5], cached=800))
    d = s.rank(["a", "b", "c"], h)
    assert d.order[0] == "a" and d.reason == "affinity"


def test_new_prefixes_spread_by_cached_estimate() -> None:
    s = AffinityState()
    owners = []
    for g in range(4):
        h = page_hashes([1000 * g + i for i in range(64)], PS)
        d = s.rank(["a", "b", "c", "d"], h)
        s.picked(f"r{g}", d.order[0], h)
        s.routed(f"r{g}", d.order[0])
        s.completed(f"r{g}", d.order[0])
        owners.append(d.order[0])
    assert sorted(owners) == ["a", "b", "c", "d"]  # each new group on an empty replica


def test_imbalance_falls_back_to_least_loaded_and_spreads_a_hot_prefix() -> None:
    s = AffinityState(AffinityConfig(imbalance_abs=2, imbalance_rel=1.5))
    h = page_hashes(list(range(64)), PS)
    replicas = ["a", "b", "c", "d"]
    for r in replicas:
        s.update_stats(r, summary([]))
    chosen = []
    for i in range(12):  # nothing completes: load piles up
        d = s.rank(replicas, h)
        s.picked(f"r{i}", d.order[0], h)
        s.routed(f"r{i}", d.order[0])
        chosen.append(d.order[0])
    assert chosen[:3] == [chosen[0]] * 3  # affinity holds while within the thresholds
    assert len(set(chosen)) == 4  # then the hot prefix spreads over the fleet
    loads = [s.load(r) for r in replicas]
    assert max(loads) - min(loads) <= 3


def test_both_thresholds_must_trip() -> None:
    h = page_hashes(list(range(64)), PS)
    s = AffinityState(AffinityConfig(imbalance_abs=1, imbalance_rel=10.0))
    s.update_stats("a", summary(h, queue=8))
    s.update_stats("b", summary([], queue=1))
    assert s.rank(["a", "b"], h).order[0] == "a"  # 8 <= 10 * 1: relative test holds
    s.update_stats("a", summary(h, queue=11))
    d = s.rank(["a", "b"], h)
    assert d.order == ["b", "a"] and d.reason == "imbalance"
    s2 = AffinityState(AffinityConfig(imbalance_abs=20, imbalance_rel=1.0))
    s2.update_stats("a", summary(h, queue=15))
    s2.update_stats("b", summary([], queue=0))
    assert s2.rank(["a", "b"], h).order[0] == "a"  # absolute gap 15 <= 20


def test_no_prefix_requests_balance_load() -> None:
    s = AffinityState()
    s.update_stats("a", summary([], queue=3))
    s.update_stats("b", summary([], queue=1))
    d = s.rank(["a", "b"], [])
    assert d.order == ["b", "a"] and d.reason == "no-prefix"
    assert s.rank([], [1]).order == []


def test_dead_replicas_are_forgotten_and_bad_stats_ignored() -> None:
    s = AffinityState()
    h = page_hashes(list(range(16)), PS)
    s.picked("r", "a", h)
    s.routed("r", "a")
    assert s.load("a") == 1
    s.remove_replica("a")
    assert s.load("a") == 0 and longest_chain(h, s.holds("a")) == 0
    s.completed("r")  # after the replica is gone: a no-op
    s.update_stats("b", {"block_hashes": "not a list"})
    s.update_stats("b", None)
    assert s.cached_estimate("b") == 0
    s.picked("x", "b", h)
    s.set_replicas(["c"])
    assert s.load("b") == 0


def test_provisional_picks_expire() -> None:
    now = [0.0]
    s = AffinityState(AffinityConfig(provisional_ttl_s=5.0), clock=lambda: now[0])
    s.picked("r", "a", [1, 2])
    assert s.load("a") == 1
    now[0] = 10.0
    s.rank(["a"], [1])
    assert s.load("a") == 0


def test_cache_summary_tracks_the_trie_through_events() -> None:
    cache = RadixCache(PagePool(16), page_size=PS)
    summ = CacheSummary(PS, max_hashes=3)
    cache.add_listener(summ.listener)
    a = list(range(12))  # 3 pages
    b = [*range(8), 100, 101, 102, 103]  # shares 2 pages with a
    cache.insert(a, cache.alloc(3))
    cache.insert(b, cache.alloc(3))  # the 2 shared pages are duplicates: the cache frees them
    want = set(page_hashes(a, PS)) | set(page_hashes(b, PS))
    assert len(summ) == len(want) and all(h in summ for h in want)
    snap = summ.snapshot(queue_len=2, replica="x")
    assert snap.block_hashes[0] == page_hashes(b, PS)[-1]  # most recently stored first
    assert len(snap.block_hashes) == 3 and snap.truncated
    assert snap.cached_tokens == 4 * PS and snap.queue_len == 2
    assert ReplicaSummary.from_stats(snap.to_stats()) == snap
    cache.evict(16)
    assert len(summ) == 0 and summ.snapshot().cached_tokens == 0
    cache.insert(a, cache.alloc(3))
    cache.reset()
    assert len(summ) == 0
    # host-tier events (medium "CPU") do not change the device summary
    summ.listener(BlockStored(page_hashes(a, PS), None, a, PS, None, "CPU"))
    assert len(summ) == 0
    summ.listener(BlockStored(page_hashes(a, PS), None, a, PS))
    summ.listener(BlockRemoved(page_hashes(a, PS), None, "CPU"))
    assert len(summ) == 3
    with pytest.raises(ValueError):
        CacheSummary(0)


def test_prompt_hasher_matches_the_server_tokenization() -> None:
    tok = load_tokenizer("radixkv-tiny")
    hasher = PromptHasher(tok, 16)
    prompt = "hello world " * 10
    h = hasher.hint("/v1/completions", None, b'{"model": "m", "prompt": "%s"}' % prompt.encode())
    assert h.hashes == page_hashes(tok.encode(prompt), 16) and h.num_tokens == len(
        tok.encode(prompt)
    )
    assert not h.stream
    ids = list(range(40))
    h = hasher.hint(
        "/v1/completions", None, b'{"model": "m", "prompt": %s, "stream": true}' % str(ids).encode()
    )
    assert h.hashes == page_hashes(ids, 16) and h.stream
    msgs = [{"role": "user", "content": "x" * 50}]
    body = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % (b"x" * 50)
    text = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want = page_hashes(tok.encode(text, add_special_tokens=False), 16)
    assert hasher.hint("/v1/chat/completions", None, body).hashes == want and want
    # a response runs as that chat: the same hashes; a continuation's history is not known
    body = b'{"model": "m", "input": "%s", "stream": true}' % (b"x" * 50)
    h = hasher.hint("/v1/responses", None, body)
    assert h.hashes == want and h.stream
    cont = b'{"model": "m", "input": "y", "previous_response_id": "resp_1"}'
    assert hasher.hint("/v1/responses", None, cont).hashes == []
    # scoring: the first item's prompt (query + item: the query's pages lead every item's)
    body = b'{"model": "m", "query": "%s", "items": ["a", "b"], "label_token_ids": [5]}' % (
        b"q" * 40
    )
    h = hasher.hint("/v1/score", None, body)
    assert h.hashes == page_hashes(tok.encode("q" * 40 + "a"), 16) and h.hashes and not h.stream
    body = (
        b'{"model": "m", "query": %s, "items": [[7, 8]], "label_token_ids": [5]}'
        % str(ids).encode()
    )
    assert hasher.hint("/v1/score", None, body).hashes == page_hashes([*ids, 7, 8], 16)
    bad_score = b'{"model": "m", "query": "q", "items": [[1]], "label_token_ids": [5]}'
    assert hasher.hint("/v1/score", None, bad_score).hashes == []  # the replica answers 400
    # Anthropic's messages: the chat they run as (the system prompt a system message)
    body = (
        b'{"model": "m", "max_tokens": 4, "system": "s", "messages": [{"role": "user", "content": "%s"}]}'
        % (b"x" * 50)
    )
    chat = [{"role": "system", "content": "s"}, *msgs]
    text = tok.apply_chat_template(chat, add_generation_prompt=True)
    want = page_hashes(tok.encode(text, add_special_tokens=False), 16)
    assert hasher.hint("/v1/messages", None, body).hashes == want and want
    bad_msgs = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}'
    assert hasher.hint("/v1/messages", None, bad_msgs).hashes == []
    # unparsable or non-generation requests: no hint, never an exception
    assert hasher.hint("/v1/completions", None, b"{bad").hashes == []
    assert hasher.hint("/v1/models", None, b"").hashes == []
    # tenants: the namespace the server would use, and no hint for a bad key
    keyed = PromptHasher(tok, 16, api_keys={"key-alice-1": "alice"})
    body = b'{"model": "m", "prompt": %s, "cache_salt": "s"}' % str(ids).encode()
    assert keyed.hint("/v1/completions", "Bearer key-alice-1", body).hashes == page_hashes(
        ids, 16, ("alice", "s")
    )
    assert keyed.hint("/v1/completions", "Bearer wrong-key-1", body).hashes == []


def test_prompt_hasher_follows_the_key_file(tmp_path: Path) -> None:
    """serve-ray's ingress re-reads --api-keys as the replicas do: a removed key gets no hint
    (the replica answers 401), a new key's prompts hash in its tenant's namespace."""
    tok = load_tokenizer("radixkv-tiny")
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-alice-1": "alice"}))
    hasher = PromptHasher(tok, 16, api_keys=load_api_keys(keys), keys_file=str(keys))
    ids = list(range(1, 40))
    body = b'{"model": "m", "prompt": %s}' % str(ids).encode()
    assert hasher.hint("/v1/completions", "Bearer key-alice-1", body).hashes == page_hashes(
        ids, 16, ("alice",)
    )
    keys.write_text(json.dumps({"key-bob-12345": "bob"}))  # another size: a new version
    assert hasher.hint("/v1/completions", "Bearer key-alice-1", body).hashes == []
    assert hasher.hint("/v1/completions", "Bearer key-bob-12345", body).hashes == page_hashes(
        ids, 16, ("bob",)
    )


def test_prompt_hasher_hashes_an_adapters_requests_as_the_engine_caches_them(
    tmp_path: Path,
) -> None:
    """A request whose model is a LoRA adapter is hashed in the adapter's namespace, keyed by the
    digest of its files: the hashes equal those the engine publishes when it caches the prompt
    with that adapter (so the router finds the replica holding it), and differ from the base
    model's for the same tokens."""
    from radixkv.engine.engine import Engine
    from radixkv.model.lora import adapter_digest, save_random_adapter
    from radixkv.model.tiny import tiny_config

    folder = save_random_adapter(tiny_config(), tmp_path / "ad", seed=0)
    tok = load_tokenizer("radixkv-tiny")
    hasher = PromptHasher(tok, 16, lora_digests={"ad": adapter_digest(folder)})
    ids = list(range(3, 60))
    hint = hasher.hint(
        "/v1/completions", None, b'{"model": "ad", "prompt": %s}' % str(ids).encode()
    )
    base = hasher.hint("/v1/completions", None, b'{"model": "m", "prompt": %s}' % str(ids).encode())
    assert len(hint.hashes) == 3 and set(hint.hashes).isdisjoint(base.hashes)
    eng = Engine("radixkv-tiny", page_size=16, num_pages=64, lora_modules={"ad": str(folder)})
    stored: list[int] = []
    eng.cache.add_listener(lambda e: stored.extend(getattr(e, "block_hashes", [])))
    eng.generate([ids], use_tqdm=False, lora="ad")
    assert stored[:3] == hint.hashes


def test_reset_forgets_a_replicas_prefixes_and_ignores_stale_stats() -> None:
    s = AffinityState()
    h = page_hashes(list(range(32)), PS)
    s.update_stats("a", {**summary(h, queue=0), "version": 5})
    s.picked("r1", "b", h)
    s.routed("r1", "b")  # still running on b when the reset comes
    assert s.rank(["a", "b"], h).match_pages == {"a": 8, "b": 8}
    s.forget_prefixes("a", min_version=7)
    s.forget_prefixes("b", min_version=2)
    assert s.rank(["a", "b"], h).match_pages == {"a": 0, "b": 0}
    assert s.cached_estimate("a") == s.cached_estimate("b") == 0
    assert s.load("b") == 1  # the running request still counts
    s.update_stats("a", {**summary(h), "version": 6})  # published before the reset: stale
    assert s.cached_estimate("a") == 0 and longest_chain(h, s.holds("a")) == 0
    s.update_stats("a", {**summary(h[:2]), "version": 7})  # after it: taken
    assert longest_chain(h, s.holds("a")) == 2 and s.cached_estimate("a") == 2 * PS
    t = track(AffinityState())
    t.picked("r2", "c", h)
    assert forget_prefixes({"c": 1}) >= 1  # every tracked state in the process is told
    assert t.snapshot()["c"]["recent"] == 0 and t.snapshot()["c"]["provisional"] == 1


class _FakeMethod:
    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.cancelled: list[str] = []

    def remote(self, *, pin_replica: str) -> object:
        got = self.answers[pin_replica]
        if isinstance(got, list):  # one answer per call, in order
            got = got.pop(0)
        cancelled = self.cancelled

        class _Response:
            def cancel(self) -> None:
                cancelled.append(pin_replica)

            def __await__(self):  # type: ignore[no-untyped-def]
                if got == "hang":
                    yield from asyncio.sleep(10).__await__()
                if isinstance(got, BaseException):
                    raise got
                return got

        return _Response()


def test_reset_fanout_reports_each_replica_and_survives_failures() -> None:
    names = [f"SERVE_REPLICA::app#RadixKVReplica#{u}" for u in ("u1", "u2", "u3", "u4")]
    method = _FakeMethod(
        {
            "u1": {"replica": names[0], "version": 3, "cached_pages": 0},
            "u2": RuntimeError("ActorDiedError: the actor died"),
            "u3": {"replica": names[0], "version": 4},  # the pin missed: another replica answered
            "u4": "hang",
        }
    )
    handle = type("H", (), {"reset_prefix_cache": method})()
    res = asyncio.run(call_every_replica(handle, "reset_prefix_cache", names, timeout_s=0.2))
    assert list(res.answers) == [names[0]] and reset_versions(res) == {"u1": 3}
    assert set(res.failed) == set(names[1:]) and method.cancelled == ["u4"]
    assert "died" in res.failed[names[1]] and "answered by" in res.failed[names[2]]
    status, body = reset_report(res)
    assert status == 503 and body["status"] == "partial"
    assert body["replicas"] == 4 and body["reset"] == 1 and len(body["failed"]) == 3
    assert body["error"]["code"] == "replica_unavailable"
    method.answers = {u: {"replica": n, "version": 1} for u, n in zip(["u1", "u2"], names)}
    ok = asyncio.run(call_every_replica(handle, "reset_prefix_cache", names[:2]))
    assert reset_report(ok) == (
        200,
        {"status": "ok", "replicas": 2, "reset": 2, "reset_replicas": names[:2], "failed": []},
    )
    none = asyncio.run(call_every_replica(handle, "reset_prefix_cache", []))
    assert reset_report(none)[0] == 503 and reset_report(none)[1]["status"] == "failed"


def test_a_pin_answered_by_another_replica_is_asked_again() -> None:
    names = [f"SERVE_REPLICA::app#RadixKVReplica#{u}" for u in ("u1", "u2")]
    method = _FakeMethod(
        {
            "u1": {"replica": names[0], "version": 1},
            # the router's candidates lacked u2 twice (another replica answered), then found it
            "u2": [{"replica": names[0]}, {"replica": names[0]}, {"replica": names[1]}],
        }
    )
    handle = type("H", (), {"reset_prefix_cache": method})()
    res = asyncio.run(call_every_replica(handle, "reset_prefix_cache", names, timeout_s=5))
    assert sorted(res.answers) == names and res.failed == {}
    assert method.answers["u2"] == []  # asked three times
    method.answers["u2"] = [{"replica": names[0]}] * 10  # never reachable: the miss is reported
    res = asyncio.run(call_every_replica(handle, "reset_prefix_cache", names, timeout_s=5))
    assert list(res.answers) == [names[0]] and "4 attempts" in res.failed[names[1]]


def test_weight_update_fanout_report() -> None:
    """All updated: SGLang's answer, paused requests summed. The same refusal everywhere (a bad
    checkpoint): that answer, nothing changed. Mixed or unreachable: 503, mixed weights."""
    names = [f"SERVE_REPLICA::app#RadixKVReplica#{u}" for u in ("u1", "u2")]

    def ok(n: str, paused: int) -> dict[str, object]:
        body = {"success": True, "message": "Succeeded: v2", "num_paused_requests": paused}
        return {"replica": n, "version": 2, "status": 200, "body": json.dumps(body)}

    bad = json.dumps({"success": False, "message": "no such folder", "num_paused_requests": 0})

    def report(answers: dict[str, object]) -> tuple[int, dict[str, object]]:
        class Method(_FakeMethod):
            def remote(self, *, pin_replica: str, **kwargs: object) -> object:
                assert kwargs == {"request": "fwd"}
                return super().remote(pin_replica=pin_replica)

        handle = type("H", (), {"serve_on_replica": Method(answers)})()
        res = asyncio.run(
            call_every_replica(handle, "serve_on_replica", names, timeout_s=0.2, request="fwd")
        )
        return update_report(res)

    status, body = report({"u1": ok(names[0], 1), "u2": ok(names[1], 2)})
    assert status == 200 and body["success"] is True and body["num_paused_requests"] == 3
    assert body["updated"] == 2 and body["failed"] == [] and "v2" in str(body["message"])
    refused = {n: {"replica": n, "status": 400, "body": bad} for n in names}
    status, body = report({"u1": refused[names[0]], "u2": refused[names[1]]})
    assert status == 400 and body["success"] is False and body["message"] == "no such folder"
    assert body["updated"] == 0 and len(body["failed"]) == 2
    # a refusal is the answer even with a replica gone (no one updated: nothing is mixed)
    status, body = report({"u1": refused[names[0]], "u2": RuntimeError("ActorDiedError")})
    assert status == 400 and body["message"] == "no such folder" and body["updated"] == 0
    assert [f["replica"] for f in body["failed"]] == names
    status, body = report({"u1": RuntimeError("ActorDiedError"), "u2": RuntimeError("gone")})
    assert status == 503 and body["success"] is False and body["updated"] == 0
    status, body = report({"u1": ok(names[0], 0), "u2": RuntimeError("ActorDiedError")})
    assert status == 503 and body["success"] is False and "mixed weights" in str(body["message"])
    assert body["updated_replicas"] == [names[0]] and body["failed"][0]["replica"] == names[1]


class _RecordingMethod(_FakeMethod):
    """Also records the Serve request context each call was started in."""

    def __init__(self, answers: dict[str, object]) -> None:
        super().__init__(answers)
        self.contexts: list[tuple[str, str]] = []

    def remote(self, *, pin_replica: str) -> object:
        from ray.serve import context as serve_context

        ctx = serve_context._get_serve_request_context()
        self.contexts.append((ctx.request_id, ctx._internal_request_id))
        return super().remote(pin_replica=pin_replica)


def test_fanout_calls_are_serve_requests_of_their_own() -> None:
    # Ray Serve's router hands a replica to the waiting call with the chosen request's internal
    # id: calls fanned out while the ingress serves one request must not share that id, or
    # all but one of them are never delivered.
    from radixkv.cluster._ray import import_serve

    import_serve()
    from ray.serve import context as serve_context

    names = [f"SERVE_REPLICA::app#RadixKVReplica#u{i}" for i in range(4)]
    method = _RecordingMethod({f"u{i}": {"replica": n} for i, n in enumerate(names)})
    handle = type("H", (), {"reset_prefix_cache": method})()

    async def in_a_request() -> tuple[object, str]:
        serve_context._set_request_context(request_id="http-1", _internal_request_id="parent")
        res = await call_every_replica(handle, "reset_prefix_cache", names)
        return res, serve_context._get_serve_request_context()._internal_request_id

    res, after = asyncio.run(in_a_request())
    assert sorted(res.answers) == names and not res.failed  # type: ignore[attr-defined]
    assert [rid for rid, _ in method.contexts] == ["http-1"] * 4  # the logged id is kept
    internal = [iid for _, iid in method.contexts]
    assert len(set(internal)) == 4 and "parent" not in internal
    assert after == "parent"  # the caller's own request is untouched


def test_a_call_completed_before_ray_confirms_it_is_not_left_in_flight() -> None:
    # Ray registers the completion callback before confirming the route: a fast call (a pinned
    # reset) can report completion first, and must not stay counted in flight afterwards.
    h = [1, 2, 3]
    s = AffinityState()
    s.picked("fast", "a", h)
    s.completed("fast", "a")
    s.routed("fast", "a", h)
    assert s.snapshot()["a"]["inflight"] == 0 and s.snapshot()["a"]["provisional"] == 0
    assert s.load("a") == 0
    s.routed("slow", "a", h)  # the usual order still counts
    assert s.load("a") == 1
    s.completed("slow", "a")
    assert s.load("a") == 0
    s.completed("retried", "a")  # rejected by a, then picked and accepted there
    s.picked("retried", "a", h)
    s.routed("retried", "a", h)
    assert s.load("a") == 1


def test_fleet_stats_ask_again_when_a_pin_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh handle's router may not list every replica yet and routes a call pinned to an
    unlisted one like any other: fleet_engine_stats asks that replica again, and skips one
    that raised (gone) without asking again."""
    import radixkv.cluster.app as app_mod

    names = [f"SERVE_REPLICA::app#RadixKVReplica#u{i}" for i in range(4)]
    calls: list[str] = []
    missed_once: set[str] = set()

    class _Call:
        def __init__(self, answer: object) -> None:
            self.answer = answer

        def result(self, timeout_s: float) -> object:
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

    class _Stats:
        def remote(self, *, pin_replica: str) -> _Call:
            calls.append(pin_replica)
            name = next(n for n in names if n.endswith("#" + pin_replica))
            if pin_replica == "u3":
                return _Call(RuntimeError("ActorDiedError"))
            if pin_replica in ("u1", "u2") and pin_replica not in missed_once:
                missed_once.add(pin_replica)  # the router did not list it yet
                return _Call({"replica": names[0], "cached_pages": 9})
            return _Call({"replica": name, "cached_pages": int(pin_replica[1:])})

    handle = type("H", (), {"engine_stats": _Stats()})()
    monkeypatch.setattr(app_mod.serve, "get_deployment_handle", lambda dep, app: handle)
    monkeypatch.setattr(app_mod, "replica_actor_names", lambda app: names)
    got = app_mod.fleet_engine_stats("app", retry_s=0.0)
    assert [g["replica"] for g in got] == names[:3]  # u3 is gone
    assert [g["cached_pages"] for g in got] == [0, 1, 2]
    assert sorted(calls) == ["u0", "u1", "u1", "u2", "u2", "u3"]  # the dead one asked once
    calls.clear()
    missed_once.clear()
    assert len(app_mod.fleet_engine_stats("app", attempts=1, retry_s=0.0)) == 1  # no retry
    assert sorted(calls) == ["u0", "u1", "u2", "u3"]
