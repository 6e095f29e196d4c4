"""AsyncEngine's one engine thread: every call into the engine (steps, submissions, aborts,
housekeeping, cache listeners added or removed, and the listeners themselves) runs on the
same worker thread, never on the event loop's; what a front end shows comes from ``info()``,
a snapshot that follows weight updates."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from radixkv.cache.events import BlockStored
from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.engine import Engine
from radixkv.engine.engine_info import EngineInfo
from radixkv.engine.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _record_threads(eng: Engine, names: list[str]) -> dict[str, set[int]]:
    """Wrap ``eng``'s methods ``names`` to record the threads that call them."""
    seen: dict[str, set[int]] = defaultdict(set)
    for name in names:
        real: Callable[..., Any] = getattr(eng, name)

        def wrapped(*a: Any, _real: Callable[..., Any] = real, _n: str = name, **k: Any) -> Any:
            seen[_n].add(threading.get_ident())
            return _real(*a, **k)

        setattr(eng, name, wrapped)
    return seen


def test_listeners_are_added_and_removed_on_the_engine_thread() -> None:
    aeng = AsyncEngine("radixkv-tiny", num_pages=128)
    seen = _record_threads(
        aeng.engine,
        ["step", "submit", "abort", "stats", "add_cache_listener", "remove_cache_listener"],
    )
    events: list[tuple[int, Any]] = []

    def listener(event: Any) -> None:
        events.append((threading.get_ident(), event))

    async def main() -> int:
        loop_thread = threading.get_ident()

        async def run(prompt: list[int]) -> None:
            async for _ in aeng.generate(prompt, GREEDY):
                pass

        # a request is running (steps in flight) while the listener is added
        busy = asyncio.create_task(run(list(range(3, 40))))
        await asyncio.sleep(0)
        await aeng.add_cache_listener(listener)
        await busy
        await run(list(range(50, 90)))
        heard = len(events)
        assert heard and any(isinstance(e, BlockStored) for _, e in events)
        await aeng.remove_cache_listener(listener)
        await run(list(range(100, 140)))  # new pages cached: the listener hears nothing
        assert len(events) == heard
        with pytest.raises(ValueError, match="not a registered listener"):
            await aeng.remove_cache_listener(listener)
        # an abandoned stream is aborted on the engine thread too
        agen = aeng.generate(list(range(7, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()
        await aeng.wait_idle()
        await aeng.stats()
        await aeng.shutdown()
        return loop_thread

    loop_thread = asyncio.run(main())
    (engine_thread,) = seen["step"]
    assert engine_thread != loop_thread
    for name in ("submit", "abort", "stats", "add_cache_listener", "remove_cache_listener"):
        assert seen[name] == {engine_thread}, name
    assert {t for t, _ in events} == {engine_thread}  # the listener runs there as well


def test_command_errors_and_step_failures_come_back_to_the_caller() -> None:
    aeng = AsyncEngine("radixkv-tiny", num_pages=128)
    runner = aeng.engine.runner
    real_forward = runner.forward
    calls: list[int] = []

    def failing_forward(*a: Any, **k: Any) -> Any:
        calls.append(threading.get_ident())
        raise RuntimeError("injected")

    async def main() -> int:
        with pytest.raises(ValueError, match="unknown LoRA adapter"):
            await aeng.unload_lora("nope")  # raised on the engine thread, here
        runner.forward = failing_forward  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="engine step failed: injected"):
            async for _ in aeng.generate([5, 6, 7, 8], GREEDY):
                pass
        runner.forward = real_forward  # type: ignore[method-assign]
        outs = [o async for o in aeng.generate([5, 6, 7, 8], GREEDY)]  # serving goes on
        assert outs[-1].finished and len(outs[-1].token_ids) == 6
        await aeng.wait_idle()
        await aeng.check_invariants()
        await aeng.shutdown()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(calls) == 1 and loop_thread not in calls


def test_info_is_a_snapshot_that_follows_weight_updates() -> None:
    aeng = AsyncEngine("radixkv-tiny", num_pages=96, page_size=8, max_running_requests=7)
    eng = aeng.engine
    info = aeng.info()
    assert isinstance(info, EngineInfo)
    assert (info.model, info.architecture) == (eng.model.name, eng.model.config.architecture)
    assert (info.max_context, info.vocab_size) == (eng.max_context, eng.vocab_size)
    assert (info.page_size, info.num_pages, info.max_running_requests) == (8, 96, 7)
    assert info.schedule_policy == eng.config.schedule_policy and info.enable_prefix_cache
    assert info.attention_backend == eng.backend_choice.name == "torch"
    assert (info.kv_device, info.on_gpu, info.dtype) == ("cpu", False, "float32")
    assert info.weight_version == "default" and info.tokenizer is None
    with pytest.raises(AttributeError):
        info.weight_version = "x"  # type: ignore[misc]
    name, weight = next(iter(eng.model.model.state_dict().items()))

    async def main() -> EngineInfo:
        await aeng.update_weights({name: torch.zeros_like(weight)}, weight_version="w2")
        after = aeng.info()
        await aeng.shutdown()
        return after

    after = asyncio.run(main())
    assert after.weight_version == "w2" == eng.weight_version
    assert msgspec.structs.replace(after, weight_version="default") == info  # nothing else moved
    assert aeng.list_loras() == [] and aeng.lora_of_namespace("tenant") is None
