"""Admission order: which waiting sequences the scheduler tries first each step.

``EngineConfig.schedule_policy`` names one of :data:`radixkv.engine.names.SCHEDULE_POLICIES`;
the config validates the name against that table and the ``--schedule-policy`` flag lists its
names, so a new policy is one function here plus its row in the table. A policy returns
candidates in the order the scheduler should try them; the scheduler admits them in that order
while the step budget, ``max_running_requests`` and the pool allow (scheduler.py), so at most
the first ``MAX_CANDIDATES`` matter in practice. A policy reads the queue and the cache (through
``SeqKV.peek_match_len``, which changes nothing) and mutates neither.

Fair admission (:func:`fair_order`, on unless ``EngineConfig.fair_admission`` is off) wraps the
policy: the scheduler hands it the queue and each tenant's running count, and it interleaves
the tenants (``SamplingParams.tenant``: the server's API key) max-min by running sequences, the
policy's order within each tenant. Requests without a tenant are one tenant, so an engine user
who sets none gets the policy's order exactly.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping

from radixkv.engine.kv_manager import SeqKV
from radixkv.engine.request import Sequence

# Beyond this many waiting, matching every one of them each step costs more than it saves; a
# long queue is looked at from its head only (deferred candidates cost a match each).
MAX_CANDIDATES = 128

AdmissionOrder = Callable[[deque[Sequence], SeqKV], list[Sequence]]


def fcfs(waiting: deque[Sequence], kv: SeqKV) -> list[Sequence]:
    """Arrival order (preempted sequences are at the front of the queue, so they resume first)."""
    return list(itertools.islice(waiting, MAX_CANDIDATES))


def lpm(waiting: deque[Sequence], kv: SeqKV) -> list[Sequence]:
    """Longest cached prefix first, so a shared prefix is hit while it is still cached; among
    equal matches, arrival order. Plain arrival order when the cache is off or the queue long."""
    if not kv.enabled or len(waiting) > MAX_CANDIDATES:
        return fcfs(waiting, kv)
    scored = [(-kv.peek_match_len(s), i, s) for i, s in enumerate(waiting)]
    scored.sort(key=lambda t: (t[0], t[1]))  # stable: arrival order among equal matches
    return [s for _, _, s in scored]


def priority(waiting: deque[Sequence], kv: SeqKV) -> list[Sequence]:
    """``SamplingParams.priority`` first (lower values first), then as :func:`lpm` among equal
    priorities. (The scheduler also keeps its running list in this order and preempts from its
    end, so the lowest priority gives way first.)"""
    return sorted(lpm(waiting, kv), key=lambda s: s.params.priority)  # stable: lpm within


def fair_order(
    waiting: deque[Sequence],
    kv: SeqKV,
    order: AdmissionOrder,
    running: Mapping[str | None, int],
    max_running: int | None,
) -> list[Sequence]:
    """Fair admission: the waiting sequences of different tenants (``Sequence.tenant``)
    interleaved, each tenant's in the order ``order`` gives them among its own (so LPM or
    priority still decides within a tenant's share), and no tenant past ``max_running``.

    Max-min by running sequences: each next candidate is the best of the tenant with the
    fewest running sequences so far (``running``, counting the candidates already placed), ties
    broken by whose sequence waits nearest the queue's head (a preempted one is there). So with
    T tenants waiting and none running more than the others, a tenant's k-th candidate is among
    the next T*k admissions, however long the others' queues are; a tenant with fewer running
    comes first until it has caught up. Candidates of a tenant at ``max_running`` (None: no
    cap) are left out. Each tenant's queue is cut to ``MAX_CANDIDATES`` by its policy, as one
    queue is, so one tenant's thousand waiting requests cannot push the others' out of view.
    """
    if max_running is None and len({s.tenant for s in waiting}) <= 1:
        return order(waiting, kv)  # one tenant, no cap: exactly the policy's order
    queues: dict[str | None, deque[Sequence]] = {}
    head: dict[str | None, int] = {}  # queue position of each tenant's first waiting sequence
    for i, s in enumerate(waiting):
        t = s.tenant
        q = queues.get(t)
        if q is None:
            queues[t] = q = deque()
            head[t] = i
        q.append(s)
    cap = math.inf if max_running is None else max_running
    ranked = {t: order(q, kv) for t, q in queues.items()}
    # (running so far, head position, tenant): head positions differ, tenants never compared
    heap = [(running.get(t, 0), head[t], t) for t in queues]
    heapq.heapify(heap)
    taken = dict.fromkeys(queues, 0)
    out: list[Sequence] = []
    while heap:
        n, pos, t = heapq.heappop(heap)
        if n >= cap:
            continue  # this tenant runs as many as it may: its others wait
        i = taken[t]
        out.append(ranked[t][i])
        taken[t] = i + 1
        if i + 1 < len(ranked[t]):
            heapq.heappush(heap, (n + 1, pos, t))
    return out
