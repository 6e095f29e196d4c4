"""Admission order: which waiting sequences the scheduler tries first each step.

``EngineConfig.schedule_policy`` names one of :data:`radixkv.engine.names.SCHEDULE_POLICIES`;
the config validates the name against that table and the ``--schedule-policy`` flag lists its
names, so a new policy is one function here plus its row in the table. A policy returns
candidates in the order the scheduler should try them; the scheduler admits them in that order
while the step budget, ``max_running_requests`` and the pool allow (scheduler.py), so at most
the first ``MAX_CANDIDATES`` matter in practice. A policy reads the queue and the cache (through
``SeqKV.peek_match_len``, which changes nothing) and mutates neither.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

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
