"""Prefix-affinity scoring: which replica should serve a request, given what each one caches.

Pure Python, no Ray: :class:`~radixkv.cluster.router.RadixAffinityRouter` feeds it replica ids,
routing-stats snapshots and routing callbacks; the tests drive it directly.

A request is described by the chained page hashes of its prompt
(:func:`radixkv.cache.hashing.page_hashes`): ``hashes[i]`` names the whole prefix of
``(i + 1) * page_size`` tokens, so "replica R holds ``hashes[i]``" means R can serve the first
``i + 1`` pages from its cache. What a replica holds is known from two sources:

* its routing stats (:class:`ReplicaSummary`, a bounded, most-recent-first list of the block
  hashes in its trie, published by the replica every few seconds, so it lags);
* the router's own record of the prompts it recently sent there (immediate, but only a guess:
  the replica may evict them, or not have computed them yet).

Ranking (:meth:`AffinityState.rank`):

1. A replica is *overloaded* when its load exceeds the least-loaded candidate's by more than
   ``imbalance_abs`` requests **and** is more than ``imbalance_rel`` times it (``max(min, 1)``).
   Both must trip, so small fleets at low load keep their affinity and a large absolute gap at
   high load is tolerated only up to the relative factor. Overloaded replicas go last (least
   loaded first): this is the fall-back to the least-loaded replica.
2. Among the others, the longest match wins (ties: lower load, then less cached).
3. A *weak* best match (fewer than ``min_match_pages`` pages, or less than ``min_match_ratio``
   of the request's pages) is not worth sticking to: the request goes to the replica with the
   least cached (estimated: its stats plus what was routed there since), ties by load. This
   spreads new prefixes over the fleet's free cache.

The result is every candidate in preference order; Ray Serve tries them in that order and still
applies its own back-pressure (a full replica rejects, the next one is tried).

Load of a replica = requests this router has sent there that have not completed, plus
provisional picks not yet confirmed, or the replica's own reported queue length if that is
larger (other routers' requests).

Thread-safety: none; the Ray router calls everything from its event loop.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec


@dataclass(frozen=True, kw_only=True)
class AffinityConfig:
    """Knobs of the affinity router (validated on construction).

    Attributes:
        imbalance_abs: a replica is overloaded when its load exceeds the least-loaded one's by
            more than this many requests (and the relative test trips too).
        imbalance_rel: ... and its load is more than this factor times ``max(min_load, 1)``.
        min_match_pages: best matches shorter than this many pages are weak.
        min_match_ratio: best matches covering less than this fraction of the request's whole
            pages are weak.
        recent_per_replica: how many page hashes the router remembers per replica (its own
            record of what it routed where; oldest forgotten first).
        provisional_ttl_s: a pick not confirmed by Ray within this time is forgotten.
    """

    imbalance_abs: int = 4
    imbalance_rel: float = 2.0
    min_match_pages: int = 1
    min_match_ratio: float = 0.1
    recent_per_replica: int = 4096
    provisional_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.imbalance_abs, bool) or not isinstance(self.imbalance_abs, int):
            raise TypeError(f"imbalance_abs must be an int, got {self.imbalance_abs!r}")
        if self.imbalance_abs < 0:
            raise ValueError(f"imbalance_abs must be >= 0, got {self.imbalance_abs}")
        if not (isinstance(self.imbalance_rel, int | float) and self.imbalance_rel >= 1.0):
            raise ValueError(f"imbalance_rel must be a number >= 1, got {self.imbalance_rel!r}")
        if isinstance(self.min_match_pages, bool) or not isinstance(self.min_match_pages, int):
            raise TypeError(f"min_match_pages must be an int, got {self.min_match_pages!r}")
        if self.min_match_pages < 1:
            raise ValueError(f"min_match_pages must be >= 1, got {self.min_match_pages}")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}")
        if not isinstance(self.recent_per_replica, int) or self.recent_per_replica < 0:
            raise ValueError(
                f"recent_per_replica must be an int >= 0, got {self.recent_per_replica!r}"
            )
        if not self.provisional_ttl_s > 0:
            raise ValueError(f"provisional_ttl_s must be > 0, got {self.provisional_ttl_s}")


class ReplicaSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica reports in ``record_routing_stats()`` (bounded).

    ``block_hashes``: chained page hashes of pages in its trie, most recently stored first, at
    most the replica's bound (so a prefix's early pages may be missing while its later ones are
    present: matching looks for the *deepest* held hash, which names the whole prefix).
    ``truncated``: more blocks are cached than listed. ``version`` changes whenever the trie's
    block set changes.
    """

    block_hashes: list[int] = msgspec.field(default_factory=list)
    cached_tokens: int = 0
    queue_len: int = 0
    page_size: int = 0
    truncated: bool = False
    version: int = 0
    replica: str = ""

    @classmethod
    def from_stats(cls, stats: Mapping[str, Any] | None) -> ReplicaSummary | None:
        """Parse a routing-stats dict; None (and never an exception) when absent or malformed."""
        if not stats:
            return None
        try:
            return msgspec.convert(dict(stats), cls)
        except (msgspec.ValidationError, TypeError):
            return None

    def to_stats(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def longest_chain(hashes: Sequence[int], held: Container[int]) -> int:
    """Pages of the request a holder can serve: 1 + the deepest i with ``hashes[i]`` held.

    Chained hashes make any held ``hashes[i]`` imply the whole prefix up to page i (up to hash
    collisions, which the replica's token comparison makes harmless).
    """
    for i in range(len(hashes) - 1, -1, -1):
        if hashes[i] in held:
            return i + 1
    return 0


@dataclass
class Decision:
    """The outcome of one :meth:`AffinityState.rank` call (also useful for logs and tests)."""

    order: list[str]
    reason: str  # "affinity" | "weak" | "imbalance" | "no-prefix" | "empty"
    match_pages: dict[str, int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)


class _Held:
    """Union of a replica's stats hashes and the router's recent record (a Container)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[int], b: Container[int]) -> None:
        self.a, self.b = a, b

    def __contains__(self, h: object) -> bool:
        return h in self.a or h in self.b


class _Replica:
    __slots__ = ("inflight", "provisional", "raw", "recent", "stats", "stats_set", "unseen")

    def __init__(self) -> None:
        self.raw: object = None  # the last stats object seen (Ray keeps it until it changes)
        self.stats: ReplicaSummary | None = None
        self.stats_set: frozenset[int] = frozenset()
        self.recent: OrderedDict[int, None] = OrderedDict()  # routed page hashes, LRU order
        self.unseen = 0  # recent hashes not (yet) in stats: pages it is probably caching now
        self.inflight: set[str] = set()  # confirmed requests not yet completed
        self.provisional: set[str] = set()


class AffinityState:
    """The router's view of the fleet and its scoring. Replica ids are opaque strings."""

    def __init__(
        self, config: AffinityConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or AffinityConfig()
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        # request id -> (replica picked first, hashes, time): picked but not yet confirmed
        self._pending: dict[str, tuple[str, list[int], float]] = {}
        self._routed: dict[str, str] = {}  # request id -> replica it was confirmed on

    # ------------------------------------------------------------------ fleet bookkeeping
    def _get(self, rid: str) -> _Replica:
        r = self._replicas.get(rid)
        if r is None:
            r = self._replicas[rid] = _Replica()
        return r

    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        """Forget every replica not in ``replica_ids`` (gone, dead or scaled down)."""
        keep = set(replica_ids)
        for rid in [r for r in self._replicas if r not in keep]:
            self.remove_replica(rid)

    def remove_replica(self, rid: str) -> None:
        """Forget a replica and everything routed to it (it died or left the fleet)."""
        rep = self._replicas.pop(rid, None)
        if rep is None:
            return
        for req in rep.inflight:
            self._routed.pop(req, None)
        for req in rep.provisional:
            self._pending.pop(req, None)

    def update_stats(self, rid: str, stats: Mapping[str, Any] | ReplicaSummary | None) -> None:
        """Take a replica's latest routing stats (a no-op when unchanged or unparsable)."""
        rep = self._get(rid)
        if stats is None or stats is rep.raw:
            return  # the same object as last time: nothing to parse
        rep.raw = stats
        summary = stats if isinstance(stats, ReplicaSummary) else ReplicaSummary.from_stats(stats)
        if summary is None or rep.stats == summary:
            return
        rep.stats = summary
        rep.stats_set = frozenset(summary.block_hashes)
        rep.unseen = sum(1 for h in rep.recent if h not in rep.stats_set)

    def load(self, rid: str) -> int:
        rep = self._replicas.get(rid)
        if rep is None:
            return 0
        own = len(rep.inflight) + len(rep.provisional)
        reported = rep.stats.queue_len if rep.stats is not None else 0
        return max(own, reported)

    def cached_estimate(self, rid: str) -> int:
        """Tokens the replica probably caches: its reported count plus pages routed since."""
        rep = self._replicas.get(rid)
        if rep is None:
            return 0
        page = rep.stats.page_size if rep.stats is not None and rep.stats.page_size else 1
        base = rep.stats.cached_tokens if rep.stats is not None else 0
        return base + rep.unseen * page

    def holds(self, rid: str) -> Container[int]:
        rep = self._replicas.get(rid)
        if rep is None:
            return frozenset()
        return _Held(rep.stats_set, rep.recent)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per replica: load, confirmed in-flight, provisional picks, remembered hashes,
        estimated cached tokens (for tests and debugging)."""
        return {
            rid: {
                "load": self.load(rid),
                "inflight": len(rep.inflight),
                "provisional": len(rep.provisional),
                "recent": len(rep.recent),
                "cached_estimate": self.cached_estimate(rid),
            }
            for rid, rep in self._replicas.items()
        }

    # ------------------------------------------------------------------ routing callbacks
    def _remember(self, rep: _Replica, hashes: Sequence[int]) -> None:
        cap = self.config.recent_per_replica
        if cap == 0:
            return
        for h in hashes:
            if h in rep.recent:
                rep.recent.move_to_end(h)
                continue
            rep.recent[h] = None
            if h not in rep.stats_set:
                rep.unseen += 1
            if len(rep.recent) > cap:
                old, _ = rep.recent.popitem(last=False)
                if old not in rep.stats_set:
                    rep.unseen -= 1

    def _expire_pending(self, now: float) -> None:
        ttl = self.config.provisional_ttl_s
        for req in [q for q, (_, _, t) in self._pending.items() if now - t > ttl]:
            self._drop_pending(req)

    def _drop_pending(self, request_id: str) -> None:
        got = self._pending.pop(request_id, None)
        if got is not None:
            rep = self._replicas.get(got[0])
            if rep is not None:
                rep.provisional.discard(request_id)

    def picked(self, request_id: str, rid: str, hashes: Sequence[int]) -> None:
        """The router is about to offer ``rid`` first: count it there provisionally (so
        requests routed before Ray confirms see the load and the prefix)."""
        self._drop_pending(request_id)
        rep = self._get(rid)
        rep.provisional.add(request_id)
        self._pending[request_id] = (rid, list(hashes), self._clock())
        self._remember(rep, hashes)

    def routed(self, request_id: str, rid: str, hashes: Sequence[int] | None = None) -> None:
        """Ray confirmed ``request_id`` runs on ``rid``."""
        pending = self._pending.get(request_id)
        if hashes is None:
            hashes = pending[1] if pending is not None else []
        self._drop_pending(request_id)
        prev = self._routed.pop(request_id, None)
        if prev is not None and prev in self._replicas:
            self._replicas[prev].inflight.discard(request_id)
        rep = self._get(rid)
        rep.inflight.add(request_id)
        self._routed[request_id] = rid
        self._remember(rep, hashes)

    def completed(self, request_id: str, rid: str | None = None) -> None:
        """``request_id`` finished (successfully or not) or was rejected."""
        got = self._routed.get(request_id)
        if got is not None and (rid is None or got == rid):
            self._routed.pop(request_id, None)
            rep = self._replicas.get(got)
            if rep is not None:
                rep.inflight.discard(request_id)

    # ------------------------------------------------------------------ scoring
    def rank(self, candidates: Sequence[str], hashes: Sequence[int]) -> Decision:
        """All ``candidates`` in preference order for a request with these page hashes."""
        if not candidates:
            return Decision([], "empty")
        cfg = self.config
        self._expire_pending(self._clock())
        index = {rid: i for i, rid in enumerate(candidates)}
        loads = {rid: self.load(rid) for rid in candidates}
        matches = {rid: longest_chain(hashes, self.holds(rid)) for rid in candidates}
        cached = {rid: self.cached_estimate(rid) for rid in candidates}
        min_load = min(loads.values())
        limit_rel = cfg.imbalance_rel * max(min_load, 1)

        def overloaded(rid: str) -> bool:
            lo = loads[rid]
            return lo - min_load > cfg.imbalance_abs and lo > limit_rel

        ok = [r for r in candidates if not overloaded(r)]  # never empty: min_load's replica
        over = sorted((r for r in candidates if overloaded(r)), key=lambda r: (loads[r], index[r]))
        best = max(matches[r] for r in ok)
        if not hashes:  # shorter than a page: nothing to match, balance the load
            ok.sort(key=lambda r: (loads[r], cached[r], index[r]))
            return Decision(ok + over, "no-prefix", matches, loads)
        weak = best < cfg.min_match_pages or best < math.ceil(cfg.min_match_ratio * len(hashes))
        if weak:
            ok.sort(key=lambda r: (cached[r], loads[r], index[r]))
            reason = "weak"
        else:
            ok.sort(key=lambda r: (-matches[r], loads[r], cached[r], index[r]))
            reason = "affinity"
        if over and max(matches[r] for r in over) > best:
            reason = "imbalance"  # the best match was skipped for load
        return Decision(ok + over, reason, matches, loads)


# Routers register their state here (this module is imported normally in every process, while
# Ray Serve ships the router class itself pickled by value, with a private copy of its globals).
_LIVE: weakref.WeakSet[AffinityState] = weakref.WeakSet()


def track(state: AffinityState) -> AffinityState:
    """Make ``state`` visible to :func:`live_snapshots` (for as long as it is alive)."""
    _LIVE.add(state)
    return state


def live_snapshots() -> list[dict[str, dict[str, int]]]:
    """:meth:`AffinityState.snapshot` of every tracked state in this process."""
    return [s.snapshot() for s in list(_LIVE)]
