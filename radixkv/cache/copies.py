"""Copies in flight between the tiers: issued by TieredRadixCache, retired here.

A copy is one ``Copier.to_host`` / ``to_device`` call over pages of nodes along one path.
While it runs, each of those nodes counts it (``_inflight``; loads also ``_loading``) and the
cache keeps the deepest one locked (InFlight's ``pin``). Copies owns the list of the copies not
retired yet and the one place they are retired: it waits for the handle, lowers the nodes'
counts and hands the finished copy to the cache's callback (``on_retire``), which keeps or
undoes what it copied, unlocks the pin and sends the events. The cache never retires a copy
itself, so every path (``poll``, ``wait``, ``wait_all``, ``settle``) goes through the same
steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from radixkv.cache.tiers import CopyHandle

if TYPE_CHECKING:
    from radixkv.cache.node import TreeNode

__all__ = ["BACKUP", "LOAD", "Copies", "InFlight"]

# Kinds of in-flight copies.
BACKUP = "backup"  # device -> host
LOAD = "load"  # host -> device


class InFlight:
    """One copy the cache issued and has not retired yet.

    ``nodes`` are the nodes whose pages it copies, top-down along one path, each with its
    ``_inflight`` (and, for a load, ``_loading``) count raised by one; ``pin`` is the deepest of
    them, locked once for the whole copy (so each node's lock count is at least its number of
    copies in flight). ``ok`` is None until retired, then whether the copy succeeded.
    """

    __slots__ = ("error", "handle", "kind", "nodes", "ok", "pages", "pin")

    def __init__(self, kind: str, handle: CopyHandle, nodes: list[TreeNode], pages: int) -> None:
        self.kind = kind
        self.handle = handle
        self.nodes = nodes
        self.pin = nodes[-1]
        self.pages = pages
        self.ok: bool | None = None
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return (
            f"InFlight({self.kind}, pages={self.pages}, nodes={[n.node_id for n in self.nodes]}, "
            f"ok={self.ok})"
        )


class Copies:
    """The copies in flight of one cache, in issue order.

    ``begin(kind, nodes)`` marks the nodes before the copier is called, ``abort`` unmarks them
    when the call itself raised, ``track`` records the copy the call returned. Retiring (any
    of ``poll``, ``wait``, ``wait_all``, ``settle``) waits for the handle (a raise means the
    copy failed: ``ok`` False, ``error`` set), unmarks the nodes, then calls
    ``on_retire(copy)``; the callback must not issue or retire copies.
    """

    __slots__ = ("_list", "_on_retire")

    def __init__(self, on_retire: Callable[[InFlight], None]) -> None:
        self._list: list[InFlight] = []
        self._on_retire = on_retire

    def __len__(self) -> int:
        return len(self._list)

    def __bool__(self) -> bool:
        return bool(self._list)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._list)

    @staticmethod
    def begin(kind: str, nodes: list[TreeNode]) -> None:
        """Count a copy about to be issued on ``nodes``."""
        load = kind == LOAD
        for x in nodes:
            x._inflight += 1
            if load:
                x._loading += 1

    @staticmethod
    def abort(kind: str, nodes: list[TreeNode]) -> None:
        """Undo ``begin``: the copier raised instead of issuing the copy."""
        load = kind == LOAD
        for x in nodes:
            x._inflight -= 1
            if load:
                x._loading -= 1

    def track(self, kind: str, handle: CopyHandle, nodes: list[TreeNode], pages: int) -> InFlight:
        """Record an issued copy (after ``begin``) until it is retired."""
        c = InFlight(kind, handle, nodes, pages)
        self._list.append(c)
        return c

    def poll(self) -> int:
        """Retire every copy that has finished (never blocks); return how many."""
        retired = 0
        for c in list(self._list):
            try:
                finished = c.handle.done()
            except Exception:  # a handle that cannot tell: wait() will say what happened
                finished = True
            if finished:
                self._list.remove(c)
                self._retire(c)
                retired += 1
        return retired

    def wait(self, c: InFlight) -> None:
        """Wait for ``c`` and retire it, unless it is retired already."""
        if c.ok is None:
            self._list.remove(c)
            self._retire(c)

    def wait_all(self) -> None:
        """Wait for every copy in flight and retire it, oldest first."""
        while self._list:
            self._retire(self._list.pop(0))

    def settle(self, nodes: list[TreeNode]) -> None:
        """Wait for and retire every copy in flight on any of ``nodes``."""
        ids = {id(n) for n in nodes}
        for c in [c for c in self._list if any(id(n) in ids for n in c.nodes)]:
            self._list.remove(c)
            self._retire(c)

    def _retire(self, c: InFlight) -> None:
        """Finish ``c`` (already off the list): wait, unmark its nodes, tell the cache."""
        try:
            c.handle.wait()
            c.ok = True
        except Exception as e:
            c.ok = False
            c.error = e
        self.abort(c.kind, c.nodes)  # the same unmarking as an aborted copy
        self._on_retire(c)
