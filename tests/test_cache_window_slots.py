"""WindowSlots (radixkv/cache/window_slots.py): the sliding-window layers' slots attached to pages.

Each move against a plain reference model (page -> (slot, pins), and the order pages became
cached), invariants after every random operation, the page pool's frees detaching unpinned
pages, errors that change nothing, and ``usable_prefix`` against its definition.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.cache import OutOfPages, PagePool, WindowSlots
from radixkv.cache.window_slots import NO_SLOT


def state(w: WindowSlots) -> tuple:
    """Everything observable (for 'unchanged on error' checks)."""
    return (list(w.slot_of), w.pinned(), w.num_free, w.num_cached, w.evicted)


def test_attach_pins_and_unpin_caches() -> None:
    w = WindowSlots(4, 10)
    w.attach([3, 5])
    assert w.slot_of[3] == 0 and w.slot_of[5] == 1  # slot 0 first
    assert w.pinned() == {3: 1, 5: 1} and w.num_free == 2 and w.num_available == 2
    w.pin([5])
    w.unpin([3, 5])
    assert w.pinned() == {5: 1} and w.num_cached == 1  # 3 cached, 5 still pinned once
    assert w.num_available == 3  # the free slots and the cached page's
    w.unpin([5], keep=False)  # gives its slot back now
    assert w.slot_of[5] == NO_SLOT and w.num_free == 3 and w.num_cached == 1
    w.check_invariants()


def test_attach_takes_the_least_recently_unpinned_first() -> None:
    w = WindowSlots(3, 10)
    w.attach([1, 2, 3])
    w.unpin([2])
    w.unpin([1])
    w.unpin([3])
    w.pin([2])  # pinned again: no longer cached, so not taken
    w.unpin([2])  # cached again, now the most recent
    w.attach([7, 8])  # no free slot: takes 1's and 3's, the two oldest cached
    assert w.slot_of[1] == w.slot_of[3] == NO_SLOT and w.slot_of[2] != NO_SLOT
    assert sorted([w.slot_of[7], w.slot_of[8]]) == sorted({0, 1, 2} - {w.slot_of[2]})
    assert w.evicted == 2
    w.check_invariants()


def test_pages_a_window_passed_are_taken_before_the_others() -> None:
    w = WindowSlots(4, 10)
    w.attach([1, 2, 3, 4])
    w.unpin([1])  # kept: a window before a sequence's end or a branch point
    w.unpin([2, 3], passed=True)  # a window slid past them
    w.unpin([4])
    w.attach([5, 6])  # the two passed pages go first, though 1 was unpinned before them
    assert w.slot_of[2] == w.slot_of[3] == NO_SLOT
    assert w.slot_of[1] != NO_SLOT and w.slot_of[4] != NO_SLOT
    w.attach([7])  # then the others, least recently unpinned first
    assert w.slot_of[1] == NO_SLOT and w.slot_of[4] != NO_SLOT
    w.pin([4])
    w.unpin([4], passed=True)  # pinned again, then passed: it moves to that order
    w.unpin([5])
    w.attach([8])
    assert w.slot_of[4] == NO_SLOT and w.slot_of[5] != NO_SLOT
    w.check_invariants()


def test_errors_change_nothing() -> None:
    w = WindowSlots(2, 6)
    w.attach([0])
    w.unpin([0])
    w.attach([1])
    before = state(w)
    with pytest.raises(OutOfPages, match="window slot"):
        w.attach([2, 3, 4])  # 1 free + 1 cached < 3
    with pytest.raises(ValueError, match="already has"):
        w.attach([2, 1])
    with pytest.raises(ValueError, match="twice"):
        w.attach([2, 2])
    with pytest.raises(ValueError, match="out of range"):
        w.attach([6])
    with pytest.raises(ValueError, match="out of range"):
        w.pin([-1])
    with pytest.raises(ValueError, match="no window slot"):
        w.pin([1, 3])
    with pytest.raises(ValueError, match="not pinned"):
        w.unpin([1, 1])  # pinned once, listed twice
    with pytest.raises(ValueError, match="not pinned"):
        w.unpin([0])  # cached, not pinned
    with pytest.raises(ValueError, match="not pinned"):
        w.replace(0, 5)
    assert state(w) == before
    w.check_invariants()
    with pytest.raises(ValueError, match="positive int"):
        WindowSlots(0, 4)
    with pytest.raises(ValueError, match="positive int"):
        WindowSlots(4, True)  # type: ignore[arg-type]


def test_page_pool_frees_detach_unpinned_pages() -> None:
    """Wired to ``PagePool.on_free``: a freed unpinned page loses its slot at once; a pinned
    one keeps it for ``replace`` (a duplicate its sequence swaps for the trie's copy)."""
    pool = PagePool(8)
    w = WindowSlots(4, 8)
    pool.on_free = w.release
    a, b, c = pool.alloc(3)
    w.attach([a, b, c])
    w.unpin([a])  # cached
    pool.free([a, b])
    assert w.slot_of[a] == NO_SLOT  # unpinned: detached with the page
    assert w.slot_of[b] != NO_SLOT  # pinned: kept until its sequence moves it
    with pytest.raises(Exception, match="free pages"):
        w.check_invariants(pool)  # (only ever transient, inside SeqKV.commit)
    (d,) = pool.alloc(1)  # the page that replaces b: no slot, so b's moves over
    slot = w.slot_of[b]
    w.replace(b, d)
    assert w.slot_of[d] == slot and w.pinned() == {c: 1, d: 1} and w.slot_of[b] == NO_SLOT
    w.check_invariants(pool)
    (e,) = pool.alloc(1)
    w.attach([e])
    w.unpin([e])  # e is cached with its own slot
    pool.free([c])  # c pinned: kept
    w.replace(c, e)  # e keeps its slot and takes c's pins; c's slot goes back
    assert w.pinned() == {d: 1, e: 1} and w.slot_of[c] == NO_SLOT and w.num_cached == 0
    w.check_invariants(pool)


@pytest.mark.parametrize("seed", range(20))
def test_usable_prefix_is_the_longest_prefix_whose_window_has_slots(seed: int) -> None:
    rng = random.Random(seed)
    ps, window = rng.choice([1, 2, 4, 16]), rng.randrange(1, 40)
    n = rng.randrange(0, 24)
    w = WindowSlots(64, 64)
    pages = rng.sample(range(64), n)
    w.attach([p for p in pages if rng.random() < 0.7])

    def ok(k: int) -> bool:  # the definition: pages holding tokens k*ps - window + 1 .. k*ps - 1
        first = max(0, k * ps - window + 1)
        return all(w.slot_of[pages[t // ps]] != NO_SLOT for t in range(first, k * ps))

    want = max(k for k in range(n + 1) if ok(k))
    assert w.usable_prefix(pages, window, ps) == want


def test_usable_prefix_examples() -> None:
    w = WindowSlots(8, 8)
    w.attach([1, 2, 3])
    # page size 4, window 9: the next token reads the 8 tokens before it, two pages
    assert w.usable_prefix([0, 1, 2, 3], 9, 4) == 4
    assert w.usable_prefix([1, 2, 0, 3], 9, 4) == 2  # page 0 at index 2 breaks 3 and 4
    assert w.usable_prefix([0, 5, 1, 2], 9, 4) == 4  # only the last two pages matter
    assert w.usable_prefix([0, 5], 9, 4) == 0
    assert w.usable_prefix([], 9, 4) == 0
    assert w.usable_prefix([0, 5, 6], 1, 4) == 3  # a window of 1 reads no earlier token


class SlotsMachine(RuleBasedStateMachine):
    """Random attach / pin / unpin / free through the pool / replace against a reference."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(12)
        self.w = WindowSlots(5, 12)
        self.pool.on_free = self.w.release
        self.pins: dict[int, int] = {}  # reference: pinned page -> count
        # reference: cached pages, least recently unpinned first (passed ones, then the others)
        self.passed: list[int] = []
        self.kept: list[int] = []
        self.held: list[int] = []  # pages alloc'd and not freed

    @property
    def cached(self) -> list[int]:
        return self.passed + self.kept  # the order attach takes them in

    def uncache(self, p: int) -> None:
        for order in (self.passed, self.kept):
            if p in order:
                order.remove(p)

    def attached(self) -> set[int]:
        return set(self.pins) | set(self.cached)

    @rule(n=st.integers(1, 3))
    def alloc_and_attach(self, n: int) -> None:
        if self.pool.num_free < n:
            return
        pages = self.pool.alloc(n)
        self.held += pages
        free = self.w.num_slots - len(self.attached())
        if free + len(self.cached) < n:
            with pytest.raises(OutOfPages):
                self.w.attach(pages)
            return
        self.w.attach(pages)
        for p in self.cached[: max(0, n - free)]:
            self.uncache(p)
        for p in pages:
            self.pins[p] = 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data(), keep=st.booleans(), passed=st.booleans())
    def unpin(self, data: st.DataObject, keep: bool, passed: bool) -> None:
        p = data.draw(st.sampled_from(sorted(self.pins)))
        self.w.unpin([p], keep=keep, passed=passed)
        self.pins[p] -= 1
        if not self.pins[p]:
            del self.pins[p]
            if keep:
                (self.passed if passed else self.kept).append(p)

    @precondition(lambda self: self.pins or self.cached)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(sorted(self.attached())))
        self.w.pin([p])
        self.uncache(p)
        self.pins[p] = self.pins.get(p, 0) + 1

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_unpinned(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self.held))
        if p in self.pins:
            return
        self.pool.free([p])
        self.held.remove(p)
        self.uncache(p)

    @precondition(lambda self: self.pins and self.pool.num_free)
    @rule(data=st.data(), new_attached=st.booleans())
    def swap_duplicate(self, data: st.DataObject, new_attached: bool) -> None:
        """A sequence's pinned page freed as a duplicate, replaced by another page."""
        old = data.draw(st.sampled_from(sorted(self.pins)))
        if old not in self.held:
            return
        candidates = self.cached if new_attached else []
        if new_attached and not candidates:
            return
        if new_attached:
            new = data.draw(st.sampled_from(candidates))
        else:
            (new,) = self.pool.alloc(1)
            self.held.append(new)
        self.pool.free([old])
        self.held.remove(old)
        self.w.replace(old, new)
        c = self.pins.pop(old)
        self.uncache(new)
        self.pins[new] = self.pins.get(new, 0) + c

    @invariant()
    def matches_reference(self) -> None:
        self.w.check_invariants(self.pool)
        assert self.w.pinned() == self.pins
        assert self.w.num_cached == len(self.cached)
        assert {p for p, s in enumerate(self.w.slot_of) if s != NO_SLOT} == self.attached()
        assert self.w.num_free == self.w.num_slots - len(self.attached())


SlotsMachine.TestCase.settings = settings(
    max_examples=settings.default.max_examples * 5, stateful_step_count=40
)
TestSlotsMachine = SlotsMachine.TestCase
