"""The affinity router's knobs (:class:`AffinityConfig`), validated on construction.

They reach the router as ``RequestRouterConfig(request_router_kwargs=...)``; ``ClusterConfig``
builds one up front so a bad value fails in the driver, not inside a replica.
"""

from __future__ import annotations

from dataclasses import dataclass


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
