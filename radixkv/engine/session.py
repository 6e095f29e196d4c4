"""Session: a token state that several branches continue from (tree-of-thought style).

A session is a list of token ids plus a pin: a lock on the deepest cached trie node of its
tokens, so the state's KV stays cached (never evicted) while the program decides what to do
next. ``fork(n)`` makes n sessions on the same state (each pins the same node: no copy);
``Session.generate_all(branches, params)`` runs every branch in one batch, where they share
the state's pages and only compute their own continuation, then appends each output to its
branch and re-pins it. Close sessions (or use ``with``) to release their pins.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixkv.engine.outputs import RequestOutput
from radixkv.engine.params import SamplingParams
from radixkv.engine.validate import normalise_prompt

if TYPE_CHECKING:
    from radixkv.engine.engine import Engine


class Session:
    """Use ``engine.session(prompt)``. Not thread-safe (like the engine)."""

    def __init__(self, engine: Engine, prompt: str | Sequence[int], *, namespace: Any = None):
        self.engine = engine
        self.namespace = namespace
        _, ids = normalise_prompt(prompt, engine.tokenizer, engine.vocab_size)
        self.tokens: list[int] = ids
        self._node: Any = None
        self.closed = False
        self._repin()

    @property
    def text(self) -> str:
        return self.engine.tokenizer.decode(self.tokens)

    @property
    def num_pinned_tokens(self) -> int:
        """Tokens of this state whose KV the pin keeps cached."""
        return 0 if self._node is None else int(self._node.depth_tokens)

    def extend(self, more: str | Sequence[int]) -> Session:
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
        return [Session(self.engine, list(self.tokens), namespace=self.namespace) for _ in range(n)]

    def generate(self, params: SamplingParams | None = None) -> RequestOutput:
        """Continue this state; the output is appended to it."""
        return Session.generate_all([self], params)[0]

    @staticmethod
    def generate_all(
        sessions: Sequence[Session], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Continue every session in one batch (they must share an engine); each output is
        appended to its session. ``params.n`` must be 1."""
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
            engine._make_group(list(s.tokens), params, None, s.namespace, stream=False)
            for s in sessions
        ]
        ids = {g.request_id for g in groups}
        for g in groups:
            engine._enqueue(g)
        pending = len(groups)
        while pending:
            pending -= sum(1 for o in engine.step() if o.finished and o.request_id in ids)
        outs = [g.make_output() for g in groups]
        for s, o in zip(sessions, outs):
            s.tokens.extend(o.token_ids)
            s._repin()
        return outs

    def close(self) -> None:
        """Release the pin (idempotent). The state's pages become evictable."""
        if self._node is not None:
            self.engine.cache.unlock(self._node)
            self.engine._num_pins -= 1
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
        eng = self.engine
        if not eng.config.enable_prefix_cache:
            return
        m = eng.cache.match_prefix(self.tokens, namespace=self.namespace)
        if m.node is self._node:
            return
        eng.cache.lock(m.node)
        eng._num_pins += 1
        if self._node is not None:
            eng.cache.unlock(self._node)
            eng._num_pins -= 1
        self._node = m.node
