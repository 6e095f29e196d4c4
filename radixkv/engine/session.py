"""Session: a token state that several branches continue from (tree-of-thought style).

A session is a list of token ids plus a pin: a lock on the deepest cached trie node of its
tokens (taken through the engine's ``SeqKV``, which counts pins), so the state's KV stays
cached (never evicted) while the program decides what to do next. ``fork(n)`` makes n sessions
on the same state (each pins the same node: no copy); ``Session.generate_all(branches,
params)`` runs every branch in one batch, where they share the state's pages and only compute
their own continuation, then appends each output to its branch and re-pins it. Close sessions
(or use ``with``) to release their pins.

A session drives its engine only through the engine's public request API (``prepare``,
``submit``, ``iter_outputs``) and ``seq_kv``'s pins; :class:`SessionEngine` spells out that
interface (``Engine`` provides it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Generator, Sequence
from typing import Protocol

from radixkv.cache import TreeNode
from radixkv.engine.intake import Prompt, normalise_prompt
from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.request import Namespace, RequestGroup
from radixkv.model.tokenizer import Tokenizer


class SessionEngine(Protocol):
    """What a session uses of its engine (see ``Engine`` for the contracts)."""

    tokenizer: Tokenizer
    vocab_size: int
    seq_kv: SeqKV

    def prepare(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        namespace: Namespace = None,
        stream: bool = True,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> RequestGroup: ...

    def cache_namespace(self, namespace: Namespace, lora: str | None) -> Namespace: ...

    def submit(self, request: RequestGroup) -> str: ...

    def iter_outputs(
        self, request_ids: Collection[str]
    ) -> Generator[RequestOutput, None, None]: ...


class Session:
    """Use ``engine.session(prompt)``. Not thread-safe (like the engine)."""

    def __init__(
        self,
        engine: SessionEngine,
        prompt: Prompt,
        *,
        namespace: Namespace = None,
        lora: str | None = None,
    ) -> None:
        self.engine = engine
        self.namespace = namespace
        self.lora = lora  # the LoRA adapter its continuations run with (None: the base model)
        self._cache_namespace = engine.cache_namespace(namespace, lora)  # raises when unknown
        _, ids = normalise_prompt(prompt, engine.tokenizer, engine.vocab_size)
        self.tokens: list[int] = ids
        self._node: TreeNode | None = None
        self.closed = False
        self._repin()

    @property
    def text(self) -> str:
        return self.engine.tokenizer.decode(self.tokens)

    @property
    def num_pinned_tokens(self) -> int:
        """Tokens of this state whose KV the pin keeps cached."""
        return 0 if self._node is None else int(self._node.depth_tokens)

    def extend(self, more: Prompt) -> Session:
        """Append text (encoded without special tokens) or token ids to the state."""
        self._check_open()
        if isinstance(more, str):
            ids = self.engine.tokenizer.encode(more, add_special_tokens=False)
        else:
            _, ids = normalise_prompt(list(more), self.engine.tokenizer, self.engine.vocab_size)
        self.tokens.extend(ids)
        self._repin()
        return self

    def fork(self, n: int = 2) -> list[Session]:
        """n new sessions on a copy of this state (this one stays open)."""
        self._check_open()
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork: n must be an int >= 1, got {n!r}")
        return [
            Session(self.engine, list(self.tokens), namespace=self.namespace, lora=self.lora)
            for _ in range(n)
        ]

    def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        """Continue this state; the output is appended to it."""
        return Session.generate_all([self], params)[0]

    @staticmethod
    def generate_all(
        sessions: Sequence[Session], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Continue every session in one batch (they must share an engine); each output is
        appended to its session. ``params.n`` must be 1. If a step raises (or the loop is
        interrupted), the branches' requests are aborted, so their locks and pages are
        released, and no session changes."""
        if not sessions:
            return []
        if params is not None and params.n != 1:
            raise ValueError("Session.generate_all: params.n must be 1 (fork sessions instead)")
        engine = sessions[0].engine
        for s in sessions:
            s._check_open()
            if s.engine is not engine:
                raise ValueError("Session.generate_all: sessions belong to different engines")
        groups = [
            engine.prepare(list(s.tokens), params, namespace=s.namespace, stream=False, lora=s.lora)
            for s in sessions
        ]
        ids = [engine.submit(g) for g in groups]
        # closing: whatever ends the loop early, the requests still live are aborted now
        with contextlib.closing(engine.iter_outputs(ids)) as outputs:
            for _ in outputs:
                pass
        outs = [g.make_output() for g in groups]
        for s, o in zip(sessions, outs):
            s.tokens.extend(o.token_ids)
            s._repin()
        return outs

    def close(self) -> None:
        """Release the pin (idempotent). The state's pages become evictable."""
        if self._node is not None:
            self.engine.seq_kv.unpin(self._node)
            self._node = None
        self.closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("session is closed")

    def _repin(self) -> None:
        """Move the pin to the deepest cached node of the current tokens."""
        kv = self.engine.seq_kv
        # pin the new node before unpinning the old
        node = kv.pin(self.tokens, self._cache_namespace)
        if self._node is not None:
            kv.unpin(self._node)
        self._node = node
