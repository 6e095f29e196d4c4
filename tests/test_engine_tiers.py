"""The engine with a host KV tier (EngineConfig.host_cache_memory): same greedy outputs as
without it, prefixes evicted from a tiny device pool come back from host memory, a failing
copier turns loads into misses without leaking locks or pages, config and CLI checks."""

from __future__ import annotations

import argparse
import random

import pytest
from server_helpers import metric_values

from radixkv.cache.tiers import WRITE_POLICIES, CompletedCopy
from radixkv.engine.config import EngineConfig, parse_bytes
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.model.loader import LoadedModel, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
HOST_BYTES = 8_000_000  # thousands of pages of radixkv-tiny at page_size 4


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


def _prompts(seed: int = 0, n: int = 6) -> list[list[int]]:
    """Prompts sharing a system prompt, each long enough that a tiny pool cannot keep them all."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 200) for _ in range(40)]
    return [system + [rng.randrange(5, 200) for _ in range(60)] for _ in range(n)]


def _run(engine: Engine, rounds: int = 3) -> list[list[int]]:
    outs: list[list[int]] = []
    prompts = _prompts()
    for _ in range(rounds):
        for o in engine.generate(prompts, GREEDY, use_tqdm=False):
            outs.append(list(o.outputs[0].token_ids))
        engine.check_invariants()
    return outs


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("num_pages", [64, 4096], ids=["pressure", "roomy"])
def test_outputs_identical_with_host_tier(tiny: LoadedModel, policy: str, num_pages: int) -> None:
    ref = _run(Engine(tiny, page_size=4, num_pages=num_pages))
    eng = Engine(
        tiny,
        page_size=4,
        num_pages=num_pages,
        host_cache_memory=HOST_BYTES,
        write_policy=policy,
    )
    assert _run(eng) == ref
    eng.cache.wait_all()
    eng.check_invariants()
    st = eng.stats()
    assert st.host_pages_total > 0
    assert st.prefix_cache_device_hit_tokens + st.prefix_cache_host_hit_tokens == (
        st.prefix_cache_hit_tokens
    )
    if num_pages == 64:  # prefixes were evicted to the host and loaded back
        assert st.prefix_cache_host_hit_tokens > 0
        assert st.load_back_pages > 0
        assert st.backup_pages > 0
        assert st.host_pages_used > 0
        if policy == "write_back":
            assert st.write_back_pages > 0


class _FailingWait:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError("copy failed (injected)")


@pytest.mark.parametrize("mode", ["raise", "wait"])
def test_failing_load_back_is_a_miss(tiny: LoadedModel, mode: str) -> None:
    ref = _run(Engine(tiny, page_size=4, num_pages=64))
    eng = Engine(tiny, page_size=4, num_pages=64, host_cache_memory=HOST_BYTES)

    def to_device(pairs: list[tuple[int, int]]) -> object:
        if mode == "raise":
            raise RuntimeError("copier down (injected)")
        return _FailingWait()

    eng.copier.to_device = to_device  # type: ignore[method-assign]
    assert _run(eng) == ref
    st = eng.stats()
    assert st.load_back_failures > 0
    assert st.prefix_cache_host_hit_tokens == 0
    assert st.finish_reasons == {"length": len(ref)}
    eng.cache.wait_all()
    eng.check_invariants()  # locks back to zero, pages conserved
    # the engine keeps serving, and with a working copier the host tier is used again
    del eng.copier.to_device  # the KVCopier's own method again
    assert _run(eng, rounds=1) == ref[: len(_prompts())]
    eng.check_invariants()


class _RecordingWait:
    """Wraps a copy handle and records when the engine waits for it. It never says it is
    done, so poll() cannot retire it early: only an explicit wait does."""

    def __init__(self, handle: object, log: list[str]) -> None:
        self.handle, self.log = handle, log

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.log.append("wait")
        self.handle.wait()  # type: ignore[attr-defined]


def test_loads_issued_for_the_batch_then_waited_before_its_forward(tiny: LoadedModel) -> None:
    """A load back is started at admission and waited for just before the forward: every
    load of a step is issued before the first wait, so copies overlap the step's scheduling."""
    eng = Engine(tiny, page_size=4, num_pages=64, host_cache_memory=HOST_BYTES)
    log: list[str] = []
    to_device, forward = eng.copier.to_device, eng.runner.forward

    def logged_to_device(pairs: list[tuple[int, int]]) -> object:
        log.append("issue")
        return _RecordingWait(to_device(pairs), log)

    def logged_forward(*a: object, **kw: object) -> object:
        log.append("forward")
        return forward(*a, **kw)

    eng.copier.to_device = logged_to_device  # type: ignore[method-assign]
    eng.runner.forward = logged_forward  # type: ignore[method-assign]
    ref = _run(Engine(tiny, page_size=4, num_pages=64))
    assert _run(eng) == ref
    steps = "".join("F" if e == "forward" else e[0] for e in log).split("F")
    loading = [s for s in steps if "i" in s]
    assert loading, "no load back happened: the test lost its pressure"
    # waiting in acquire would make every step "iwiw...": here some step issues two loads
    # before its first wait (a match through a node still loading waits for it, so a step may
    # have a wait between issues too), and each step waits last, just before its forward
    assert any(s.startswith("ii") for s in loading), loading
    for s in loading:
        assert s.endswith("w"), s
    eng.cache.wait_all()
    eng.check_invariants()


