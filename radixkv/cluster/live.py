"""The affinity routers alive in this process, for operator calls made from the same process.

Ray Serve builds a deployment handle's router inside the process that holds the handle (the
cluster's ingress) and ships the router class pickled by value, with a private copy of its
module's globals. So routers register their state here, in a module every process imports
normally, and the ingress reaches them through it: :func:`live_snapshots` for inspection,
:func:`forget_prefixes` after a fleet-wide cache reset.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TypeVar

from radixkv.cluster.fleet_view import FleetView

_LIVE: weakref.WeakSet[FleetView] = weakref.WeakSet()

V = TypeVar("V", bound=FleetView)


def track(state: V) -> V:
    """Make ``state`` visible to :func:`live_snapshots` (for as long as it is alive)."""
    _LIVE.add(state)
    return state


def live_snapshots() -> list[dict[str, dict[str, int]]]:
    """:meth:`FleetView.snapshot` of every tracked state in this process."""
    return [s.snapshot() for s in list(_LIVE)]


def forget_prefixes(versions: Mapping[str, int]) -> int:
    """Tell every tracked state that these replicas' caches were reset (replica id -> summary
    version right after the reset; see :meth:`FleetView.forget_prefixes`). Returns how many
    states were told."""
    states = list(_LIVE)
    for state in states:
        for rid, version in versions.items():
            state.forget_prefixes(rid, min_version=version)
    return len(states)
