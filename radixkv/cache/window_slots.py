"""WindowSlots: the K/V of a model's sliding-window layers, kept for fewer tokens than the pages.

A model that mixes sliding-window layers with full-attention layers (Gemma 2 and 3, Mistral,
Ministral, OLMo 3, Cohere 2, Qwen with ``use_sliding_window``) reads a token's K/V in its
windowed layers only while the token is within the window of some query. With hybrid window KV
(``EngineConfig.window_kv``) the full layers keep every page's K/V as before, and the windowed
layers keep theirs in *window slots*, a second, smaller store: a page has a slot attached only
while its tokens can still be read through a window, or while the slot is cached. The memory
the windowed layers would have spent on the rest holds more pages instead.

A page is in one of three window states here:

* no slot: its windowed layers' K/V is gone (the full layers' stays with the page);
* attached and pinned (a count > 0): a running sequence reads it through a window next step;
  never taken away;
* attached and unpinned: cached. Slots are taken from cached pages when ``attach`` finds too
  few free ones: first from those unpinned as ``passed`` (a window slid past them in the middle
  of a cached run: only a match ending right after them would read them), then from the others
  (windows before the end of a cached sequence or a branch point, where matches end), least
  recently unpinned first within each.

A cached prefix serves a new sequence only up to where the window before its end still has
slots (``usable_prefix``): the tokens after it attend that window in the windowed layers.

Contracts (``check_invariants``): ``slot_of`` and the slots' pages are inverse maps; free slots
plus attached pages make ``num_slots``; a pinned page is attached, and the cached pages are
exactly the attached, unpinned ones. Who pins: the engine's sequences (kv_manager.py), one pin
per sequence on each page from its window's first page to its last. When the page pool frees
a page (``PagePool.on_free`` is :meth:`release`), an unpinned page loses its slot; a pinned one
keeps it, for its sequence to move to the page that replaces it (:meth:`replace`, when the
trie kept another copy of the same tokens). No torch here: the KV layer's ``HybridKVPool``
reads ``slot_of`` to address the windowed layers' storage. Not thread-safe.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from radixkv.cache.errors import InvariantError, OutOfPages
from radixkv.cache.page_pool import PagePool
from radixkv.pages import window_start_page

NO_SLOT = -1


class WindowSlots:
    """``num_slots`` window slots for the pages ``[0, num_pages)`` of one page pool."""

    __slots__ = (
        "_free",
        "_lru",
        "_page_of",
        "_passed",
        "_pins",
        "evicted",
        "num_pages",
        "num_slots",
        "slot_of",
    )

    def __init__(self, num_slots: int, num_pages: int) -> None:
        for name, v in (("num_slots", num_slots), ("num_pages", num_pages)):
            if type(v) is not int or v < 1:
                raise ValueError(f"WindowSlots: {name} must be a positive int, got {v!r}")
        self.num_slots = num_slots
        self.num_pages = num_pages
        # slot_of[page]: its slot or NO_SLOT (read by the KV layer once per page and step)
        self.slot_of: list[int] = [NO_SLOT] * num_pages
        self._page_of: list[int] = [NO_SLOT] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pops slot 0 first
        self._pins: dict[int, int] = {}  # pinned page -> count
        # cached (attached, unpinned) pages, least recently unpinned first (a dict keeps
        # insertion order): those unpinned as passed, taken first, and the others
        self._passed: dict[int, None] = {}
        self._lru: dict[int, None] = {}
        self.evicted = 0  # slots taken from cached pages since construction

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Attached, unpinned pages: their slots are what ``attach`` may take."""
        return len(self._passed) + len(self._lru)

    @property
    def num_pinned(self) -> int:
        """Pages some sequence pinned."""
        return len(self._pins)

    @property
    def num_available(self) -> int:
        """Slots ``attach`` can give now: free ones plus those of cached pages."""
        return len(self._free) + len(self._passed) + len(self._lru)

    def pinned(self) -> dict[int, int]:
        """A copy of the pin counts by page."""
        return dict(self._pins)

    def usable_prefix(self, pages: Sequence[int], window: int, page_size: int) -> int:
        """The most leading pages of ``pages`` (a cached prefix's) that a sequence can
        continue from: the largest ``k`` such that every page holding one of the ``window - 1``
        tokens before token ``k * page_size`` has a slot (the next token attends them in the
        windowed layers; ``window``: the model's largest)."""
        slot_of = self.slot_of
        k = len(pages)
        while k > 0:
            first = window_start_page(k * page_size, window, page_size)
            j = k - 1
            while j >= first and slot_of[pages[j]] >= 0:
                j -= 1
            if j < first:
                return k
            k = j  # every longer prefix has page j in its window
        return 0

    # ------------------------------------------------------------------ moves
    def attach(self, pages: Sequence[int]) -> None:
        """Give each page (none attached yet) a slot, pinned once. Takes cached pages' slots,
        least recently unpinned first, when free ones are short; OutOfPages (nothing changed)
        when free + cached slots are fewer than ``pages``."""
        n = len(pages)
        self._check_pages(pages)
        slot_of, page_of, free, pins = self.slot_of, self._page_of, self._free, self._pins
        bad = next((p for p in pages if slot_of[p] >= 0), None)
        if bad is not None:
            raise ValueError(f"page {bad} already has window slot {slot_of[bad]}")
        if len(set(pages)) != n:
            raise ValueError(f"attach lists a page twice: {list(pages)[:8]}")
        short = n - len(free)
        if short > 0:
            if short > self.num_cached:
                raise OutOfPages(n, self.num_available, "free or cached window slot")
            self._evict(short)
        for p in pages:
            s = free.pop()
            slot_of[p] = s
            page_of[s] = p
            pins[p] = 1

    def pin(self, pages: Iterable[int]) -> None:
        """One more pin on each page; ValueError (nothing changed) if one has no slot."""
        pages = list(pages)
        self._check_pages(pages)
        slot_of = self.slot_of
        bad = next((p for p in pages if slot_of[p] < 0), None)
        if bad is not None:
            raise ValueError(f"page {bad} has no window slot to pin")
        pins = self._pins
        for p in pages:
            c = pins.get(p, 0)
            if not c:
                self._uncache(p)
            pins[p] = c + 1

    def unpin(self, pages: Iterable[int], *, keep: bool = True, passed: bool = False) -> None:
        """One pin less on each page (as often as it is listed). A page left unpinned is
        cached (``keep``; ``passed``: among those taken first, see the module docstring) or
        gives its slot back now (``keep=False``: KV no later sequence can match, as with the
        prefix cache off). ValueError (nothing changed) when a page is listed more often than
        it is pinned."""
        pages = list(pages)
        pins = self._pins
        lru = self._passed if passed else self._lru
        want = Counter(pages) if len(pages) > 1 else {p: 1 for p in pages}
        bad = next((p for p, c in want.items() if pins.get(p, 0) < c), None)
        if bad is not None:
            raise ValueError(f"unpin of page {bad}, which is not pinned that often")
        for p in pages:
            c = pins[p]
            if c > 1:
                pins[p] = c - 1
                continue
            del pins[p]
            if keep:
                lru[p] = None
            else:
                self._detach(p)

    def keep(self, pages: Iterable[int]) -> None:
        """Cached pages unpinned as passed move to the other order (as if just unpinned
        there): a sequence ended soon after them, so a later match may well end near them.
        Pages pinned, kept already or without a slot are left as they are."""
        passed, lru = self._passed, self._lru
        for p in pages:
            if p in passed:
                del passed[p]
                lru[p] = None

    def release(self, pages: Iterable[int]) -> None:
        """The page pool freed ``pages`` (``PagePool.on_free``): the unpinned ones give their
        slots back; a pinned one keeps its slot until its sequence calls :meth:`replace`."""
        slot_of, pins = self.slot_of, self._pins
        for p in pages:
            if slot_of[p] >= 0 and p not in pins:
                self._uncache(p)
                self._detach(p)

    def replace(self, old: int, new: int) -> None:
        """A sequence's pinned page ``old`` was freed as a duplicate of ``new`` (the trie's
        copy of the same tokens): its pins move to ``new``, which keeps its own slot if it has
        one (``old``'s goes back) or else takes over ``old``'s (same tokens, same K/V)."""
        c = self._pins.pop(old, 0)
        if c <= 0 or self.slot_of[old] < 0:
            raise ValueError(f"replace of page {old}, which is not pinned")
        if self.slot_of[new] >= 0:
            self._detach(old)
            self.pin([new] * c)
            return
        s = self.slot_of[old]
        self.slot_of[old] = NO_SLOT
        self.slot_of[new] = s
        self._page_of[s] = new
        self._pins[new] = c

    def _uncache(self, p: int) -> None:
        if self._passed.pop(p, 1):  # (None when it was there)
            self._lru.pop(p, None)

    def _check_pages(self, pages: Sequence[int]) -> None:
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            bad = next(p for p in pages if not 0 <= p < self.num_pages)
            raise ValueError(f"page {bad} is out of range [0, {self.num_pages})")

    def _evict(self, n: int) -> None:
        for _ in range(n):
            lru = self._passed or self._lru
            p = next(iter(lru))
            del lru[p]
            self._detach(p)
        self.evicted += n

    def _detach(self, p: int) -> None:
        s = self.slot_of[p]
        self.slot_of[p] = NO_SLOT
        self._page_of[s] = NO_SLOT
        self._free.append(s)

    # ------------------------------------------------------------------ invariants
    def check_invariants(self, pool: PagePool | None = None) -> None:
        """Raise InvariantError unless the maps are inverse, every slot is free or attached
        once, pins sit on attached pages, the cached pages are the attached unpinned ones and
        (given the page ``pool``) no FREE page has a slot."""
        if len(self.slot_of) != self.num_pages or len(self._page_of) != self.num_slots:
            raise InvariantError("window slot maps have the wrong length")
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantError("a window slot is free twice")
        attached = 0
        for s, p in enumerate(self._page_of):
            if p == NO_SLOT:
                if s not in free:
                    raise InvariantError(f"window slot {s} is neither free nor attached")
                continue
            if s in free:
                raise InvariantError(f"window slot {s} is free and attached to page {p}")
            if self.slot_of[p] != s:
                raise InvariantError(
                    f"window slot {s} names page {p}, which names {self.slot_of[p]}"
                )
            attached += 1
        if sum(1 for s in self.slot_of if s != NO_SLOT) != attached:
            raise InvariantError("a page names a window slot that does not name it")
        for p, c in self._pins.items():
            if c <= 0 or self.slot_of[p] == NO_SLOT:
                raise InvariantError(f"page {p} pinned {c} times with slot {self.slot_of[p]}")
        cached = {p for p, s in enumerate(self.slot_of) if s != NO_SLOT} - self._pins.keys()
        if self._passed.keys() & self._lru.keys():
            raise InvariantError("a cached window page is in both eviction orders")
        if cached != self._passed.keys() | self._lru.keys():
            raise InvariantError(
                f"cached window pages {sorted(cached)[:8]} != the eviction orders' "
                f"{sorted(self._passed.keys() | self._lru.keys())[:8]}"
            )
        if pool is not None:
            if pool.num_pages != self.num_pages:
                raise InvariantError("window slots and page pool differ in num_pages")
            bad = [
                p for p, s in enumerate(self.slot_of) if s != NO_SLOT and pool.state(p) == "free"
            ]
            if bad:
                raise InvariantError(f"free pages {bad[:8]} still have window slots")

    def __repr__(self) -> str:
        return (
            f"WindowSlots(num_slots={self.num_slots}, free={self.num_free}, "
            f"pinned={self.num_pinned}, cached={self.num_cached})"
        )


__all__ = ["NO_SLOT", "WindowSlots"]