def test_failing_backup_keeps_serving(tiny: LoadedModel) -> None:
    ref = _run(Engine(tiny, page_size=4, num_pages=64))
    eng = Engine(tiny, page_size=4, num_pages=64, host_cache_memory=HOST_BYTES)
    failed = CompletedCopy(RuntimeError("injected"))
    eng.copier.to_host = lambda pairs: failed  # type: ignore[method-assign]
    assert _run(eng) == ref
    eng.cache.wait_all()
    eng.check_invariants()
    assert eng.stats().backup_pages == 0


def test_host_budget_too_small(tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="host_cache_memory"):
        Engine(tiny, page_size=4, num_pages=64, host_cache_memory=100)
    with pytest.raises(ValueError, match="host_cache_memory"):
        EngineConfig(host_cache_memory=0)
    with pytest.raises(ValueError, match="write_policy"):
        EngineConfig(write_policy="sometimes")
    with pytest.raises(ValueError, match="write_through_threshold"):
        EngineConfig(write_through_threshold=0)


def test_cli_flags() -> None:
    parser = EngineConfig.add_cli_arguments(argparse.ArgumentParser())
    cfg = EngineConfig.from_cli_args(parser.parse_args([]))
    assert cfg.host_cache_memory is None and cfg.write_policy == "write_through"
    for text, want in [("4000000000", 4_000_000_000), ("4GB", 4 * 10**9), ("2GiB", 2 << 30)]:
        args = parser.parse_args(["--host-cache-memory", text, "--write-policy", "write_back"])
        cfg = EngineConfig.from_cli_args(args)
        assert cfg.host_cache_memory == want and cfg.write_policy == "write_back"
    args = parser.parse_args(["--write-through-threshold", "3"])
    assert EngineConfig.from_cli_args(args).write_through_threshold == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--host-cache-memory", "lots"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--write-policy", "sometimes"])
    assert parse_bytes("512MiB") == 512 << 20
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("4XB")
    # in Python too: byte counts as strings are read once, into ints
    cfg = EngineConfig(host_cache_memory="16GiB", kv_cache_memory="512MB")
    assert (cfg.host_cache_memory, cfg.kv_cache_memory) == (16 << 30, 512 * 10**6)
    with pytest.raises(ValueError, match="host_cache_memory: not a byte count"):
        EngineConfig(host_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory must be an int >= 1"):
        EngineConfig(kv_cache_memory="0")
    args = parser.parse_args(["--kv-cache-memory", "2GiB"])
    assert EngineConfig.from_cli_args(args).kv_cache_memory == 2 << 30


def test_serve_flags_and_metrics(tiny: LoadedModel) -> None:
    from radixkv.server import add_serve_arguments
    from radixkv.server.metrics import PREFIX, ServerMetrics

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--host-cache-memory", "4GB", "--write-policy", "write_through_selective"]
    )
    cfg = EngineConfig.from_cli_args(args)
    assert (cfg.host_cache_memory, cfg.write_policy) == (4 * 10**9, "write_through_selective")

    eng = Engine(tiny, page_size=4, num_pages=64, host_cache_memory=HOST_BYTES)
    _run(eng, rounds=1)
    # the first round's backups complete before the second round evicts them (on a loaded
    # machine the copier thread can lag, and a page evicted before its backup is not kept)
    eng.cache.wait_all()
    _run(eng, rounds=1)
    values = metric_values(ServerMetrics(eng.stats).render().decode())
    for series in ("prefix_cache_host_hits_tokens_total", "host_load_back_pages_total"):
        assert values[f"{PREFIX}_{series}"] > 0, series
    assert f"{PREFIX}_host_kv_pages_total" in values


class _SlowBackup:
    """A backup handle that finishes only when waited for: poll() never retires it."""

    def __init__(self, handle: object) -> None:
        self.handle = handle

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.handle.wait()  # type: ignore[attr-defined]


def test_backups_in_flight_do_not_fail_the_queue_head(tiny: LoadedModel) -> None:
    """Backups lock their nodes until retired. When they are all that keeps the queue's head
    out (nothing running), the engine waits for them and admits it: it must not end the
    request with "cannot be admitted" (a race: it happened whenever the copier thread lagged)."""
    prompts = [[(7 * i + 3 * j) % 190 + 5 for i in range(100)] for j in range(3)]  # 25 pages
    ref = Engine(tiny, page_size=4, num_pages=40).generate(prompts, GREEDY, use_tqdm=False)
    eng = Engine(tiny, page_size=4, num_pages=40, host_cache_memory=HOST_BYTES)
    to_host = eng.copier.to_host
    eng.copier.to_host = lambda pairs: _SlowBackup(to_host(pairs))  # type: ignore[method-assign]
    outs = []
    for p in prompts:  # one at a time: the previous request's backup holds 25 of 40 pages
        outs += eng.generate([p], GREEDY, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert eng.stats().backup_pages > 0
    eng.cache.wait_all()
    eng.check_invariants()
