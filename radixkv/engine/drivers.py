"""Blocking drivers: ``Engine.generate`` and ``Engine.stream`` run the step loop for the caller.

Contract: a driver queues its requests through the engine (all of ``generate``'s prompts are
checked before any is queued), then calls ``engine.step()`` until they finish. Every other
queued request progresses too; the driver only reports its own. If the loop is left early
(an exception, KeyboardInterrupt, or a stream closed before its request finished), the driver
aborts the requests it started that are still live, so their locks and pages are released.
Drivers hold no state of their own: they read ``engine._groups`` and go through the engine's
submission methods, ``step()`` and ``abort()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.validate import as_prompt_list

if TYPE_CHECKING:
    from radixkv.engine.engine import Engine


def generate(
    engine: Engine,
    prompts: Any,
    params: SamplingParams | Sequence[SamplingParams] | None,
    use_tqdm: bool,
    namespace: Any,
) -> list[RequestOutput]:
    """See ``Engine.generate``."""
    plist = as_prompt_list(prompts)
    if isinstance(params, SamplingParams) or params is None:
        params_list = [params] * len(plist)
    else:
        params_list = list(params)
        if len(params_list) != len(plist):
            raise ValueError(f"{len(plist)} prompts but {len(params_list)} SamplingParams")
    groups = [
        engine._make_group(p, sp, None, namespace, stream=False)
        for p, sp in zip(plist, params_list)
    ]
    ids = set()
    for g in groups:
        engine._enqueue(g)
        ids.add(g.request_id)
    # plain tqdm: tqdm.auto warns in notebooks without ipywidgets
    from tqdm import tqdm

    pending = len(groups)
    with tqdm(total=pending, disable=not use_tqdm, desc="generate", unit="req") as bar:
        try:
            while pending:
                done = sum(1 for o in engine.step() if o.finished and o.request_id in ids)
                pending -= done
                bar.update(done)
        except BaseException:
            for g in groups:
                if g.request_id in engine._groups:
                    engine.abort(g.request_id)
            raise
    return [g.make_output() for g in groups]


def stream(
    engine: Engine, prompt: Any, params: SamplingParams | None, namespace: Any
) -> Iterator[RequestOutput]:
    """See ``Engine.stream``."""
    rid = engine.add_request(prompt, params, namespace=namespace, stream=True)
    try:
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
    finally:
        if rid in engine._groups:
            engine.abort(rid)
