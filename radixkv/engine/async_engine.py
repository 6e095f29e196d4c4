"""AsyncEngine: the engine driven by a background loop, for asyncio servers.

One thread touches the engine: the engine thread, the single worker of a one-thread executor.
A submission is checked and built synchronously in the caller (``Engine.prepare``, which
reads the engine and changes nothing: bad input raises at submission) and then queued as a
command; the loop task hands the engine thread, turn by turn, the commands queued since the
last turn (``Engine.submit``, ``Engine.abort``, the awaitable housekeeping below, cache
listeners added or removed) and then one ``step()``. The event loop stays responsive (it
never waits on the engine) and the engine's state is only ever read or changed by one thread.
What a turn hands back (outputs, command results, errors) is delivered on the event loop.
What a front end shows about the engine comes from :meth:`AsyncEngine.info`, a snapshot that
any thread may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from radixkv.cache.events import Listener
from radixkv.engine.engine import Engine
from radixkv.engine.engine_info import EngineInfo
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
# what a command leaves for the event loop to do once its turn is over (None: nothing)
Reply = Callable[[], None]
Command = Callable[[], Reply | None]  # runs on the engine thread


@dataclass
class _Turn:
    """What one turn of the engine thread hands back to the event loop."""

    replies: list[Reply]  # the commands' replies, in order
    outputs: list[RequestOutput]  # the step's outputs (the failed batch's, after ``failure``)
    failure: Exception | None  # the step raised this
    busy: bool  # requests are still queued or running


class AsyncEngine:
    """``AsyncEngine(model, **engine_kwargs)`` or ``AsyncEngine(engine=existing_engine)``.

    ``async for out in engine.generate(prompt, params): ...`` streams a request's outputs; the
    last has ``finished=True``. Leaving the loop early (break, cancellation, a client gone)
    aborts the request and frees its pages. ``max_queued`` bounds the number of live requests:
    beyond it ``generate`` raises :class:`QueueFull` (a server answers 503).

    The engine it is given (``engine=``) is its own from then on: touch it only through the
    AsyncEngine (the module docstring says why).
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
        self._commands: list[Command] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixkv-engine")
        self._stopped = False
        self._next_id = 0  # areq-N ids for submissions without one
        # snapshots the event loop reads, taken here (before the engine thread exists) and on
        # the engine thread whenever what they show changes
        self._busy = self.engine.has_unfinished()  # as of the last turn
        self._in_turn = False  # the engine thread is running a turn
        self._info = EngineInfo.of(self.engine)
        self._loras = tuple(self.engine.list_loras())

    # ------------------------------------------------------------------ public API
    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (encoding and decoding are safe from any thread)."""
        return self.engine.tokenizer

    def info(self) -> EngineInfo:
        """What the engine is: model, limits, settings, KV device, weight version (a snapshot;
        any thread may call it)."""
        return self._info

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
            await self.compile_guided(params)  # before submission: it can take seconds
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

    async def compile_guided(self, params: SamplingParams) -> None:
        """``Engine.compile_guided`` in a worker thread of its own (a large schema on a large
        vocabulary takes seconds; steps go on meanwhile): a request with ``params`` then
        submits without compiling. ValueError when the engine cannot use the language."""
        await asyncio.to_thread(self.engine.compile_guided, params)

    async def stats(self) -> EngineStats:
        return await self._call(self.engine.stats)

    async def check_invariants(self) -> None:
        await self._call(self.engine.check_invariants)

    async def reset_prefix_cache(self) -> None:
        await self._call(self.engine.reset_prefix_cache)

    async def add_cache_listener(self, listener: Listener) -> None:
        """``listener(event)`` is called for every cache event (BlockStored, BlockRemoved,
        AllBlocksCleared: cache/events.py) from now on, on the engine thread: it must be quick
        and must not call back into the engine (hand events to a queue or another thread)."""
        await self._call(lambda: self.engine.add_cache_listener(listener))

    async def remove_cache_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``; ValueError if it was not added."""
        await self._call(lambda: self.engine.remove_cache_listener(listener))

    def lora_of_namespace(self, namespace: Namespace) -> LoRAInfo | None:
        """The loaded LoRA adapter whose KV the cache namespace ``namespace`` holds (None: the
        base model's, or an unloaded adapter's). For cache listeners, which run on the engine
        thread: call it from there (a listener naming an event's adapter)."""
        return self.engine.loras.of_namespace(namespace)

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """``Engine.load_lora``: the files are read in a worker thread (steps go on), then the
        adapter is attached between steps."""
        adapter = await asyncio.to_thread(self.engine.loras.read, name, path)

        def attach() -> LoRAInfo:
            info = self.engine.attach_lora(adapter)
            self._loras = tuple(self.engine.list_loras())
            return info

        return await self._call(attach)

    async def unload_lora(self, name: str) -> LoRAInfo:
        """``Engine.unload_lora`` on the engine thread."""

        def unload() -> LoRAInfo:
            info = self.engine.unload_lora(name)
            self._loras = tuple(self.engine.list_loras())
            return info

        return await self._call(unload)

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
            self._info = msgspec.structs.replace(
                self._info, weight_version=self.engine.weight_version
            )
            return update

        return await self._call(swap, drain=True)  # the aborted requests' final outputs

    def list_loras(self) -> list[LoRAInfo]:
        """The loaded LoRA adapters, in load order (a snapshot; any thread may call it)."""
        return list(self._loras)

    async def wait_idle(self) -> None:
        """Until no request is queued or running."""
        while self._queues or self._commands or self._in_turn or self._busy:
            await asyncio.sleep(0.005)

    async def shutdown(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._owns_engine:  # finish storage writes, stop the tiers' threads
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, self.engine.close)  # after any turn
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ the loop
    def _ensure_loop(self) -> None:
        if self._stopped:
            raise RuntimeError("AsyncEngine is shut down")
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="radixkv-loop")

    def _command(self, fn: Command) -> None:
        self._commands.append(fn)
        if self._wake is not None:
            self._wake.set()

    async def _call(self, fn: Callable[[], T], *, drain: bool = False) -> T:
        """``fn()`` on the engine thread between steps (never concurrently with one), its
        result or exception back here. ``drain``: then deliver ``Engine.drain()``'s outputs
        (requests ``fn`` ended), before the next step's."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def run() -> Reply:
            try:
                value = fn()
            except Exception as e:
                return functools.partial(_settle, fut, None, e)  # (e ends with the block)
            outs = self.engine.drain() if drain else []

            def reply() -> None:
                self._deliver(outs)
                _settle(fut, value, None)

            return reply

        self._ensure_loop()
        self._command(run)
        return await fut

    def _add(self, group: RequestGroup) -> Reply | None:
        # (reads the loop's dict of queues: a request cancelled meanwhile is aborted by the
        # command its cancellation queued after this one)
        if group.request_id not in self._queues:
            return None  # cancelled before it was queued
        try:
            self.engine.submit(group)
        except Exception as e:
            return functools.partial(self._deliver_error, group.request_id, e)
        return None

    def _abort(self, request_id: str) -> None:
        if self.engine.has_request(request_id):
            self.engine.abort(request_id)

    def _turn(self, commands: list[Command]) -> _Turn:
        """On the engine thread: apply ``commands``, then run one step if anything is live."""
        replies: list[Reply] = []
        for c in commands:
            try:
                reply = c()
            except Exception:  # a command must never kill the loop
                log.exception("engine command failed")
                continue
            if reply is not None:
                replies.append(reply)
        outputs: list[RequestOutput] = []
        failure: Exception | None = None
        if self.engine.has_unfinished():
            try:
                outputs = self.engine.step()
            except Exception as e:  # the failed batch's requests were finished with "error"
                log.exception("engine step failed")
                outputs, failure = self.engine.drain(), e
        return _Turn(replies, outputs, failure, self.engine.has_unfinished())

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
            commands, self._commands = self._commands, []
            if not commands and not self._busy:
                self._wake.clear()
                if not self._commands:
                    await self._wake.wait()
                continue
            self._in_turn = True
            try:
                turn = await loop.run_in_executor(self._executor, self._turn, commands)
            finally:
                self._in_turn = False
            self._busy = turn.busy
            for reply in turn.replies:
                try:
                    reply()
                except Exception:  # a reply must never kill the loop either
                    log.exception("engine command's reply failed")
            if turn.failure is None:
                self._deliver(turn.outputs)
            else:
                for o in turn.outputs:
                    err = RuntimeError(f"engine step failed: {turn.failure}")
                    self._deliver_error(o.request_id, err)
            await asyncio.sleep(0)  # let submitters and readers run between steps


def _settle(fut: asyncio.Future[T], value: Any, error: Exception | None) -> None:
    """``fut``'s result or exception, unless its awaiter gave up (cancelled) meanwhile."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class QueueFull(RuntimeError):
    """Too many requests queued in the AsyncEngine."""
