"""Request intake: a submitted prompt + params checked, then turned into a ``RequestGroup``.

Contract: ``RequestIntake.check`` validates everything about a request that does not depend on
the engine's live state (params type, prompt, context length, whether the KV pool could ever
hold it, namespace hashability) and mutates nothing, so a rejected request leaves the engine
unchanged. ``RequestIntake.build`` makes the group and its ``params.n`` sequences (each with
its sampling generator and detokenizer); it draws seeds from the intake's own RNG (seeded from
``EngineConfig.seed``) and touches nothing else. Request ids, the live-request table and the
scheduler stay with the engine, which assigns the id between the two calls.
"""

from __future__ import annotations

import random
import time
from typing import Any

from radixkv.engine.detokenizer import IncrementalDetokenizer
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import RequestGroup
from radixkv.engine.request import Sequence as Seq
from radixkv.engine.sampler import make_generator
from radixkv.engine.validate import normalise_prompt


class RequestIntake:
    """Validates requests against the model and pool limits and builds their groups."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        max_context: int,
        page_size: int,
        num_pages: int,
        seed: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.page_size = page_size
        self.num_pages = num_pages
        self._rng = random.Random(seed)

    def check(
        self, prompt: Any, params: SamplingParams | None, namespace: Any
    ) -> tuple[SamplingParams, str | None, list[int]]:
        """Returns ``(params, prompt text or None, prompt token ids)``; ``None`` params become
        the defaults. Raises ValueError/TypeError on bad input."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        text, ids = normalise_prompt(prompt, self.tokenizer, self.vocab_size)
        total = len(ids) + params.max_tokens
        if total > self.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length {self.max_context}"
            )
        if -(-total // self.page_size) > self.num_pages:
            raise ValueError(
                f"request needs {-(-total // self.page_size)} KV pages for {total} tokens but the "
                f"pool has only {self.num_pages}: it could never fit"
            )
        try:
            hash(namespace)
        except TypeError:
            raise TypeError(f"namespace must be hashable, got {type(namespace).__name__}") from None
        return params, text, ids

    def build(
        self,
        request_id: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        namespace: Any,
        stream: bool,
        arrival_time: float | None,
    ) -> RequestGroup:
        """A group of ``params.n`` waiting sequences (inputs already passed ``check``)."""
        now = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, text, ids, params, namespace, now, stream)
        # without streaming or stop strings, text is decoded once at the end (postprocess.py)
        live_detok = stream or bool(params.stop)
        for i in range(params.n):
            gen = None
            if params.temperature > 0:
                seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
                gen = make_generator(seed)
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens
            )
            seq = Seq(group, i, ids, gen, detok)
            seq.live_detok = live_detok
            group.seqs.append(seq)
        return group
