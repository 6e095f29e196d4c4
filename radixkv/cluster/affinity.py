"""Prefix-affinity scoring: which replica should serve a request, given what each one caches.

Pure Python, no Ray: :class:`~radixkv.cluster.router.RadixAffinityRouter` feeds it replica ids,
routing-stats snapshots and routing callbacks; the tests drive it directly. What the router
knows about each replica (its stats, its own routing record, its load) is kept by
:class:`~radixkv.cluster.fleet_view.FleetView`, which :class:`AffinityState` extends with the
ranking.

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

This module also re-exports the names that used to live here (:class:`AffinityConfig`,
:class:`ReplicaSummary`, :func:`track`, :func:`live_snapshots`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from radixkv.cluster.affinity_config import AffinityConfig
from radixkv.cluster.fleet_view import FleetView
from radixkv.cluster.live import forget_prefixes, live_snapshots, track
from radixkv.cluster.summary import ReplicaSummary

__all__ = [
    "AffinityConfig",
    "AffinityState",
    "Decision",
    "FleetView",
    "ReplicaSummary",
    "forget_prefixes",
    "live_snapshots",
    "longest_chain",
    "track",
]


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


class AffinityState(FleetView):
    """The router's view of the fleet (:class:`FleetView`) and its scoring. Replica ids are
    opaque strings."""

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
