"""PagePool: which KV pages are free, held privately by a request, or cached by a trie.

The page states and their transitions are stated once, in the PagePool docstring; what the
cache does with CACHED pages is stated in RadixCache's (radix_cache.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from operator import itemgetter

from radixkv.cache.errors import InvariantError, OutOfPages

FREE, HELD, CACHED = 0, 1, 2
_STATE_NAMES = ("free", "held", "cached")
_STATE_BYTES = (b"\x00", b"\x01", b"\x02")  # one state byte, to repeat over a run


class PagePool:
    """A free list of page ids with one ownership state per page.

    Page ids are ints in ``[0, num_pages)``. Every page is in exactly one state:

    * FREE: in the free list, owned by nobody;
    * HELD: returned by ``alloc`` and owned by the caller (a running request) until it either
      ``free``s it or hands it to ``RadixCache.insert``;
    * CACHED: owned by one trie node of the RadixCache built over this pool (one cache per
      pool); only that cache moves pages into or out of this state.

    ``num_free + num_held + num_cached == num_pages`` always. Users call ``alloc``, ``free``
    and the queries. The cache moves pages with ``check_held`` (validate, change nothing),
    ``adopt`` (HELD -> CACHED), ``release_held`` (HELD -> FREE) and ``release_cached``
    (CACHED -> FREE); the last three trust their input, so they take only pages that
    ``check_held`` accepted or that the trie owns. ``adopt_run`` checks and adopts an
    ascending run of HELD pages at once, ``adopt_held`` any list of distinct HELD int ids in
    one pass; both change nothing when they decline. Every error leaves the pool unchanged.
    Not thread-safe.

    ``on_free`` (None by default), when set, is called with every list of pages that just
    became FREE (by ``free``, ``release_held`` or ``release_cached``), after the move: what
    other per-page resources follow the pages (window slots, window_slots.py) let go of theirs.
    """

    __slots__ = ("_free", "_ids", "_num_cached", "_state", "num_pages", "on_free")

    def __init__(self, num_pages: int) -> None:
        if type(num_pages) is not int or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        self.num_pages = num_pages
        # One int object per page id, shared by the free list, the callers and the trie:
        # ``_ids[a:b]`` is the canonical run of pages a..b-1 (check_held and adopt compare
        # against it, and hand it out, so the trie stores plain ints whatever was passed).
        self._ids: list[int] = list(range(num_pages))
        # Reversed so that alloc pops 0, 1, 2, ... first (deterministic, readable tests);
        # freed pages go back reversed too, so alloc keeps handing out ascending runs.
        self._free: list[int] = self._ids[::-1]
        self._state = bytearray(num_pages)
        self._num_cached = 0
        self.on_free: Callable[[list[int]], None] | None = None

    # ----------------------------------------------------------------------------- queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages owned by a trie (CACHED)."""
        return self._num_cached

    @property
    def num_held(self) -> int:
        """Pages allocated to callers and not (yet) in a trie."""
        return self.num_pages - len(self._free) - self._num_cached

    def state(self, page: int) -> str:
        """'free', 'held' or 'cached' (ValueError for an out-of-range page)."""
        self._check_range(page)
        return _STATE_NAMES[self._state[page]]

    # ----------------------------------------------------------------------------- public ops
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages; the caller owns them (HELD). ``n == 0`` returns [].

        Raises OutOfPages (pool unchanged) when fewer than ``n`` pages are free.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"alloc needs a non-negative int, got {n!r}")
        free = self._free
        if n > len(free):
            raise OutOfPages(n, len(free))
        if n == 0:
            return []
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        self._set_state(pages, HELD)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return HELD pages to the free list.

        Raises ValueError (pool unchanged) if any page is out of range, not an int, free
        already (double free), owned by a trie, or listed twice.
        """
        self.release_held(self.check_held(pages))

    # ----------------------------------------------------------------------------- cache moves
    def check_held(self, pages: Iterable[int]) -> list[int]:
        """Validate that every page is HELD and distinct; return them as a list of ints.

        Changes nothing. Raises TypeError for a non-integer id, ValueError for an id out of
        range, a page that is not HELD, or a page listed twice.
        """
        if type(pages) is list and len(pages) > 1:
            fast = self._check_held_fast(pages)
            if fast is not None:
                return fast
        out: list[int] = []
        state = self._state
        n = self.num_pages
        for p in pages:
            if type(p) is not int:
                if isinstance(p, bool):
                    raise TypeError(f"page ids must be ints, got {p!r}")
                try:
                    p = operator.index(p)
                except TypeError:
                    raise TypeError(f"page ids must be ints, got {p!r}") from None
            if not 0 <= p < n:
                raise ValueError(f"page {p} is out of range [0, {n})")
            s = state[p]
            if s != HELD:
                why = "free (double free?)" if s == FREE else "owned by the cache"
                raise ValueError(f"page {p} is not held by the caller: it is {why}")
            out.append(p)
        if len(set(out)) != len(out):
            seen: set[int] = set()
            dup = next(p for p in out if p in seen or seen.add(p))
            raise ValueError(f"page {dup} is listed more than once")
        return out

    def _check_held_fast(self, pages: list[int]) -> list[int] | None:
        """check_held of two or more pages without a Python loop, or None when anything is
        unusual (then the loop decides, and names the problem).

        An ascending run of ints (what alloc hands out) costs one list compare against the
        canonical run and one count of state bytes. Anything else (a fragmented list): all
        HELD (one C gather of the state bytes; an id out of range or not an integer raises),
        each id equal to its canonical int (a negative id reads another page's entries and
        fails this), distinct (a set, which also sends lists holding page 0 or 1 to the loop:
        a bool equals one of them). The result is the canonical int objects of those ids, so
        an id passed as, say, a numpy integer is stored as a plain int.
        """
        n = len(pages)
        ids = self._ids
        try:
            a = pages[0]
            # (a bool equals 0 or 1, which in a run can only sit at positions 0 and 1)
            if type(a) is int and type(pages[1]) is int and a >= 0 and pages[-1] - a == n - 1:
                run = ids[a : a + n]
                if pages == run:  # exactly a, a+1, ..., a+n-1
                    return run if self._state.count(HELD, a, a + n) == n else None
            get = itemgetter(*pages)
            if get(self._state).count(HELD) != n:
                return None
            out = list(get(ids))
            if out != pages:
                return None
            seen = set(out)
            if len(seen) != n or 0 in seen or 1 in seen:
                return None
            return out
        except (TypeError, IndexError, ValueError):
            return None

    def adopt_held(self, pages: list[int]) -> bool:
        """HELD -> CACHED for ``pages`` when every one is a plain int id of a HELD page, listed
        once: True. Otherwise False, and nothing changed (False says nothing about validity:
        use ``check_held`` and ``adopt`` then, which name the problem). The cache's path for
        a fragmented list (pages allocated one decode step at a time): check and move in one
        pass, where a page listed twice is found CACHED by its second visit."""
        n = len(pages)
        if n < 2:
            return False
        state = self._state
        try:
            if min(pages) < 0:  # a negative id would index from the end
                return False
        except TypeError:  # ids that do not compare
            return False
        it = iter(pages)
        try:
            for p in it:
                if state[p] == HELD and type(p) is int:  # (a bool is not an int here)
                    state[p] = CACHED
                else:
                    break
            else:
                self._num_cached += n
                return True
        except (TypeError, IndexError):  # an id that is no index, or out of range
            pass
        # undo the moves before the page the loop stopped at: those pages were HELD
        stop = n - 1 - sum(1 for _ in it)
        for q in pages[:stop]:
            state[q] = HELD
        return False

    def adopt_run(self, pages: list[int], prefix: list[int] | None = None) -> list[int] | None:
        """HELD -> CACHED, in one slice, when ``pages`` is an ascending run of two or more HELD
        pages (a, a+1, ..., what alloc hands out); returns the run's canonical int objects.
        Otherwise None, and nothing changed (None says nothing about validity: use
        ``check_held`` and ``adopt`` then). The cache's fast path: check and move at once.

        With ``prefix`` (pages the caller already owns, e.g. a matched prefix's), ``pages``
        must be ``prefix`` followed by such a run: one list compare checks both, and on
        success the run is appended to ``prefix`` in place (left as it was otherwise).
        """
        m = 0 if prefix is None else len(prefix)
        n = len(pages) - m
        if n < 2:
            return None
        a = pages[m]
        # (a bool equals 0 or 1, which in a run can only sit at its first two positions)
        if type(a) is not int or type(pages[m + 1]) is not int or a < 0:
            return None
        try:
            if pages[-1] - a != n - 1:
                return None
        except TypeError:
            return None
        run = self._ids[a : a + n]
        state = self._state
        if prefix is None:
            if pages != run:
                return None
        else:
            prefix += run
            if pages != prefix:
                del prefix[m:]
                return None
        if state.count(HELD, a, a + n) != n:
            if prefix is not None:
                del prefix[m:]
            return None
        state[a : a + n] = _STATE_BYTES[CACHED] * n
        self._num_cached += n
        return run

    def _run_start(self, pages: list[int]) -> int:
        """``a`` when ``pages`` is the canonical run a, a+1, ..., a+n-1 (n >= 2), else -1."""
        n = len(pages)
        if n < 2:
            return -1
        a = pages[0]
        if pages[-1] - a == n - 1 and pages == self._ids[a : a + n]:
            return a
        return -1

    def _check_range(self, page: int) -> None:
        if type(page) is not int or not 0 <= page < self.num_pages:
            raise ValueError(f"page {page!r} is out of range [0, {self.num_pages})")

    def adopt(self, pages: list[int]) -> None:
        """HELD -> CACHED for pages ``check_held`` accepted (the trie now owns them)."""
        self._set_state(pages, CACHED)
        self._num_cached += len(pages)

    def release_held(self, pages: list[int]) -> None:
        """HELD -> FREE for pages ``check_held`` accepted."""
        self._set_state(pages, FREE)
        self._free.extend(reversed(pages))
        if self.on_free is not None:
            self.on_free(pages)

    def release_cached(self, pages: list[int]) -> None:
        """CACHED -> FREE for pages the trie gives up."""
        self._set_state(pages, FREE)
        self._free.extend(reversed(pages))
        self._num_cached -= len(pages)
        if self.on_free is not None:
            self.on_free(pages)

    def _set_state(self, pages: list[int], s: int) -> None:
        a = self._run_start(pages)
        state = self._state
        if a >= 0:  # one slice assignment for a run
            state[a : a + len(pages)] = _STATE_BYTES[s] * len(pages)
        else:
            for p in pages:
                state[p] = s

    # ----------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Recount page states; raise InvariantError on any inconsistency."""
        free = self._free
        if len(set(free)) != len(free):
            raise InvariantError("free list holds a page twice")
        state = self._state
        if len(state) != self.num_pages:
            raise InvariantError("state array has the wrong length")
        for p in free:
            if not 0 <= p < self.num_pages or state[p] != FREE:
                raise InvariantError(f"free-listed page {p} is not in state FREE")
        if state.count(FREE) != len(free):
            raise InvariantError("a page is FREE but not in the free list")
        if state.count(CACHED) != self._num_cached:
            raise InvariantError(
                f"cached counter {self._num_cached} != recount {state.count(CACHED)}"
            )
        if state.count(HELD) + state.count(FREE) + state.count(CACHED) != self.num_pages:
            raise InvariantError("a page has an unknown state")

    def __repr__(self) -> str:
        return (
            f"PagePool(num_pages={self.num_pages}, free={self.num_free}, "
            f"held={self.num_held}, cached={self._num_cached})"
        )
