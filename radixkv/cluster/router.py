"""RadixAffinityRouter: a Ray Serve request router that sends requests where their prefix is.

Configured on the engine deployment with
``RequestRouterConfig(request_router_class=RadixAffinityRouter, request_router_kwargs={...})``
(the kwargs are :class:`~radixkv.cluster.affinity.AffinityConfig` fields). It routes calls made
through a ``DeploymentHandle`` (the cluster's ingress), whose keyword argument
``prefix_hashes`` carries the request's chained page hashes (see ``hinting.py``).

Each routing attempt (:meth:`choose_replicas`):

1. refreshes the per-replica view from ``RunningReplica.routing_stats`` (what each replica's
   ``record_routing_stats()`` last returned; Ray pulls it every ``request_routing_stats_period_s``),
2. ranks every candidate with :meth:`AffinityState.rank` (longest held chain, load guard,
   weak matches to the least-cached replica),
3. counts the request provisionally on its first choice, so that requests routed before Ray
   confirms this one see both the load and the prefix there,
4. returns the candidates one per rank, in preference order: Ray tries the first, and when it
   rejects (``max_ongoing_requests`` reached) the next, so Ray's back-pressure still applies.

:meth:`on_request_routed` (Ray confirmed the replica) and :meth:`on_request_completed` keep
the router's own in-flight counts and its record of which prefixes went where; dead replicas
are forgotten in :meth:`on_replica_actor_died` and when the replica set changes.
"""

from __future__ import annotations

import logging
from typing import Any

from radixkv.cluster._ray import import_serve

import_serve()

# The default router's class has no public import path in Ray 2.60 (it is the value of
# RequestRouterConfig's default, "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter").
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # noqa: E402
from ray.serve.request_router import (  # noqa: E402
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from radixkv.cluster.affinity import (  # noqa: E402
    AffinityConfig,
    AffinityState,
    Decision,
    track,
)

log = logging.getLogger("radixkv.cluster.router")

HINT_KWARG = "prefix_hashes"
PIN_KWARG = "pin_replica"  # a replica's unique id: operator calls (stats) aimed at one replica


def _rid(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


def _pinned(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> RunningReplica | None:
    if pending_request is None:
        return None
    pin = pending_request.kwargs.get(PIN_KWARG)
    if pin is None:
        return None
    return next((r for r in candidates if _rid(r.replica_id) == pin), None)


def request_hashes(pending_request: PendingRequest | None) -> list[int]:
    """The page hashes the ingress attached to a request (empty when there are none)."""
    if pending_request is None:
        return []
    hashes = pending_request.kwargs.get(HINT_KWARG)
    if not isinstance(hashes, list | tuple):
        return []
    return [h for h in hashes if isinstance(h, int)]


class RadixAffinityRouter(RequestRouter):
    """Prefix-affinity routing with load guards; see the module doc."""

    def initialize_state(self, **kwargs: Any) -> None:
        # Ray Serve pickles this class by value (a private copy of this module's globals), so
        # the state is tracked in radixkv.cluster.live, which every process imports normally.
        self.affinity = track(AffinityState(AffinityConfig(**kwargs)))
        self.last_decision: Decision | None = None

    def _state(self) -> AffinityState:
        # initialize_state is called by Serve with request_router_kwargs; be safe if it was not.
        if not hasattr(self, "affinity"):
            self.initialize_state()
        return self.affinity

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            if pending_request is not None:  # counted like any request until it completes
                self._state().picked(
                    pending_request.metadata.internal_request_id, _rid(pinned.replica_id), []
                )
            return [[pinned]]
        state = self._state()
        by_id: dict[str, RunningReplica] = {}
        for r in candidate_replicas:
            rid = _rid(r.replica_id)
            by_id[rid] = r
            state.update_stats(rid, r.routing_stats)
        hashes = request_hashes(pending_request)
        decision = state.rank(list(by_id), hashes)
        self.last_decision = decision
        if not decision.order:
            return []
        if pending_request is not None:
            state.picked(pending_request.metadata.internal_request_id, decision.order[0], hashes)
        return [[by_id[rid]] for rid in decision.order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self._state().routed(
            pending_request.metadata.internal_request_id,
            _rid(replica_id),
            request_hashes(pending_request),
        )

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._state().completed(internal_request_id, _rid(replica_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._state().remove_replica(_rid(replica_id))
        log.warning("replica %s died; no longer routing to it", replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._state().set_replicas(_rid(r.replica_id) for r in replicas)


class PinnablePowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, plus honouring ``pin_replica`` (operator calls such as
    per-replica stats). Every other request is routed exactly as by the default router; the
    cluster uses it for ``router="default"`` fleets so they can be inspected the same way."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = _pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return [[pinned]]
        return await super().choose_replicas(candidate_replicas, pending_request)
