"""Page tables as rows of one int64 array, kept from step to step (a persistent batch).

A decode step of B sequences hands the model runner B page tables (Python lists the engine
owns). Converting every page id to an index tensor each step costs about 0.1-0.2 us a page: at
B=256 with 300-token contexts, more than the rest of the step's planning; with 4k-token contexts
tens of times more. Between two steps, though, almost every table is the same list with the
same contents (a sequence crosses a page boundary once every ``page_size`` steps).

:class:`PageTableRows` keeps each table's pages in a row of an array, keyed on the list's
identity, and a snapshot (a copy) of its contents: a step compares each list with its snapshot
(C speed: the same int objects compare by identity) and converts only the rows that changed,
were added, or whose list is new; rows of lists no longer passed are recycled. The result is
always what a fresh conversion gives (a row is a function of the snapshot's contents alone, so a
reused ``id`` of a new list, or a list changed in place, is caught by the comparison); with
``check`` on (debug checks, radixkv/debug.py) every step asserts it against a fresh build.

The snapshots are never mutated (a change makes a new one), so a layout may keep them as its
page tables: the engine may change its lists while an earlier step's layout is still in use.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import numpy as np

from radixkv.debug import debug_checks_enabled


def pad_rows(tables: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """``[len(tables), width]`` int64 (width: the longest table's, at least 1): row ``i`` is
    ``tables[i]`` then its first page repeated (0 for an empty table), so that a row read past
    its table's end still names a valid page. The fresh build :class:`PageTableRows` matches."""
    counts = [len(t) for t in tables]
    w = max(max(counts, default=0), 1) if width is None else width
    out = np.zeros((len(tables), w), dtype=np.int64)
    for i, (t, n) in enumerate(zip(tables, counts, strict=True)):
        if n:
            out[i, :n] = t
            out[i, n:] = t[0]
    return out


class PageTableRows:
    """The rows of a batch's page tables, converted only where they changed (module docstring).

    Not thread-safe: one caller (the runner's main thread) at a time; what :meth:`gather`
    returns is the caller's own (fresh arrays, immutable snapshots)."""

    # stale rows (lists no longer passed) are swept when the store holds more rows than a
    # step passes, and at least this often (duplicate lists in a batch hide stale ones)
    SWEEP_EVERY = 64

    def __init__(self, *, check: bool | None = None) -> None:
        self.check = debug_checks_enabled() if check is None else check
        self._snap: dict[int, list[int]] = {}  # id(list) -> copy of its contents
        self._slot: dict[int, int] = {}  # id(list) -> its row of _store
        self._store = np.zeros((0, 1), dtype=np.int64)
        self._count = np.zeros(0, dtype=np.int64)  # per row of _store: its table's pages
        # the last step's keys and their rows (a step with the same lists reuses them)
        self._last_keys: list[int] = []
        self._last_slots = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        self._steps = 0
        self.rows_converted = 0  # rows (re)converted since construction, for tests and benches

    def __len__(self) -> int:
        """Rows held (tables of the last steps)."""
        return len(self._slot)

    def gather(
        self, tables: Sequence[Sequence[int]]
    ) -> tuple[tuple[list[int], ...], np.ndarray, np.ndarray]:
        """``(snapshots, pages, counts)`` of ``tables``: per table an immutable copy of its
        pages (a list, the same object while the table is unchanged), their rows as one
        ``[len(tables), width]`` int64 array padded as :func:`pad_rows` pads (``width``: the
        longest table's, at least 1), and each table's page count
        ``[len(tables)]`` int64. Tables that are not lists are copied to lists first."""
        if not all(map(operator.is_, map(type, tables), itertools.repeat(list))):
            tables = [t if type(t) is list else list(map(int, t)) for t in tables]
        keys = list(map(id, tables))
        snaps = list(map(self._snap.get, keys))
        # a snapshot equal to its list: unchanged (None != list: a list not seen before)
        changed = list(map(operator.ne, snaps, tables))
        if any(changed):
            for i in itertools.compress(range(len(keys)), changed):
                snaps[i] = self._set(keys[i], tables[i])  # type: ignore[arg-type]
        if keys == self._last_keys:  # the same lists in the same order: the same rows
            slots = self._last_slots
        else:
            slots = np.fromiter(map(self._slot.__getitem__, keys), np.int64, len(keys))
            self._last_keys, self._last_slots = keys, slots
        counts = self._count[slots]
        pages = self._store[slots, : max(1, int(counts.max(initial=0)))]
        self._steps += 1
        if len(self._slot) > len(keys) or self._steps % self.SWEEP_EVERY == 0:
            self._sweep(keys)
        out = tuple(snaps)
        if self.check:
            fresh = pad_rows(out)
            assert np.array_equal(pages, fresh), "PageTableRows differs from a fresh build"
            assert counts.tolist() == [len(t) for t in tables], "PageTableRows counts differ"
            assert all(map(operator.eq, out, tables)), "PageTableRows snapshot differs"
        return out, pages, counts  # type: ignore[return-value]

    def _set(self, key: int, table: list[int]) -> list[int]:
        """Convert ``table`` into its row (a fresh one for a new key); returns its snapshot."""
        snap = table.copy()
        n = len(snap)
        if n > self._store.shape[1]:
            self._widen(n)
        slot = self._slot.get(key)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slot[key] = slot
        row = self._store[slot]
        self._count[slot] = n
        if n:
            row[:n] = snap
            row[n:] = snap[0]
        else:
            row[:] = 0
        self._snap[key] = snap
        self.rows_converted += 1
        return snap

    def _grow(self) -> None:
        """Double the store's rows (at least 64); the new ones join the free list."""
        old = self._store
        rows = max(64, 2 * old.shape[0])
        store = np.zeros((rows, old.shape[1]), dtype=np.int64)
        store[: old.shape[0]] = old
        self._free.extend(range(rows - 1, old.shape[0] - 1, -1))
        self._store = store
        self._count = np.concatenate([self._count, np.zeros(rows - old.shape[0], np.int64)])

    def _widen(self, width: int) -> None:
        """Widen the store to at least ``width`` columns (doubling), each row's new columns
        padded with its first page."""
        old = self._store
        w = max(width, 2 * old.shape[1], 8)
        store = np.empty((old.shape[0], w), dtype=np.int64)
        store[:, : old.shape[1]] = old
        store[:, old.shape[1] :] = old[:, :1]
        self._store = store

    def _sweep(self, keys: list[int]) -> None:
        """Recycle the rows of lists not passed this step."""
        live = set(keys)
        for key in [k for k in self._slot if k not in live]:
            self._free.append(self._slot.pop(key))
            del self._snap[key]
        self._last_keys = []  # a recycled row may be handed to another list
