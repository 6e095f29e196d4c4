"""The router's view of the fleet: what each replica probably caches, and its load.

Pure Python, no Ray. :class:`FleetView` is the bookkeeping half of
:class:`~radixkv.cluster.affinity.AffinityState` (which adds the ranking); replica ids are opaque
strings (Ray's replica unique ids in the real router).

A request is described by the chained page hashes of its prompt
(:func:`radixkv.cache.hashing.page_hashes`): ``hashes[i]`` names the whole prefix of
``(i + 1) * page_size`` tokens, so "replica R holds ``hashes[i]``" means R can serve the first
``i + 1`` pages from its cache. What a replica holds is known from two sources:

* its routing stats (:class:`~radixkv.cluster.summary.ReplicaSummary`, a bounded,
  most-recent-first list of the block hashes in its trie, published by the replica every few
  seconds, so it lags);
* the router's own record of the prompts it recently sent there (immediate, but only a guess:
  the replica may evict them, or not have computed them yet).

Load of a replica = requests this router has sent there that have not completed, plus
provisional picks not yet confirmed, or the replica's own reported queue length if that is
larger (other routers' requests).

When a replica's cache is reset (:meth:`FleetView.forget_prefixes`) both sources are cleared,
and stats the replica published before the reset (a lower summary ``version``) are ignored if
they arrive afterwards.

Thread-safety: none; the Ray router calls everything from its event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from radixkv.cluster.affinity_config import AffinityConfig
from radixkv.cluster.summary import ReplicaSummary


class _Held:
    """Union of a replica's stats hashes and the router's recent record (a Container)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[int], b: Container[int]) -> None:
        self.a, self.b = a, b

    def __contains__(self, h: object) -> bool:
        return h in self.a or h in self.b


class _Replica:
    __slots__ = (
        "inflight",
        "min_version",
        "provisional",
        "raw",
        "recent",
        "stats",
        "stats_set",
        "unseen",
    )

    def __init__(self) -> None:
        self.raw: object = None  # the last stats object seen (Ray keeps it until it changes)
        self.stats: ReplicaSummary | None = None
        self.stats_set: frozenset[int] = frozenset()
        self.recent: OrderedDict[int, None] = OrderedDict()  # routed page hashes, LRU order
        self.unseen = 0  # recent hashes not (yet) in stats: pages it is probably caching now
        self.inflight: set[str] = set()  # confirmed requests not yet completed
        self.provisional: set[str] = set()
        self.min_version = 0  # stats older than this predate a cache reset: ignored


_DONE_EARLY_MAX = 4096  # completions awaiting a confirmation that may never come (rejections)


class FleetView:
    """Per-replica contents, load and routing record (see the module doc)."""

    def __init__(
        self, config: AffinityConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or AffinityConfig()
        self._clock = clock
        self._replicas: dict[str, _Replica] = {}
        # request id -> (replica picked first, hashes, time): picked but not yet confirmed
        self._pending: dict[str, tuple[str, list[int], float]] = {}
        self._routed: dict[str, str] = {}  # request id -> replica it was confirmed on
        # request id -> replica: completed before Ray confirmed it (see ``completed``)
        self._done_early: dict[str, str] = {}

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
        """Take a replica's latest routing stats (a no-op when unchanged, unparsable, or
        published before the replica's last cache reset)."""
        rep = self._get(rid)
        if stats is None or stats is rep.raw:
            return  # the same object as last time: nothing to parse
        rep.raw = stats
        summary = stats if isinstance(stats, ReplicaSummary) else ReplicaSummary.from_stats(stats)
        if summary is None or rep.stats == summary or summary.version < rep.min_version:
            return
        rep.stats = summary
        rep.stats_set = frozenset(summary.block_hashes)
        rep.unseen = sum(1 for h in rep.recent if h not in rep.stats_set)

    def forget_prefixes(self, rid: str, *, min_version: int = 0) -> None:
        """The replica's cache was reset: drop every page hash it was thought to hold (from its
        stats and from the routing record) and its cached-token count. Stats with a summary
        version below ``min_version`` (the replica's version right after the reset) are stale
        and will be ignored. Load counts are kept: those requests still run there (and their
        prefixes, locked while they run, survive the reset; the next stats will show them)."""
        rep = self._get(rid)
        rep.recent.clear()
        rep.unseen = 0
        rep.stats_set = frozenset()
        if rep.stats is not None:
            rep.stats = msgspec.structs.replace(
                rep.stats, block_hashes=[], cached_tokens=0, truncated=False
            )
        rep.min_version = max(rep.min_version, min_version)

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
        self._done_early.pop(request_id, None)  # a new attempt: an earlier ending is not its
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
        if self._done_early.get(request_id) == rid:  # it already completed there
            del self._done_early[request_id]
            self._remember(self._get(rid), hashes)
            return
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
        elif got is None and rid is not None:
            # Ray registers the completion callback before it confirms the route, so a fast
            # call (an operator call pinned to a replica) can complete first: remember it, so
            # that the confirmation arriving next does not count it in flight forever.
            self._done_early[request_id] = rid
            while len(self._done_early) > _DONE_EARLY_MAX:
                del self._done_early[next(iter(self._done_early))]
