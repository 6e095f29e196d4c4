"""AsyncEngine: the engine driven by a background loop, for asyncio servers.

The loop task owns the engine. A submission is checked and built synchronously in the caller
(``Engine.prepare``: bad input raises at submission) and then queued as a command; the loop
applies commands (``Engine.submit``, ``Engine.abort``) between steps and runs each ``step()`` in
a single worker thread, so the event loop stays responsive and the engine's state is only ever
changed by one thread at a time. It uses nothing but the engine's public request API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from radixkv.engine.engine import Engine
from radixkv.engine.intake import Prompt
from radixkv.engine.lora import LoRAInfo
from radixkv.engine.outputs import EngineStats, RequestOutput, WeightUpdate
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import Namespace, RequestGroup
from radixkv.model.loader import LoadedModel
from radixkv.model.tokenizer import Tokenizer
from radixkv.model.weight_update import StagedWeights, WeightSource

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    """``AsyncEngine(model, **engine_kwargs)`` or ``AsyncEngine(engine=existing_engine)``.

    ``async for out in engine.generate(prompt, params): ...`` streams a request's outputs; the
    last has ``finished=True``. Leaving the loop early (break, cancellation, a client gone)
    aborts the request and frees its pages. ``max_queued`` bounds the number of live requests:
    beyond it ``generate`` raises :class:`QueueFull` (a server answers 503).
    """

    def __init__(
        self,
        model: str | Path | LoadedModel = "radixkv-tiny",
        *,
        engine: Engine | None = None,
        max_queued: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.engine = engine if engine is not None else Engine(model, **engine_kwargs)
        self._owns_engine = engine is None  # shutdown closes an engine it built
        self.max_queued = max_queued
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._commands: list[Callable[[], None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-engine")
        self._stopped = False
        self._next_id = 0  # areq-N ids for submissions without one

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request (run with the LoRA adapter ``lora``, if given). Raises
        ValueError/TypeError at submission on bad input."""
        if isinstance(params, SamplingParams) and params.guided is not None:
            # compiling a language can take seconds: off the event loop, before submission
            await asyncio.to_thread(self.engine.compile_guided, params)
        rid, queue = self.submit(
            prompt, params, request_id=request_id, namespace=namespace, lora=lora
        )
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> tuple[str, asyncio.Queue[RequestOutput | BaseException]]:
        """Validate and queue a request; returns its id and the queue its outputs arrive on
        (lower level than ``generate``; the caller must ``abort`` if it stops reading)."""
        self._ensure_loop()
        if self.max_queued is not None and len(self._queues) >= self.max_queued:
            raise QueueFull(f"{len(self._queues)} requests queued (max_queued={self.max_queued})")
        if request_id is None:
            request_id = f"areq-{self._next_id}"
            self._next_id += 1
        elif request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = self.engine.prepare(
            prompt, params, request_id=request_id, namespace=namespace, stream=True, lora=lora
        )
        rid = group.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = queue
        self._command(lambda: self._add(group))
        return rid, queue

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished)."""
        self._queues.pop(request_id, None)
        self._command(lambda: self._abort(request_id))

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)

    async def check_invariants(self) -> None:
        await self._call(self.engine.check_invariants)

    async def reset_prefix_cache(self) -> None:
        await self._call(self.engine.reset_prefix_cache)

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """``Engine.load_lora``: the files are read in a worker thread (steps go on), then the
        adapter is attached between steps."""
        adapter = await asyncio.to_thread(self.engine.loras.read, name, path)
        return await self._call(lambda: self.engine.loras.attach(adapter))

    async def unload_lora(self, name: str) -> LoRAInfo:
        """``Engine.unload_lora`` on the engine's thread."""
        return await self._call(lambda: self.engine.unload_lora(name))

    async def update_weights(
        self,
        weights: WeightSource | StagedWeights,
        *,
        weight_version: str | None = None,
        in_flight: str = "retract",
    ) -> WeightUpdate:
        """``Engine.update_weights``: the weights are read and checked in a worker thread
        (steps go on meanwhile), then swapped in between steps; the final outputs of the
        requests it aborts are delivered at once."""
        self.engine.check_update_options(in_flight, weight_version)
        if not isinstance(weights, StagedWeights):
            weights = await asyncio.to_thread(self.engine.stage_weights, weights)
        staged = weights

        def swap() -> WeightUpdate:
            update = self.engine.update_weights(
                staged, weight_version=weight_version, in_flight=in_flight
            )
            self._deliver(self.engine.drain())  # aborted requests' final outputs
            return update

        return await self._call(swap)

    def list_loras(self) -> list[LoRAInfo]:
        return self.engine.list_loras()

    async def wait_idle(self) -> None:
        """Until no request is queued or running."""
        while self._queues or self._commands or self.engine.has_unfinished():
            await asyncio.sleep(0.005)

    async def shutdown(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._executor.shutdown(wait=True)
        if self._owns_engine:  # finish storage writes, stop the tiers' threads
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    # ------------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self._stopped:
            raise RuntimeError("AsyncEngine is shut down")
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="radixkv-loop")

    def _command(self, fn: Callable[[], None]) -> None:
        self._commands.append(fn)
        if self._wake is not None:
            self._wake.set()

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` between steps (never concurrently with one)."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self._ensure_loop()
        self._command(run)
        return await fut

    def _add(self, group: RequestGroup) -> None:
        if group.request_id not in self._queues:
            return  # cancelled before it was queued
        try:
            self.engine.submit(group)
        except Exception as e:
            self._deliver_error(group.request_id, e)

    def _abort(self, request_id: str) -> None:
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
                if o.finished:
                    self._queues.pop(o.request_id, None)

    def _deliver_error(self, request_id: str, err: BaseException) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(err)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while True:
            while self._commands:
                cmds, self._commands = self._commands, []
                for c in cmds:
                    try:
                        c()
                    except Exception:  # a command must never kill the loop
                        log.exception("engine command failed")
            if not self.engine.has_unfinished():
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            try:
                outs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # the failed batch's requests were finished with "error"
                log.exception("engine step failed")
                outs = self.engine.drain()
                for o in outs:
                    self._deliver_error(o.request_id, RuntimeError(f"engine step failed: {e}"))
                continue
            self._deliver(outs)
            await asyncio.sleep(0)  # let submitters and readers run between steps


class QueueFull(RuntimeError):
    """Too many requests queued in the AsyncEngine."""
