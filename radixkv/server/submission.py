"""Drives the AsyncEngine for one HTTP request that may hold several prompts (each with ``n``
samples): submit, merge their output streams, and guarantee release.

Ownership: a ``Submission`` owns one pump task per prompt; each task owns an
``engine.generate(...)`` async generator. ``close()`` cancels the tasks that are still running,
which closes their generators, which aborts the engine requests (their locks and pages are
released by the engine). Every code path that creates a Submission must reach ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from radixkv.engine.async_engine import AsyncEngine
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import Namespace


class RequestFailed(RuntimeError):
    """The engine ended this request alone with finish_reason "error" (``RequestOutput.error``:
    its grammar, sampling, detokenizing... failed, or its batch's forward did); the other
    requests went on. The server answers it as this request's own 500."""


@dataclass(frozen=True)
class Echo:
    """What every choice of one prompt starts with (``echo=true``): the prompt's text, the
    text of its first token, the one token no ``prompt_logprobs`` entry carries, and the texts
    of the tokens after it that have none either (before ``prompt_logprobs_start``)."""

    text: str
    first_token: str
    unscored: tuple[str, ...] = ()


@dataclass
class ChoiceState:
    """What has been sent to the client for one (prompt, sample)."""

    sent_chars: int = 0
    finish_reason: str | None = None
    completion_tokens: int = 0
    sent_logprobs: int = 0  # tokens whose logprobs were sent
    logprob_chars: int = 0  # characters of those tokens' text (the next token's text_offset)
    echoed: bool = False  # the prompt (with echo) was sent


@dataclass
class PromptState:
    prompt_tokens: int
    latest: RequestOutput | None = None
    error: BaseException | None = None
    done: bool = False
    choices: list[ChoiceState] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    echo: Echo | None = None  # None: the choices show their completions only

    @property
    def cached_tokens(self) -> int:
        return 0 if self.latest is None else int(self.latest.num_cached_tokens)


class Submission:
    """The engine requests of one HTTP request (``len(prompts)`` requests of ``n`` samples).

    ``echo``: per prompt, what its choices start with (completions' ``echo=true``);
    ``echo_only``: the choices show that and nothing the engine generated (``max_tokens=0``,
    run as one generated token since the engine always generates); ``lora``: the LoRA adapter
    every prompt runs with (None: the base model); ``tenant``: whose request it is (the
    engine's fair admission, ``SamplingParams.tenant``); ``on_start``: called with a prompt's
    state when its first output comes (server/tenant_limits.py counts it running then)."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        namespace: Namespace,
        request_id: str,
        echo: Sequence[Echo] | None = None,
        echo_only: bool = False,
        lora: str | None = None,
        tenant: str | None = None,
        on_start: Callable[[PromptState], None] | None = None,
    ) -> None:
        if echo is not None and len(echo) != len(prompts):
            raise ValueError(f"{len(echo)} echoes for {len(prompts)} prompts")
        if echo_only and echo is None:
            raise ValueError("echo_only needs echo")
        self.engine = engine
        if tenant is not None:
            params = replace(params, tenant=tenant)
        self.params = params
        self._on_start = on_start
        self.request_id = request_id
        self.echo_only = echo_only
        self.lora = lora  # the LoRA adapter every prompt runs with (None: the base model)
        self.start = time.monotonic()
        self.prompts = [
            PromptState(
                len(ids),
                choices=[ChoiceState() for _ in range(params.n)],
                prompt_ids=list(ids),
                echo=None if echo is None else echo[i],
            )
            for i, ids in enumerate(prompts)
        ]
        self._events: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = (
            asyncio.Queue()
        )
        self._tasks = [
            asyncio.create_task(self._pump(i, ids, namespace), name=f"{request_id}-{i}")
            for i, ids in enumerate(prompts)
        ]

    async def _pump(self, i: int, ids: list[int], namespace: Namespace) -> None:
        started = False
        try:
            async for out in self.engine.generate(
                ids,
                self.params,
                request_id=f"{self.request_id}-{i}",
                namespace=namespace,
                lora=self.lora,
            ):
                if not started:
                    started = True
                    if self._on_start is not None:
                        self._on_start(self.prompts[i])
                if out.finished and out.error is not None:  # the engine ended it alone
                    self._events.put_nowait((i, RequestFailed(out.error)))
                    return
                self._events.put_nowait((i, out))
        except Exception as e:  # submission error (ValueError, QueueFull) or a failed step
            self._events.put_nowait((i, e))
            return
        self._events.put_nowait((i, None))

    @property
    def finished(self) -> bool:
        return all(p.done for p in self.prompts)

    async def next_event(self) -> tuple[int, RequestOutput | BaseException | None]:
        """The next (prompt index, output | error | None=stream ended); updates the state."""
        i, item = await self._events.get()
        p = self.prompts[i]
        if isinstance(item, BaseException):
            p.error, p.done = item, True
        elif item is None:
            p.done = True
        else:
            p.latest = item
            if item.finished:
                p.done = True
        return i, item

    async def wait_started(self) -> BaseException | None:
        """Until every prompt has its first output (or any prompt fails); returns the first error."""
        while not all(p.latest is not None or p.done for p in self.prompts):
            _, item = await self.next_event()
            if isinstance(item, BaseException):
                return item
        return next((p.error for p in self.prompts if p.error is not None), None)

    async def wait_finished(self) -> BaseException | None:
        while not self.finished:
            _, item = await self.next_event()
            if isinstance(item, BaseException):
                return item
        return None

    @property
    def prompt_tokens(self) -> int:
        return sum(p.prompt_tokens for p in self.prompts)

    @property
    def cached_tokens(self) -> int:
        return sum(p.cached_tokens for p in self.prompts)

    async def close(self) -> None:
        """Cancel what still runs (aborting its engine requests) and wait for the tasks to end."""
        for t in self._tasks:
            if not t.done():
                t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
