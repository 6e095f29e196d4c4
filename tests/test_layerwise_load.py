"""Layer-wise host-tier loads (EngineConfig.host_layerwise_load, radixkv/kv/layer_loads.py): a
host hit is copied back layer by layer while the forward runs, each layer of the forward
waiting only for its own pages. Same greedy outputs as loading all at once; pages and locks
conserved; a load failing mid-way or a forward failing while a load is in flight leaks
nothing; layer i is never read before its copy landed, and the forward really starts before
the last layer has landed."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import pytest
import torch

from radixkv.cache import PagePool, TieredRadixCache
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.params import SamplingParams
from radixkv.kv.copier import KVCopier
from radixkv.kv.host_pool import HostKVPool
from radixkv.kv.kv_pool import KVPool
from radixkv.model.loader import LoadedModel, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=5)
HOST_BYTES = 8_000_000


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("radixkv-tiny")


def _prompts(n: int = 5) -> list[list[int]]:
    """Prompts sharing a system prompt; together more than a 48-page pool keeps."""
    system = [(7 * i) % 190 + 5 for i in range(40)]
    return [system + [(13 * i + 31 * j) % 190 + 5 for i in range(60)] for j in range(n)]


def _run(engine: Engine, rounds: int = 2, *, one_at_a_time: bool = False) -> list[list[int]]:
    outs: list[list[int]] = []
    prompts = _prompts()
    for _ in range(rounds):
        groups = [[p] for p in prompts] if one_at_a_time else [prompts]
        for g in groups:
            for o in engine.generate(g, GREEDY, use_tqdm=False):
                outs.append(list(o.outputs[0].token_ids))
            engine.check_invariants()
    return outs


@pytest.fixture(scope="module")
def ref(tiny: LoadedModel) -> list[list[int]]:
    """Outputs without a host tier (2 rounds of the prompts, batched)."""
    return _run(Engine(tiny, page_size=4, num_pages=48))


@pytest.fixture(scope="module")
def ref_single(tiny: LoadedModel) -> list[list[int]]:
    """The same, one request at a time (so that a step issues at most one load: a request
    matching through a prefix another request of its step is loading waits for all of it)."""
    return _run(Engine(tiny, page_size=4, num_pages=48), one_at_a_time=True)


def _engine(tiny: LoadedModel, layerwise: bool) -> Engine:
    return Engine(
        tiny,
        page_size=4,
        num_pages=48,
        host_cache_memory=HOST_BYTES,
        host_layerwise_load="on" if layerwise else "off",
    )


def _conserved(eng: Engine) -> None:
    eng.cache.wait_all()
    eng.check_invariants()  # free + cached + private == total, locks back to zero
    assert eng.cache.num_locked_pages == 0
    assert not eng.kv_pool.loads.pending


def test_outputs_identical_layerwise_on_and_off(tiny: LoadedModel, ref: list[list[int]]) -> None:
    off = _engine(tiny, layerwise=False)
    on = _engine(tiny, layerwise=True)
    layered = []
    to_device = on.copier.to_device

    def counting(pairs: list[tuple[int, int]]) -> object:
        h = to_device(pairs)
        layered.append(hasattr(h, "wait_layer"))
        return h

    on.copier.to_device = counting  # type: ignore[method-assign]
    assert _run(off) == ref
    assert _run(on) == ref
    assert layered and all(layered), "no layer-wise load happened"
    for eng in (off, on):
        st = eng.stats()
        assert st.prefix_cache_host_hit_tokens > 0 and st.load_back_pages > 0
        assert st.load_back_failures == 0
        _conserved(eng)
    # (how many pages come back differs from run to run in either mode: which prefixes a
    # backup covered before their eviction depends on the copier thread's timing)


def test_layer_is_never_read_before_it_landed(
    tiny: LoadedModel, ref_single: list[list[int]]
) -> None:
    """An instrumented copier lands layer i + 1 only once the forward has read layer i: an
    engine that waited for the whole load before its forward would stall (and time out
    here). Every read of a layer comes after that layer of the pending load landed."""
    eng = _engine(tiny, layerwise=True)
    num_layers = eng.kv_pool.num_layers
    assert num_layers >= 2
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    read = [threading.Event() for _ in range(num_layers)]
    stalls: list[int] = []
    copier = eng.copier
    copy_layer = copier._copy_layer

    def instrumented_copy(layer: int, s: torch.Tensor, d: torch.Tensor) -> None:
        # the forward must have read the previous layer before this one lands
        if layer and not read[layer - 1].wait(10):
            stalls.append(layer)
        copy_layer(layer, s, d)
        with lock:
            log.append(("landed", layer))
        read[layer].clear()

    attn = eng.runner.attn
    backend_forward = attn.forward

    def logged_forward(layer: int, *a: object, **kw: object) -> object:
        with lock:
            log.append(("read", layer))
        read[layer].set()
        return backend_forward(layer, *a, **kw)

    copier._copy_layer = instrumented_copy  # type: ignore[method-assign]
    attn.forward = logged_forward  # type: ignore[method-assign]
    assert _run(eng, one_at_a_time=True) == ref_single  # one load a step
    assert not stalls, f"the forward did not read layer {stalls[0] - 1} before it fully loaded"
    assert eng.stats().load_back_pages > 0
    # the forward's per-layer waits count as load-back time
    assert eng.stats().load_back_seconds >= eng.kv_pool.loads.waited_seconds > 0
    landed_at = [i for i, e in enumerate(log) if e == ("landed", 0)]
    assert landed_at, "no load happened"
    for start in landed_at:  # each load: its layers land one by one, each before it is read
        for layer in range(num_layers):
            land = log.index(("landed", layer), start)
            first_read = log.index(("read", layer), start)
            assert land < first_read, (layer, log[start : start + 4 * num_layers])
        # pipelined: layer 0 was read before the last layer landed
        assert log.index(("read", 0), start) < log.index(("landed", num_layers - 1), start)
    _conserved(eng)


@pytest.mark.parametrize("when", ["layer 0 in the forward", "layer 1 in the forward", "before"])
def test_load_failing_is_a_miss(tiny: LoadedModel, ref_single: list[list[int]], when: str) -> None:
    """A layer-wise load that fails while the forward reads it (at layer 0, or at layer 1
    after the forward read layer 0): the step is redone without that request (its host hit
    becomes a miss); one that failed before the forward is dropped before it, as an
    all-at-once load is. Outputs stay the same, and no page or lock leaks."""
    eng = _engine(tiny, layerwise=True)
    copy_layer = eng.copier._copy_layer
    failing = [True]
    read0 = threading.Event()

    def broken(layer: int, s: torch.Tensor, d: torch.Tensor) -> None:
        if failing[0]:
            if when == "layer 0 in the forward":
                started.wait(10)  # the forward has started (and waits for layer 0)
                started.clear()
                raise RuntimeError("DMA error (injected)")
            if when == "before":
                raise RuntimeError("DMA error (injected)")
            if layer == 1:
                read0.wait(10)  # the forward has read layer 0
                read0.clear()
                raise RuntimeError("DMA error (injected)")
        copy_layer(layer, s, d)

    attn = eng.runner.attn
    backend_forward = attn.forward

    def logged_forward(layer: int, *a: object, **kw: object) -> object:
        if layer == 0 and eng.kv_pool.loads.pending:
            read0.set()
        return backend_forward(layer, *a, **kw)

    started = threading.Event()
    runner = eng.runner
    forward, forward_hidden = runner.forward, runner.forward_hidden

    def started_forward(*a: object, **kw: object) -> object:
        if eng.kv_pool.loads.pending:  # a forward that reads a load still landing
            started.set()
        return forward(*a, **kw)

    def started_forward_hidden(*a: object, **kw: object) -> object:
        if eng.kv_pool.loads.pending:
            started.set()
        return forward_hidden(*a, **kw)

    runner.forward = started_forward  # type: ignore[method-assign]
    runner.forward_hidden = started_forward_hidden  # type: ignore[method-assign]
    undone: list[bool] = []
    landing_failed = eng._landing_failed

    def recorded(*a: object) -> bool:
        undone.append(landing_failed(*a))  # type: ignore[arg-type]
        return undone[-1]

    eng.copier._copy_layer = broken  # type: ignore[method-assign]
    attn.forward = logged_forward  # type: ignore[method-assign]
    eng._landing_failed = recorded  # type: ignore[method-assign]
    if when == "before":  # the failure is known before the forward: nothing to undo
        eng.copier.to_device = _settled(eng.copier.to_device)  # type: ignore[method-assign]
    assert _run(eng, one_at_a_time=True) == ref_single
    st = eng.stats()
    assert st.load_back_failures > 0
    assert st.finish_reasons == {"length": len(ref_single)}
    if when == "before":
        assert not any(undone)
    else:
        assert any(undone), "no step was redone: the failure was not seen after a forward"
    _conserved(eng)
    failing[0] = False  # the copier works again: host hits are loaded again
    before = eng.stats().load_back_pages
    assert _run(eng, rounds=1, one_at_a_time=True) == ref_single[: len(_prompts())]
    assert eng.stats().load_back_pages > before
    _conserved(eng)


def _settled(to_device: Any) -> Any:
    """``to_device`` that returns once the copy is over (so the engine sees a finished load
    before its forward)."""

    def issue(pairs: list[tuple[int, int]]) -> object:
        h = to_device(pairs)
        while not h.done():
            time.sleep(0.001)
        return h

    return issue


def test_forward_failing_while_a_load_is_in_flight(tiny: LoadedModel, ref: list[list[int]]) -> None:
    """The forward raises (shared state) while a layer-wise load is still landing: the batch
    ends with "error", the load retires later, nothing leaks, and the engine serves on."""
    eng = _engine(tiny, layerwise=True)
    _run(eng, rounds=1)  # fills the host tier
    gate = threading.Event()
    copy_layer = eng.copier._copy_layer

    def slow(layer: int, s: torch.Tensor, d: torch.Tensor) -> None:
        if layer:
            gate.wait(10)  # layer 1 on lands after the forward failed
        copy_layer(layer, s, d)

    attn = eng.runner.attn
    backend_forward = attn.forward

    def failing(layer: int, *a: object, **kw: object) -> object:
        if eng.kv_pool.loads.pending:
            gate.set()
            raise RuntimeError("device fault (injected)")
        return backend_forward(layer, *a, **kw)

    eng.copier._copy_layer = slow  # type: ignore[method-assign]
    attn.forward = failing  # type: ignore[method-assign]
    errors = 0
    for p in _prompts():  # one at a time: the step's only load is the one still landing
        eng.add_request(p, GREEDY)
        while eng.has_unfinished():
            try:
                eng.step()
            except RuntimeError as e:
                assert "injected" in str(e)
                errors += 1
    assert errors and gate.is_set()
    _conserved(eng)
    attn.forward = backend_forward  # type: ignore[method-assign]
    assert _run(eng, rounds=1) == ref[: len(_prompts())]
    _conserved(eng)


def test_cache_level_release_while_loading_leaks_nothing() -> None:
    """Unlock (a request aborted) while a layer-wise load is in flight: the copy keeps its
    own lock until retired, then every page and lock is back."""
    L, PS = 3, 4
    kv = KVPool(L, 6, PS, 2, 8)
    host = HostKVPool.like(kv, 8)
    with KVCopier(kv, host, layerwise=True) as copier:
        cache = TieredRadixCache(
            PagePool(kv.num_pages), page_size=PS, host_pool=PagePool(host.num_pages), copier=copier
        )
        tokens = list(range(3 * PS))
        pages = cache.alloc(3)
        kv.k[:, pages] = 1.0
        cache.insert(tokens, pages)
        cache.wait_all()
        cache.evict(3)
        gate = threading.Event()
        copy_layer = copier._copy_layer

        def slow(layer: int, s: torch.Tensor, d: torch.Tensor) -> None:
            gate.wait(10)
            copy_layer(layer, s, d)

        copier._copy_layer = slow  # type: ignore[method-assign]
        lb = cache.load_back(cache.match_prefix(tokens))
        assert lb.layered and kv.loads.pending
        cache.lock(lb.node)
        cache.unlock(lb.node)  # aborted before the forward
        assert cache.num_locked_pages == 3  # the copy's own pin
        cache.check_invariants()
        gate.set()
        cache.wait_all()
        assert cache.num_locked_pages == 0 and not kv.loads.pending
        cache.check_invariants()
        assert torch.all(kv.k[:, lb.pages] == 1.0)


def test_config_flag(tiny: LoadedModel) -> None:
    assert EngineConfig().host_layerwise_load == "auto"
    for bad in (True, "yes", None):
        with pytest.raises(ValueError, match="host_layerwise_load must be one of"):
            EngineConfig(host_layerwise_load=bad)  # type: ignore[arg-type]
    parser = EngineConfig.add_cli_arguments(argparse.ArgumentParser())
    for value in ("on", "off", "auto"):
        args = parser.parse_args(["--host-layerwise-load", value])
        assert EngineConfig.from_cli_args(args).host_layerwise_load == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--host-layerwise-load", "sometimes"])
    # auto: all at once for now (measured: see EngineConfig.host_layerwise_load)
    for mode, want in (("auto", False), ("on", True), ("off", False)):
        eng = Engine(tiny, page_size=4, num_pages=16, host_cache_memory=HOST_BYTES,
                     host_layerwise_load=mode)  # fmt: skip
        assert eng.copier.layerwise is want
        eng.close()
    kv = KVPool(1, 2, 4, 1, 8)
    with pytest.raises(TypeError, match="layerwise"):
        KVCopier(kv, HostKVPool.like(kv, 2), layerwise=1)  # type: ignore[arg-type]
    with KVCopier(kv, HostKVPool.like(kv, 2)) as copier:
        assert copier.layerwise is False
