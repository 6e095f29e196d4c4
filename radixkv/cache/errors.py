"""Named errors of the cache layer.

None of them leaves a change behind (see the contract in RadixCache's docstring).
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Fewer free (or evictable) pages than requested.

    ``requested`` is the number of pages asked for, ``available`` how many could have been
    provided (free pages, plus evictable pages when raised by ``RadixCache.alloc``).
    """

    def __init__(self, requested: int, available: int, what: str = "free") -> None:
        super().__init__(
            f"cannot allocate {requested} page(s): only {available} {what} page(s) available"
        )
        self.requested = requested
        self.available = available


class ForeignNodeError(ValueError):
    """A node that does not belong to this cache (another cache's node, or an evicted one)."""


class LockError(ValueError):
    """Unlock of a node that is not locked (its lock count would go below zero)."""


class InvariantError(AssertionError):
    """``check_invariants()`` found a violated invariant (always a bug in radixkv)."""
